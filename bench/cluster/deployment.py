"""Named deployments: the compute a train step costs on a real cluster, and the time dilation that keeps its ratio to
the link when the cluster benchmark runs it on emulated hosts.

A :class:`NamedDeployment` names a model (its parameters), the accelerators of one host (how many, their peak dense
bf16 rate, the MFU a trainer reaches on them), the host's NIC rate and the passes a step makes over every token
(the update, forward and backward, and the forward passes of the old-policy and reference log-probabilities).
Its compute per 1k tokens is that of one host: ``1000 x flops_per_token / (gpus x peak x mfu)``, with
``flops_per_token = 2 x params x (3 x update + old_logprob + reference)`` (a forward is 2 FLOPs a parameter, a
backward twice that).

The benchmark's hosts share one machine, so a deployment runs time-dilated (:func:`dilate`): the link rate is
divided by a factor and the compute multiplied by the same factor, so that the compute-to-link ratio, which
decides how much of the transfer a step hides, is the deployment's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

H100_BF16_FLOPS = 989e12
"""An H100 SXM's peak dense bf16 rate (FLOP/s)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NamedDeployment:
    """One named cluster: model, accelerators per host, NIC, MFU and the passes of a train step."""

    name: str
    """The preset's name (``model/accelerators/nic``)."""
    params: float
    """Model parameters (language model and vision tower together)."""
    gpus_per_host: int = 8
    """Accelerators on one host: one host's DP ranks share its NIC."""
    gpu_flops: float = H100_BF16_FLOPS
    """Peak dense rate of one accelerator (FLOP/s)."""
    mfu: float = 0.4
    """Fraction of the peak a trainer reaches."""
    nic_gbit: float = 100.0
    """The host's network rate, each way (Gbit/s)."""
    update_passes: int = 1
    """Forward and backward passes of the policy update over every token (PPO epochs)."""
    old_logprob_passes: int = 1
    """Forward passes recomputing the old policy's log-probabilities."""
    reference_passes: int = 1
    """Forward passes of the reference model (the KL term)."""

    def __post_init__(self) -> None:
        if not self.name or self.params <= 0 or self.gpus_per_host < 1 or self.gpu_flops <= 0:
            msg = (f"deployment {self.name!r}: params={self.params}, gpus_per_host={self.gpus_per_host} and "
                   f"gpu_flops={self.gpu_flops} must be positive")
            raise ValueError(msg)
        if not 0 < self.mfu <= 1 or self.nic_gbit <= 0:
            msg = f"deployment {self.name!r}: mfu={self.mfu} must be in (0, 1] and nic_gbit={self.nic_gbit} > 0"
            raise ValueError(msg)
        if self.update_passes < 1 or self.old_logprob_passes < 0 or self.reference_passes < 0:
            msg = (f"deployment {self.name!r}: update_passes={self.update_passes} must be >= 1, "
                   f"old_logprob_passes={self.old_logprob_passes} and reference_passes={self.reference_passes} >= 0")
            raise ValueError(msg)

    @property
    def flops_per_token(self) -> float:
        """FLOPs of one token through every pass of a step."""
        return 2.0 * self.params * (3 * self.update_passes + self.old_logprob_passes + self.reference_passes)

    @property
    def compute_ms_per_ktok(self) -> float:
        """One host's accelerator time per 1k tokens (ms), all its accelerators on it."""
        return 1e3 * 1e3 * self.flops_per_token / (self.gpus_per_host * self.gpu_flops * self.mfu)

    @property
    def nic_mbit(self) -> float:
        """The NIC rate in Mbit/s."""
        return 1e3 * self.nic_gbit


PRESETS: dict[str, NamedDeployment] = {d.name: d for d in (
    NamedDeployment(name="qwen2.5-0.5b/h100x8/100gbit", params=0.494e9),
    NamedDeployment(name="qwen2.5-vl-3b/h100x8/100gbit", params=3.75e9),
    NamedDeployment(name="qwen2.5-7b/h100x8/100gbit", params=7.62e9),
    NamedDeployment(name="qwen2.5-7b/h100x8/400gbit", params=7.62e9, nic_gbit=400.0),
    NamedDeployment(name="qwen2.5-vl-7b/h100x8/100gbit", params=8.29e9),
    NamedDeployment(name="qwen2.5-vl-7b/h100x8/400gbit", params=8.29e9, nic_gbit=400.0),
)}
"""The named deployments ``--deployment`` takes (parameters from the models' published configurations)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Dilated:
    """A deployment as the benchmark runs it: its link rate and compute scaled by one factor."""

    deployment: NamedDeployment
    """What is emulated."""
    factor: float
    """How much slower than the deployment the emulation runs (link rate / factor, compute x factor)."""

    @property
    def link_mbit(self) -> float:
        """The emulated hosts' link rate (Mbit/s)."""
        return self.deployment.nic_mbit / self.factor

    @property
    def compute_ms_per_ktok(self) -> float:
        """The emulated ranks' compute per 1k tokens (ms)."""
        return self.deployment.compute_ms_per_ktok * self.factor

    def record(self) -> dict[str, Any]:
        """What the result JSON records: the deployment, the factor, the derived rates."""
        return {"deployment": asdict(self.deployment), "factor": self.factor, "link_mbit": self.link_mbit,
                "compute_ms_per_ktok": self.compute_ms_per_ktok,
                "deployment_compute_ms_per_ktok": self.deployment.compute_ms_per_ktok}


def dilate(name: str, link_mbit: float) -> Dilated:
    """The preset ``name`` run with links of ``link_mbit`` Mbit/s (the factor follows from the NIC rate)."""
    if name not in PRESETS:
        msg = f"unknown deployment {name!r}; the presets are {sorted(PRESETS)}"
        raise ValueError(msg)
    if link_mbit <= 0:
        msg = f"link_mbit={link_mbit} must be > 0"
        raise ValueError(msg)
    d = PRESETS[name]
    return Dilated(deployment=d, factor=d.nic_mbit / link_mbit)
