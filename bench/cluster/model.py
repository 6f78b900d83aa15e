"""The cluster model: a train step's transfer and step time per path, from bytes per link, per-call costs and the
single controller's serialisation rate; validated on the benchmark's emulated hosts, extrapolated to clusters.

Per train step, ``R`` a host's link rate each way (bytes/s), ``m`` a rank's micro-batches, ``C`` the busiest
rank's compute:

* knittrans: ``T = L + m c_knit + I p / w + P``: ``L`` the busiest link's bytes / ``R`` (a store's uplink or a
  rank's downlink: the ranks read in parallel), a read call per micro-batch (``c_knit``), the image processor on
  the ``I`` images the busiest rank host processes (``p`` per image, ``w`` workers), ``P`` the controller's scan
  and plan.
* TransferQueue: ``T = L + m c_tq + c_look + k c_key``: the same parallel reads (``get_data`` per micro-batch)
  with the images processed at the rollout, and the controller's key lookup (a call, and ``k`` keys at ``c_key``).
* verl: ``T = (B_in + B_out) / R + B / S + 2 c_verl``: the batch into the driver, then out of it, one after the
  other (``B_in``, ``B_out`` the driver link's bytes each way), the driver's own work on its ``B`` bytes at the
  serialisation rate ``S``, a gather and a dispatch call.
* Step: ``T + C`` for verl (its data all arrives before a rank computes); ``max(C, T) + min(C, T) / m`` for the
  prefetching paths (only the first micro-batch's transfer is exposed, or the compute hides under the transfer).

On the measured points ``L``, ``B_in``, ``B_out`` are the veth counters' bytes and ``P`` the driver's measured
scan-and-plan time; the costs are the bench's calibration (:mod:`bench.cluster.calibrate`). Extrapolated
(:func:`scenario_point`), the bytes follow from the workload (``bytes_per_token`` of each path's layout, images
raw once per group and host for knittrans, processed per row for the peers), hash placement's skew from balls
into bins. ``python -m bench.cluster.model [--calibration RESULT.json] --out F.json`` prints and writes the table
for 64, 256 and 1,024 GPUs, 100 and 400 Gbit/s, Qwen2.5-7B text and Qwen2.5-VL-7B with 4 images a prompt.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.cluster.deployment import PRESETS, NamedDeployment

PATHS = ("verl", "transferqueue", "knittrans")


@dataclass(frozen=True, kw_only=True, slots=True)
class Costs:
    """What a call and the controller cost: measured on its hosts by the bench (``--calibration``); the defaults are
    assumed round figures."""

    knit_call_s: float = 0.002
    """One knittrans read call, bytes aside (s)."""
    tq_call_s: float = 0.004
    """One TransferQueue ``get_data`` call, bytes aside (s)."""
    tq_lookup_s: float = 0.002
    """TransferQueue's controller key lookup, per call (s)."""
    tq_lookup_s_per_key: float = 2e-5
    """TransferQueue's controller key lookup, per key (s)."""
    verl_call_s: float = 0.004
    """One call of verl's worker group, bytes aside (s)."""
    controller_bytes_per_s: float = 4e8
    """verl's driver: bytes of batch it unpickles, concatenates, reorders, chunks and pickles per second."""
    process_s_per_image: float = 0.017
    """The Qwen2-VL image processor on one 448x448 image, one CPU core (s)."""

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not v > 0:
                msg = f"Costs.{k}={v} must be > 0"
                raise ValueError(msg)

    @classmethod
    def from_result(cls, doc: dict[str, Any]) -> Costs:
        """The calibration of a bench.cluster result (the first (N, D) run's; the image cost scaled to 448x448
        by pixels where the run's images were smaller)."""
        cal = doc["params"]["calibration"][0]
        known = {k: float(v) for k, v in cal.items() if k in cls.__dataclass_fields__}
        side = doc["params"].get("image_side")
        if "process_s_per_image" in known and side:
            known["process_s_per_image"] *= (448 / side) ** 2
        return cls(**known)


@dataclass(frozen=True, kw_only=True, slots=True)
class Load:
    """One path's work in one train step, as the model takes it."""

    busiest_link_bytes: float
    """Bytes over the busiest link, one way (knittrans, TransferQueue)."""
    driver_in_bytes: float = 0.0
    """Bytes into the single controller (verl's gather)."""
    driver_out_bytes: float = 0.0
    """Bytes out of the single controller (verl's dispatch)."""
    controller_bytes: float = 0.0
    """Bytes the single controller serialises (verl)."""
    micro_batches: int = 1
    """Micro-batches of the busiest rank (a read call each)."""
    keys: int = 0
    """Keys the controller looks up (TransferQueue)."""
    lookups: int = 0
    """Key lookup calls of the controller (TransferQueue: one per step)."""
    images_processed: float = 0.0
    """Images the busiest rank host runs the processor on, per processor worker (knittrans)."""
    plan_s: float = 0.0
    """The controller's metadata scan and planning (knittrans)."""


