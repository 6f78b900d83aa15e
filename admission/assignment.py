"""Which DP rank reads which prompt group of a mini-batch: by links (where moving it is cheapest) or by tokens.

A mini-batch's groups sit on store nodes; each rank reads its groups' rows from their nodes. With
``AdmissionConfig.assignment == "tokens"`` the split is LPT on the cost model alone
(:func:`lpt_ranks`), blind to where a group is. With ``"links"``
(:func:`group_ranks`), a group read by a rank on its node's host moves over no link, and one read
across hosts loads the store host's uplink and the rank host's downlink with its bytes
(``AdmissionConfig.links``); the split keeps every rank's cost within 5% of LPT's largest (:data:`BALANCE_SLACK`)
and makes the busiest link's bytes / rate as small as a greedy pass gets it:

1. groups in LPT order (cost, then bytes, descending);
2. each goes to the least-loaded rank on its own node's host when that rank stays under the cost cap
   (local first);
3. else to the least-loaded rank of the rank host whose downlink is least loaded (bytes / rate), among the
   hosts with a rank under the cap;
4. else, as LPT would, to the least-loaded rank.

Guarantees (``tests/test_admission_assignment.py``): whole groups per rank, every group on one rank; every
rank gets a group when there are at least D groups; no rank's cost above ``1.05 x`` LPT's largest; the
busiest link's bytes / rate never above LPT's split (the LPT split is returned when the greedy one is not
better). Pure: numpy and the standard library only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from admission.config import AdmissionConfig, LinkModel

BALANCE_SLACK = 1.05
"""The ``links`` split keeps every rank's cost at most this factor above LPT's largest rank cost."""


@dataclass(frozen=True, slots=True)
class Network:
    """Hosts of a mini-batch's groups and of the ranks as indices into one host table, and the hosts' rates."""

    group_host: np.ndarray
    """[groups] int: the host of each group's store node."""
    rank_host: np.ndarray
    """[ranks] int: the host of each rank."""
    up: np.ndarray
    """[hosts] float: Mbit/s out of each host."""
    down: np.ndarray
    """[hosts] float: Mbit/s into each host."""

    @classmethod
    def of(cls, nodes: Sequence[str], links: LinkModel, ranks: int) -> Network:
        """The network of groups stored on ``nodes`` (one per group) read by ``ranks`` ranks."""
        index: dict[str, int] = {}
        host_of = {n: index.setdefault(links.host_of_node(n), len(index)) for n in dict.fromkeys(nodes)}
        group_host = np.fromiter(map(host_of.__getitem__, nodes), dtype=np.int64, count=len(nodes))
        rank_host = np.array([index.setdefault(links.host_of_rank(r), len(index)) for r in range(ranks)],
                             dtype=np.int64)
        hosts = list(index)
        return cls(group_host=group_host, rank_host=rank_host,
                   up=np.array([links.rate_up(h) for h in hosts], dtype=np.float64),
                   down=np.array([links.rate_down(h) for h in hosts], dtype=np.float64))

    def link_seconds(self, rank_of: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Seconds each host's uplink and downlink carries when group ``i`` is read by rank ``rank_of[i]``."""
        dest = self.rank_host[rank_of]
        remote = dest != self.group_host
        bits = np.asarray(nbytes, dtype=np.float64)[remote] * 8.0
        n = len(self.up)
        up = np.bincount(self.group_host[remote], weights=bits, minlength=n) / (self.up * 1e6)
        down = np.bincount(dest[remote], weights=bits, minlength=n) / (self.down * 1e6)
        return up, down

    def busiest_link_s(self, rank_of: np.ndarray, nbytes: np.ndarray) -> float:
        """The busiest link's bytes / rate, seconds, when group ``i`` is read by rank ``rank_of[i]``."""
        up, down = self.link_seconds(rank_of, nbytes)
        return float(max(up.max(initial=0.0), down.max(initial=0.0)))


def balance_groups(costs: np.ndarray, ranks: int) -> list[list[int]]:
    """LPT partition of groups (by cost) into ``ranks`` lists of group indices, in index order
    (:func:`lpt_ranks`)."""
    return _split(lpt_ranks(costs, ranks), ranks)


def lpt_ranks(costs: np.ndarray, ranks: int) -> np.ndarray:
    """[groups] int: the rank of each group under LPT by cost; every rank gets at least one group when there are
    at least ``ranks`` groups.

    Groups go in decreasing cost (then index), each to the rank of least load (then fewest groups, then lowest
    index), so the result is deterministic. It runs in rounds, not one group at a time: a round sorts the ranks
    by that key and gives the next groups to the ranks in that order for as long as each rank's load stays below
    every load the round has made so far (so each is the least rank a one-at-a-time pass would find); at the
    first rank that does not, or a tie, the round ends and the next sorts again.
    """
    if ranks < 1:
        msg = f"ranks must be >= 1, got {ranks}"
        raise ValueError(msg)
    c = np.asarray(costs, dtype=np.float64)
    order = np.lexsort((np.arange(len(c)), -c))
    cost = c[order]
    rank_at = np.empty(len(c), dtype=np.int64)  # the rank of the i-th group in LPT order
    load, count, index = np.zeros(ranks), np.zeros(ranks, dtype=np.int64), np.arange(ranks)
    i = 0
    while i < len(c):
        by_key = np.lexsort((index, count, load))
        m = min(ranks, len(c) - i)
        new = load[by_key[:m]] + cost[i:i + m]
        below = load[by_key[1:m]] < np.minimum.accumulate(new)[:m - 1]
        take = m if below.all() else 1 + int(np.argmin(below))
        who = by_key[:take]
        rank_at[i:i + take] = who
        load[who] = new[:take]
        count[who] += 1
        i += take
    out = np.empty(len(c), dtype=np.int64)
    out[order] = rank_at
    return out


def _split(rank_of: np.ndarray, ranks: int) -> list[list[int]]:
    """Group indices per rank, in index order, of ``rank_of`` (the rank of each group)."""
    split: list[list[int]] = [[] for _ in range(ranks)]
    for i, r in enumerate(rank_of.tolist()):
        split[r].append(i)
    return split


def assign_groups(costs: np.ndarray, nbytes: np.ndarray, nodes: Sequence[str],
                  config: AdmissionConfig) -> list[list[int]]:
    """Group indices per rank, in index order, of :func:`group_ranks`."""
    return _split(group_ranks(costs, nbytes, nodes, config), config.dp_ranks)


def group_ranks(costs: np.ndarray, nbytes: np.ndarray, nodes: Sequence[str], config: AdmissionConfig) -> np.ndarray:
    """Split a mini-batch's groups over ``config.dp_ranks`` ranks as ``config.assignment`` says.

    Args:
        costs: [groups] each group's cost (``admission.packing.trajectory_cost`` summed over its rows).
        nbytes: [groups] each group's payload bytes.
        nodes: each group's store node (the metadata frame's ``node``).
        config: the ranks, the assignment and the link model.

    Returns:
        [groups] int: the rank of each group.
    """
    ranks = config.dp_ranks
    lpt = lpt_ranks(costs, ranks)
    if config.assignment == "tokens" or ranks == 1 or len(costs) == 0:
        return lpt
    net = Network.of(nodes, config.links, ranks)
    cap = BALANCE_SLACK * _max_load(costs, lpt, ranks)
    greedy = _greedy(np.asarray(costs, dtype=np.float64), np.asarray(nbytes, dtype=np.float64), net, cap)
    if (_max_load(costs, greedy, ranks) > cap
            or (len(costs) >= ranks and np.unique(greedy).size < ranks)
            or net.busiest_link_s(greedy, nbytes) > net.busiest_link_s(lpt, nbytes)):
        return lpt
    return greedy


def _max_load(costs: np.ndarray, rank_of: np.ndarray, ranks: int) -> float:
    return float(np.bincount(rank_of, weights=np.asarray(costs, dtype=np.float64), minlength=ranks).max(initial=0.0))


def _greedy(costs: np.ndarray, nbytes: np.ndarray, net: Network, cap: float) -> np.ndarray:
    """The greedy pass of the module docstring: the rank of each group."""
    groups = len(costs)
    cap += 1e-9 * max(cap, 1.0)  # LPT's own largest rank must fit under its cap whatever the float rounding
    by_host: dict[int, list[tuple[float, int]]] = {}  # host -> heap of (load, rank)
    for r, h in enumerate(net.rank_host.tolist()):
        by_host.setdefault(h, []).append((0.0, r))
    seconds_per_byte = (8.0 / (net.down * 1e6)).tolist()
    down = [0.0] * len(net.down)
    version = [0] * len(net.down)
    hosts = [(0.0, 0, h) for h in sorted(by_host)]  # heap of (downlink seconds, version, host); old versions skipped
    parked: list[tuple[float, int]] = []  # heap of (load - cap, host): hosts with no room for the current group
    rank_at: list[int] = []  # the rank of each group in the order they are placed
    order = np.lexsort((np.arange(groups), -nbytes, -costs))
    cost = costs[order].tolist()
    smallest = min(cost, default=0.0)
    uniform = len({seconds_per_byte[h] for h in by_host}) == 1  # then the least busy downlink stays so after
    host_of = net.rank_host.tolist()
    push, replace = heapq.heappush, heapq.heapreplace
    for c, home, nbyte in zip(cost, net.group_host[order].tolist(), nbytes[order].tolist(), strict=True):
        heap = by_host.get(home)
        if heap is None or heap[0][0] + c > cap:  # no rank of the group's own host has room: read it across hosts
            if uniform:
                heap = _least_busy(hosts, parked, by_host, version, down, home, c, cap, smallest)
            else:  # downlinks of different rates: the one that would end least busy, by a scan
                fits = [(down[h] + nbyte * seconds_per_byte[h], h) for h, ranks in by_host.items()
                        if h != home and ranks[0][0] + c <= cap]
                heap = by_host[min(fits)[1]] if fits else None
            if heap is None:  # no rank has room under the cap: the least-loaded rank, as LPT
                heap = min(by_host.values(), key=lambda x: x[0])
            h = host_of[heap[0][1]]
            if h != home:
                down[h] += nbyte * seconds_per_byte[h]
                version[h] += 1
                push(hosts, (down[h], version[h], h))
        load, r = heap[0]
        rank_at.append(r)
        replace(heap, (load + c, r))
    rank_of = np.empty(groups, dtype=np.int64)
    rank_of[order] = rank_at
    return rank_of


def _least_busy(hosts: list[tuple[float, int, int]], parked: list[tuple[float, int]],
                by_host: dict[int, list[tuple[float, int]]], version: list[int], down: list[float], home: int,
                c: float, cap: float, smallest: float) -> list[tuple[float, int]] | None:
    """The rank heap of the least busy downlink's host, other than ``home``, with a rank under the cap for a group
    of cost ``c`` (None when there is none). Hosts with no room for it are parked until the groups get smaller
    (they come in decreasing cost); hosts with no room for the smallest group leave for good."""
    while parked and -parked[0][0] >= c:
        h = heapq.heappop(parked)[1]
        heapq.heappush(hosts, (down[h], version[h], h))
    found, passed = None, []
    while hosts:
        entry = heapq.heappop(hosts)
        h = entry[2]
        if entry[1] != version[h]:
            continue
        least = by_host[h][0][0]
        if h == home:
            passed.append(entry)
        elif least + c <= cap:  # taken: the caller pushes it back with its new load
            found = by_host[h]
            break
        elif least + smallest <= cap:
            heapq.heappush(parked, (least - cap, h))
    for entry in passed:
        heapq.heappush(hosts, entry)
    return found
