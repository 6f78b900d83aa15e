"""Where the processes of a ``knit run`` start: one :class:`Site` per store node, the rollout and the trainer.

A site is an address the process binds and advertises (store nodes listen on it, trainer rank 0's
rendezvous is on it), a command prefix that starts a process there (``ip netns exec NAME`` for a host
of ``launcher.hosts``; ``ssh HOST`` would do for a real one) and environment variables it needs (e.g.
``GLOO_SOCKET_IFNAME``, the interface gloo binds: by default gloo resolves the machine's hostname,
which is not an address of a network namespace). :meth:`Placement.local` is everything on loopback,
``knit run``'s default, exactly as without a placement.

Example:
    >>> p = Placement.local(2)
    >>> [s.address for s in p.stores], p.rollout.command(["python"]), len(p.trainer)
    (['127.0.0.1', '127.0.0.1'], ['python'], 1)
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

from admission.config import LinkModel


@dataclass(kw_only=True, slots=True)
class Site:
    """Where one process runs."""

    address: str = "127.0.0.1"
    """IP address the process binds and advertises (a literal: never ``0.0.0.0`` or ``::``, nobody can reach that)."""
    exec_prefix: list[str] = field(default_factory=list)
    """Command prefix that starts a process there (empty = this machine, this network namespace)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables a process there gets on top of the launcher's."""
    name: str = "local"
    """What reports call the site."""

    def __post_init__(self) -> None:
        try:
            ip = ipaddress.ip_address(self.address)
        except ValueError:
            msg = f"Site.address must be an IP address, got {self.address!r}"
            raise ValueError(msg) from None
        if ip.is_unspecified:
            msg = f"Site.address={self.address!r} is unspecified: give the address others reach the process at"
            raise ValueError(msg)
        if not all(isinstance(a, str) and a for a in self.exec_prefix):
            msg = f"Site.exec_prefix must be non-empty strings, got {self.exec_prefix!r}"
            raise ValueError(msg)

    @property
    def url_host(self) -> str:
        """The address as a URL's host (IPv6 in brackets)."""
        return f"[{self.address}]" if ":" in self.address else self.address

    @property
    def is_local(self) -> bool:
        """Whether processes here run in this machine's network namespace (no prefix)."""
        return not self.exec_prefix

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as started at this site."""
        return [*self.exec_prefix, *cmd]


@dataclass(kw_only=True, slots=True)
class Placement:
    """The site of every process of a run.

    ``trainer`` holds one site (all ranks start there as one process, ``--nproc D``, as on one machine) or
    one per rank (rank ``r`` at ``trainer[r]``, each a process of its own joined over torch.distributed
    with ``MASTER_ADDR`` = ``trainer[0].address``).
    """

    stores: list[Site]
    """One site per store node."""
    rollout: Site
    """The rollout worker's site."""
    trainer: list[Site]
    """The trainer's site, or one per rank."""
    master_port: int = 29500
    """The trainer ranks' rendezvous port on ``trainer[0]`` when they run one per site."""
    probe_s: float | None = None
    """Seconds between two reachability probes of every running store node (a host can be cut off while its
    process runs: the report then lists the outage); ``None`` = no probes (on one machine a node is
    unreachable only when its process died, which the launcher sees anyway)."""

    def __post_init__(self) -> None:
        if not self.stores or not self.trainer:
            msg = f"Placement needs at least one store site and one trainer site, got {self.stores} / {self.trainer}"
            raise ValueError(msg)
        if not 1 <= self.master_port <= 65535:
            msg = f"Placement.master_port must be in 1..65535, got {self.master_port}"
            raise ValueError(msg)
        if self.probe_s is not None and self.probe_s <= 0:
            msg = f"Placement.probe_s must be positive seconds or None, got {self.probe_s}"
            raise ValueError(msg)

    @classmethod
    def local(cls, num_stores: int) -> Placement:
        """Everything on this machine's loopback (``knit run``'s default)."""
        return cls(stores=[Site() for _ in range(num_stores)], rollout=Site(), trainer=[Site()])

    def check(self, *, num_stores: int, dp_ranks: int) -> None:
        """Raise ValueError unless there is one site per store node and one trainer site (or one per rank)."""
        if len(self.stores) != num_stores:
            msg = f"Placement has {len(self.stores)} store sites for num_stores={num_stores}"
            raise ValueError(msg)
        if len(self.trainer) not in (1, dp_ranks):
            msg = f"Placement has {len(self.trainer)} trainer sites: give 1 (all ranks there) or dp_ranks={dp_ranks}"
            raise ValueError(msg)

    def home_stores(self) -> list[int]:
        """The store nodes (by index) on the rollout's host: the nodes its groups are written to with ``local``
        placement (``RolloutConfig.home_nodes``)."""
        return [i for i, s in enumerate(self.stores) if _host(s) == _host(self.rollout)]

    def link_model(self, locations: Sequence[str], ranks: int, given: LinkModel | None = None) -> LinkModel:
        """Where the store nodes (at ``locations``, in order) and the ``ranks`` trainer ranks sit, for the planner's
        rank split (``AdmissionConfig.links``): a host is a site's address and command prefix. The rates come
        from ``given``; so do the hosts when it names any (:meth:`LinkModel.placed`)."""
        trainer = self.trainer if self.ranks_apart else self.trainer * ranks
        nodes = {loc: _host(s) for loc, s in zip(locations, self.stores, strict=True)}
        return (given or LinkModel()).placed(nodes, tuple(_host(s) for s in trainer))

    @property
    def ranks_apart(self) -> bool:
        """Whether each trainer rank runs as a process of its own at its own site."""
        return len(self.trainer) > 1


def _host(site: Site) -> str:
    """A name for the machine (or network namespace) a site is on."""
    return " ".join([*site.exec_prefix, site.address])