def transfer_s(path: str, load: Load, rate: float, costs: Costs) -> float:
    """The module docstring's ``T`` of ``path`` (``rate`` in bytes/s)."""
    if path == "verl":
        links = (load.driver_in_bytes + load.driver_out_bytes) / rate
        return links + load.controller_bytes / costs.controller_bytes_per_s + 2 * costs.verl_call_s
    if path == "transferqueue":
        calls = (load.micro_batches * costs.tq_call_s + load.lookups * costs.tq_lookup_s
                 + load.keys * costs.tq_lookup_s_per_key)
        return load.busiest_link_bytes / rate + calls
    if path in ("knittrans", "knittrans_hash"):
        return (load.busiest_link_bytes / rate + load.micro_batches * costs.knit_call_s
                + load.images_processed * costs.process_s_per_image + load.plan_s)
    msg = f"unknown path {path!r}; the model knows {PATHS} and knittrans_hash"
    raise ValueError(msg)


def step_s(path: str, transfer: float, compute: float, micro_batches: int) -> float:
    """The module docstring's step of ``path``: serial for verl, prefetched for the others."""
    if path == "verl":
        return transfer + compute
    return max(compute, transfer) + min(compute, transfer) / max(micro_batches, 1)


def rel_error(predicted: float, measured: float) -> float:
    """``|predicted - measured| / measured``."""
    if measured <= 0:
        msg = f"measured={measured} must be > 0 to compare a prediction with it"
        raise ValueError(msg)
    return abs(predicted - measured) / measured


def hash_skew(groups: float, nodes: int) -> float:
    """The busiest node's groups over the mean when ``groups`` land on ``nodes`` at random (balls into bins: the
    mean plus ``sqrt(2 mean ln nodes)``, at least one whole group, at most all groups on one node)."""
    if nodes <= 1 or groups <= 0:
        return 1.0
    mean = groups / nodes
    busiest = max(mean + math.sqrt(2.0 * mean * math.log(nodes)), math.ceil(mean))
    return min(busiest / mean, float(nodes))


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    """A cluster and its workload, every assumption of an extrapolated point a parameter."""

    deployment: NamedDeployment
    """Model, accelerators per host, NIC, MFU, passes."""
    gpus: int
    """Accelerators in all (trainer and rollout)."""
    train_fraction: float = 0.5
    """Share of the accelerators that train (the rest generate, each rollout host holding a store node)."""
    prompts_per_gpu: int = 4
    """Prompts per train step per trainer accelerator."""
    group_size: int = 8
    """Responses per prompt."""
    prompt_len: int = 512
    """Prompt tokens."""
    response_mean: int = 1024
    """Mean response tokens."""
    response_length: int = 4096
    """The rollout's ``response_length`` that verl pads every response to."""
    micro_batches: int = 8
    """Micro-batches per rank per step."""
    images_per_prompt: int = 0
    """Images each prompt carries (0: text)."""
    image_side: int = 448
    """Image height and width (RGB)."""
    process_workers: int = 8
    """CPU workers per trainer host running the image processor (one per rank)."""
    plan_s: float = 0.05
    """knittrans' scan and plan per step (the planner's bound at 1,000 nodes)."""
    knit_bytes_per_token: float = 13.0
    """knittrans' payload per token: int32 ids, float32 log-probs, int32 versions, a mask byte."""
    tq_bytes_per_token: float = 9.0
    """TransferQueue's payload per token: the ids, log-probs and mask as nested tensors."""
    verl_bytes_per_padded_token: float = 48.0
    """verl's bytes per padded token: int64 ids, mask, positions over prompt + response, int64 responses and
    mask and float32 log-probs and advantages over the response."""
    hash_placement: bool = False
    """knittrans' groups placed by the hash (skewed) instead of on their rollout host."""
    costs: Costs = field(default_factory=Costs)
    """Per-call and controller costs."""

    def __post_init__(self) -> None:
        hosts = self.gpus * min(self.train_fraction, 1 - self.train_fraction) / self.deployment.gpus_per_host
        if not 0 < self.train_fraction < 1 or hosts < 1:
            msg = (f"gpus={self.gpus} with train_fraction={self.train_fraction} must leave at least one host of "
                   f"{self.deployment.gpus_per_host} accelerators on each side")
            raise ValueError(msg)


