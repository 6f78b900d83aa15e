"""The rollout's two engines on the same run: vLLM in the rollout's process vs a vLLM server driven over HTTP.

``python -m bench.engines [--quick] [--model tiny|smollm2-135m] --out F.json``

One ``knit run`` per engine, the same model, seed and settings (``--quick``: 3 train batches, else 10):
``--engine vllm`` (``connectors.engine.VllmEngine``: the rollout reads each published version's weights and
reloads them in place) and ``--engine vllm-server`` (the run's own ``vllm serve``, driven by
``connectors.served.ServedEngine``; the server reads each version from the stores itself through knittrans'
weight-transfer engine, under vLLM's ``/pause`` ``/start_weight_update`` ``/update_weights``
``/finish_weight_update`` ``/resume``). Per engine:

* ``trajectories_per_s``: trained trajectories per second (the run summary's throughput, the trainer's window);
* ``rollout_tokens_per_s``: tokens the rollout generated per second of its generation;
* ``sync_s_p50`` / ``sync_s_max``: for each version the engine loaded, seconds from the end of the trainer step
  that made it (``progress.jsonl`` ``t_end``) to the moment the engine ran it (``rollout.json``
  ``weight_loaded_at``: the load done and generation going on under it; the first token follows within one
  engine step);
* ``load_s_mean``: the load itself (reading the weights included); ``loads``; ``engine_start_s``.

Ratios: ``server_vs_inprocess_trajectories_per_s`` and ``server_vs_inprocess_sync_s_p50``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._common import write_result

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("vllm", "vllm-server")


def engine_figures(run: Path) -> dict[str, float]:
    """One run folder's figures (module docstring)."""
    summary = json.loads((run / "policy_summary.json").read_text())
    rollout = json.loads((run / "rollout.json").read_text())
    made = {}  # version -> end of the step that made it
    for line in (run / "progress.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            made[int(rec["version"])] = float(rec["t_end"])
    sync = [at - made[v] for v, at in rollout["weight_loaded_at"] if v in made]
    return {"trajectories_per_s": float(summary["throughput"]["trajectories_per_s"]),
            "rollout_tokens_per_s": float(rollout["tokens_per_s"]),
            "sync_s_p50": statistics.median(sync) if sync else float("nan"),
            "sync_s_max": max(sync) if sync else float("nan"),
            "load_s_mean": float(rollout["weight_load_s_mean"]), "loads": float(rollout["weight_loads"]),
            "load_failures": float(rollout["weight_load_failures"]),
            "engine_start_s": float(rollout["engine_start_s"])}


def run_engine(engine: str, model: str, train_batches: int, out: Path) -> Path:
    """One ``knit run`` on ``engine``; its run folder."""
    cmd = [sys.executable, "-m", "launcher", "run", "--model", model, "--engine", engine, "--plain",
           "--train-batches", str(train_batches), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        msg = f"knit run --engine {engine} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        raise RuntimeError(msg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 train batches per run (else 10)")
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"))
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-engines", help="the run folders")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    train_batches = 3 if args.quick else 10
    metrics: dict[str, Any] = {}
    for engine in ENGINES:
        figures = engine_figures(run_engine(engine, args.model, train_batches, args.runs / engine))
        metrics.update({f"engines_{k}_{engine.replace('-', '_')}": v for k, v in figures.items()})
        print(engine, json.dumps(figures))

    def ratio(key: str) -> float:
        return metrics[f"engines_{key}_vllm_server"] / metrics[f"engines_{key}_vllm"]

    ratios = {"server_vs_inprocess_trajectories_per_s": ratio("trajectories_per_s"),
              "server_vs_inprocess_sync_s_p50": ratio("sync_s_p50")}
    write_result(args.out, metrics, ratios, {"model": args.model, "train_batches": train_batches, "quick": args.quick,
                                             "engines": list(ENGINES)})
    print(json.dumps(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
