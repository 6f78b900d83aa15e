"""Weight sync at real size: SmolLM2-135M from the trainer's step end to the engine running the new version.

``python -m bench.weight_sync [--quick] [--cache runs/.models] --out F.json``

One store node (in this process), and two processes of their own:

* the **engine**: the rollout's vLLM engine (``connectors.engine.VllmEngine``) on the converted
  SmolLM2-135M-Instruct checkpoint (``connectors.checkpoint``); it polls the published version every
  20 ms, and for each new one fetches its weights (``get_weights``: one DoGet), loads them into the
  running engine (``load_weights``) and generates one token with them;
* the **trainer**: the Megatron GPT built from the same folder (``ModelConfig(hf_checkpoint=DIR)``); per
  version it changes every weight (a step's worth), marks the step's end, then publishes exactly as the
  trainer loop does (``train.loop.publish_weights``: gather under HF names, a weights table in record
  batches of ``schemas.weights.CHUNK_BYTES``, one DoPut; then ``publish_version``), and waits for the
  engine to report that version before the next (no overlap between syncs).

Half the versions go as float32 (the parameters' dtype), half as bfloat16 (``publish_dtype``). Per
dtype: seconds from the step's end to the engine's first token with the new weights (``sync_s``) and
its parts (publish, the engine noticing it, fetch, load, the first token), bytes on the wire per leg
(the table's bytes: trainer -> store, store -> engine) and MB/s of each leg. ``--quick``: 2 versions
per dtype, else 4. Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._common import write_result

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("params", "bfloat16")


def _trainer(location: str, model_dir: str, out: str, done: str, per_dtype: int) -> None:
    import torch

    from flight_store.publishing import StorePublisher
    from flight_store.writing import StoreWriter
    from train import mcore_compat, model
    from train.config import ModelConfig, ParallelConfig
    from train.loop import publish_weights

    env = mcore_compat.init_distributed(ParallelConfig(backend="gloo"), seed=1234)
    gpt, _ = model.build_gpt(ModelConfig(hf_checkpoint=model_dir), tensor_parallel=1)
    built = type("Built", (), {"gpt": gpt})()
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    with StorePublisher(location, timeout=120.0) as client, StoreWriter.sharing(client) as rollout:
        for version, dtype in enumerate((d for d in DTYPES for _ in range(per_dtype)), start=1):
            with torch.no_grad():
                for p in gpt.parameters():
                    p.add_(1e-3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
            t_end = time.time()  # the optimizer step is over
            publish_weights(built, client, version, env, dtype=dtype)
            t_put = time.time()
            client.publish_version(version)
            t_pub = time.time()
            nbytes = rollout.get_weights(version).column("data").nbytes
            rows.append({"version": version, "dtype": dtype, "t_step_end": t_end, "t_put": t_put,
                         "t_published": t_pub, "bytes": nbytes})
            while not Path(f"{done}.{version}").exists():  # the engine runs it
                time.sleep(0.01)
    Path(out).write_text(json.dumps(rows))
    mcore_compat.shutdown()


def _engine(location: str, model_dir: str, out: str, done: str, versions: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from connectors.config import RolloutConfig
    from connectors.engine import VllmEngine
    from flight_store.writing import StoreWriter

    engine = VllmEngine(RolloutConfig(model=model_dir, stores=[location], max_model_len=256, max_num_seqs=4))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = [TokensPrompt(prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8])]
    engine.llm.generate(prompt, params, use_tqdm=False)  # warm
    Path(f"{done}.ready").touch()
    rows: list[dict[str, Any]] = []
    current = 0
    with StoreWriter(location, timeout=120.0) as client:
        while current < versions:
            published = client.get_version()
            if published <= current:
                time.sleep(0.02)
                continue
            t_seen = time.time()
            table = client.get_weights(published)
            t_fetched = time.time()
            engine.load_weights(table)
            t_loaded = time.time()
            engine.llm.generate(prompt, params, use_tqdm=False)
            t_token = time.time()
            current = published
            rows.append({"version": published, "t_seen": t_seen, "t_fetched": t_fetched, "t_loaded": t_loaded,
                         "t_first_token": t_token})
            Path(f"{done}.{published}").touch()
    Path(out).write_text(json.dumps(rows))


def child_env() -> dict[str, str]:
    """The children's environment: offline, one OpenMP thread each, the project on the path."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    return env


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def run(cache: Path, out: Path, *, per_dtype: int) -> dict[str, Any]:
    """Convert (or reuse) the checkpoint, run both processes around one store node, summarise."""
    from flight_store.server import StoreServer

    model_dir = _prepare_checkpoint(cache)
    work = out.parent / (out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    done = str(work / "done")
    for stale in work.glob("done.*"):
        stale.unlink()
    with StoreServer() as server:
        _run_engine_and_trainer(server.location, model_dir, work, done, per_dtype)
    metrics = _summarise(json.loads((work / "trainer.json").read_text()),
                         {r["version"]: r for r in json.loads((work / "engine.json").read_text())})
    ratios = {"sync_bf16_vs_fp32": round(metrics["bfloat16"]["sync_s"] / metrics["float32"]["sync_s"], 3),
              "bytes_bf16_vs_fp32": round(metrics["bfloat16"]["wire_bytes_per_leg"]
                                          / metrics["float32"]["wire_bytes_per_leg"], 3)}
    return write_result(out, metrics, ratios, {"per_dtype": per_dtype, "model": Path(model_dir).name,
                                               "params": 134_515_008})


def _prepare_checkpoint(cache: Path) -> str:
    """The converted SmolLM2 checkpoint's folder (``connectors.checkpoint``, in a child process)."""
    res = subprocess.run([sys.executable, "-m", "connectors.checkpoint", str(cache)], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=600)
    if res.returncode:
        msg = f"the checkpoint could not be prepared: {res.stderr[-2000:]}"
        raise RuntimeError(msg)
    return res.stdout.strip().splitlines()[-1]


def _run_engine_and_trainer(location: str, model_dir: str, work: Path, done: str, per_dtype: int) -> None:
    """The engine process (started first, waited for until ready) and the trainer process, to their end."""
    from flight_store.net import free_port

    versions = per_dtype * len(DTYPES)
    cmd = [sys.executable, "-m", "bench.weight_sync", "--role", "engine", location, model_dir,
           str(work / "engine.json"), done, str(versions)]
    engine = subprocess.Popen(cmd, cwd=ROOT, env=child_env())
    try:
        deadline = time.time() + 300
        while not Path(f"{done}.ready").exists():
            if engine.poll() is not None or time.time() > deadline:
                msg = f"the engine did not start (exit {engine.returncode})"
                raise RuntimeError(msg)
            time.sleep(0.2)
        env = child_env()
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        subprocess.run([sys.executable, "-m", "bench.weight_sync", "--role", "trainer", location, model_dir,
                        str(work / "trainer.json"), done, str(per_dtype)], cwd=ROOT, env=env, check=True,
                       timeout=900)
        engine.wait(timeout=120)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def _summarise(trainer: list[dict[str, Any]], got: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per dtype, medians over its syncs of each leg: the trainer's rows joined to the engine's by version."""
    metrics: dict[str, Any] = {}
    for dtype in DTYPES:
        rows = [(t, got[t["version"]]) for t in trainer if t["dtype"] == dtype]
        name = "float32" if dtype == "params" else dtype
        nbytes = rows[0][0]["bytes"]
        put = [t["t_put"] - t["t_step_end"] for t, _ in rows]
        fetch = [e["t_fetched"] - e["t_seen"] for _, e in rows]
        metrics[name] = {
            "sync_s": _median([e["t_first_token"] - t["t_step_end"] for t, e in rows]),
            "publish_s": _median([t["t_published"] - t["t_step_end"] for t, _ in rows]),
            "noticed_s": _median([e["t_seen"] - t["t_published"] for t, e in rows]),
            "fetch_s": _median(fetch),
            "load_s": _median([e["t_loaded"] - e["t_fetched"] for _, e in rows]),
            "first_token_s": _median([e["t_first_token"] - e["t_loaded"] for _, e in rows]),
            "wire_bytes_per_leg": nbytes,
            "put_mb_s": round(nbytes / 1e6 / statistics.median(put), 1),
            "fetch_mb_s": round(nbytes / 1e6 / statistics.median(fetch), 1),
            "syncs": len(rows),
        }
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weight_sync", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 syncs per dtype (else 4)")
    p.add_argument("--cache", type=Path, default=ROOT / "runs" / ".models", help="model cache (wheels/ inside)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/weight_sync.json"))
    p.add_argument("--role", choices=["trainer", "engine"], default=None, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "trainer":
        location, model_dir, out, done, n = args.rest
        _trainer(location, model_dir, out, done, int(n))
        return 0
    if args.role == "engine":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        location, model_dir, out, done, n = args.rest
        _engine(location, model_dir, out, done, int(n))
        return 0
    doc = run(args.cache, args.out, per_dtype=2 if args.quick else 4)
    print(json.dumps(doc["metrics"], indent=1), json.dumps(doc["ratios"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