def scenario_point(sc: Scenario) -> dict[str, float]:
    """Transfer and step (s) of every path, and knittrans' ratios, at one extrapolated point."""
    dep = sc.deployment
    d_hosts = sc.gpus * sc.train_fraction / dep.gpus_per_host
    n_hosts = sc.gpus * (1 - sc.train_fraction) / dep.gpus_per_host
    rate = dep.nic_gbit * 1e9 / 8
    train_gpus = sc.gpus * sc.train_fraction
    prompts = sc.prompts_per_gpu * train_gpus
    rows = prompts * sc.group_size
    tokens = rows * (sc.prompt_len + sc.response_mean)
    image_tokens = rows * sc.images_per_prompt * (sc.image_side // 28) ** 2  # 14x14 patches merged 2x2
    compute = (tokens + image_tokens) * dep.flops_per_token / (train_gpus * dep.gpu_flops * dep.mfu)
    raw_image = 3 * sc.image_side**2
    processed_image = (sc.image_side // 14) ** 2 * 1176 * 4  # float32 patches of 14x14x3x2 values
    skew = hash_skew(prompts, math.ceil(n_hosts)) if sc.hash_placement else 1.0
    knit_total = tokens * sc.knit_bytes_per_token + prompts * sc.images_per_prompt * raw_image
    knit = Load(busiest_link_bytes=max(knit_total / d_hosts, skew * knit_total / n_hosts),
                micro_batches=sc.micro_batches, plan_s=sc.plan_s,
                images_processed=prompts / d_hosts * sc.images_per_prompt / sc.process_workers)
    tq_total = tokens * sc.tq_bytes_per_token + rows * sc.images_per_prompt * processed_image
    tq = Load(busiest_link_bytes=max(tq_total / d_hosts, tq_total / n_hosts), micro_batches=sc.micro_batches,
              keys=int(rows), lookups=1)
    verl_total = (rows * (sc.prompt_len + sc.response_length) * sc.verl_bytes_per_padded_token
                  + rows * sc.images_per_prompt * processed_image)
    verl = Load(busiest_link_bytes=verl_total, driver_in_bytes=verl_total, driver_out_bytes=verl_total,
                controller_bytes=verl_total, micro_batches=sc.micro_batches)
    out: dict[str, float] = {"compute_s": compute, "trainer_hosts": d_hosts, "store_hosts": n_hosts, "skew": skew}
    for path, load in (("verl", verl), ("transferqueue", tq), ("knittrans", knit)):
        t = transfer_s(path, load, rate, sc.costs)
        out[f"transfer_s_{path}"] = t
        out[f"step_s_{path}"] = step_s(path, t, compute, sc.micro_batches)
    for peer in ("verl", "transferqueue"):
        out[f"step_vs_{peer}"] = out[f"step_s_{peer}"] / out["step_s_knittrans"]
        out[f"transfer_vs_{peer}"] = out[f"transfer_s_{peer}"] / out["transfer_s_knittrans"]
    return out


WORKLOADS = {"qwen2.5-7b text": ("qwen2.5-7b", 0), "qwen2.5-vl-7b 4 images": ("qwen2.5-vl-7b", 4)}
"""The extrapolated workloads: a model family and images per prompt."""


def table(costs: Costs, gpus: Sequence[int] = (64, 256, 1024),
          nics: Sequence[int] = (100, 400)) -> list[dict[str, Any]]:
    """Every extrapolated point: each workload at each GPU count and NIC rate (other parameters at defaults)."""
    rows = []
    for name, (model, images) in WORKLOADS.items():
        for nic in nics:
            dep = PRESETS[f"{model}/h100x8/{nic}gbit"]
            for g in gpus:
                sc = Scenario(deployment=dep, gpus=g, images_per_prompt=images, costs=costs)
                rows.append({"workload": name, "gpus": g, "nic_gbit": nic, **scenario_point(sc)})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown (step times in seconds, ratios knittrans' advantage)."""
    head = ("| workload | GPUs | NIC Gbit/s | compute s | step s verl / TQ / knittrans | step vs verl | step vs TQ "
            "| transfer vs verl |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['gpus']} | {r['nic_gbit']} | {r['compute_s']:.2f} | "
                     f"{r['step_s_verl']:.2f} / {r['step_s_transferqueue']:.2f} / {r['step_s_knittrans']:.2f} | "
                     f"{r['step_vs_verl']:.2f} | {r['step_vs_transferqueue']:.2f} | {r['transfer_vs_verl']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.model", description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", help="a bench.cluster result JSON whose measured costs the model takes")
    parser.add_argument("--out", required=True, help="the table as JSON")
    args = parser.parse_args(list(argv) if argv is not None else None)
    costs = Costs.from_result(json.loads(Path(args.calibration).read_text())) if args.calibration else Costs()
    rows = table(costs)
    Path(args.out).write_text(json.dumps({"costs": asdict(costs), "scenario_defaults": _defaults(), "rows": rows},
                                         indent=1))
    print(render(rows))
    return 0


def _defaults() -> dict[str, Any]:
    sc = Scenario(deployment=PRESETS["qwen2.5-7b/h100x8/100gbit"], gpus=64)
    doc = asdict(sc)
    doc.pop("deployment")
    doc.pop("gpus")
    doc.pop("costs")
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
