"""``knit run`` end to end (real stores, vLLM rollout, 2-rank Megatron trainer), small; and Ctrl-C.

Both runs are subprocesses (``python -m launcher run``, i.e. ``knit run``). The loop test checks the run folder: the
summary keys, the plots, that versions advanced and reached the engine, that every consumed
trajectory was received exactly once, that no payload went through the driver, and that the engine
started from the trainer's weights (the first step's trainer/rollout logprob gap is ~0). The Ctrl-C
test interrupts a run and checks that every process it started is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
B, G, K, BATCHES = 4, 4, 2, 2


def _alive_children(out: Path) -> list[str]:
    """The children the driver started (``logs/children.json``) that are still running."""
    alive = []
    for c in json.loads((out / "logs" / "children.json").read_text()):
        try:
            state = Path(f"/proc/{c['pid']}/stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z":
            alive.append(f"{c['name']} (pid {c['pid']})")
    return alive


def _procs_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (the run folder of a test run)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if text in cmd and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from launcher.model import prepare_model

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    prepare_model(path)
    return path


def _cmd(out: Path, model_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "launcher", "run", "--plain", "--out", str(out), "--model-dir", str(model_dir),
            "--train-batch-groups", str(B), "--group-size", str(G), "--mini-batches", str(K),
            "--train-batches", str(BATCHES), "--max-tokens", "24", "--timeout-s", "200", *extra]


def test_knit_run_quick_loop(model_dir: Path, tmp_path: Path) -> None:
    from launcher.children import child_env

    out = tmp_path / "run"
    res = subprocess.run(_cmd(out, model_dir), cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=240, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "knit run: summary" in res.stdout
    doc = json.loads((out / "summary.json").read_text())
    r = doc["policies"]["mini_batch"]
    for key in ("arch_staleness_mean", "arch_staleness_max", "trajectories_consumed", "driver_payload_bytes"):
        assert key in r
    for name in ("staleness_per_step.png", "time_breakdown.png", "reward_per_train_batch.png"):
        assert (out / name).stat().st_size > 1000
    assert (out / "metadata.parquet").exists() and (out / "consumed.parquet").exists()

    rows = BATCHES * B * G
    assert r["trajectories_consumed"] == r["rows_received"] == rows  # every consumed trajectory once ...
    assert r["duplicate_rows"] == 0  # ... and no row received twice
    assert r["steps"] == BATCHES * K and r["final_version"] == BATCHES * K  # versions advanced
    assert r["driver_payload_bytes"] == 0
    assert sum(r["bytes_per_rank"].values()) > 0 and len(r["bytes_per_rank"]) == 2
    assert r["rollout"]["groups"] == BATCHES * B and r["rollout"]["aborted_groups"] == 0
    assert max(r["rollout"]["policy_versions"]) > 0  # published weights reached the running engine
    assert r["abs_logp_diff_first_step"] < 1e-4  # the engine started from the trainer's version-0 weights
    assert 0 <= r["arch_staleness_mean"] <= r["arch_staleness_max"]
    assert not _procs_mentioning(str(out)), "processes of the run are still alive"
    assert not _alive_children(out)

    import polars as pl

    meta = pl.read_parquet(out / "metadata.parquet")
    assert meta.height == rows and meta["node"].n_unique() == 2  # both store nodes held groups


def test_ctrl_c_stops_every_process(model_dir: Path, tmp_path: Path) -> None:
    from launcher.children import child_env

    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, model_dir, "--train-batches", "50"), cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "progress.jsonl").exists():  # training has started
            time.sleep(0.5)
        assert (out / "progress.jsonl").exists(), "the run did not start training"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output
    time.sleep(1.0)
    assert not _procs_mentioning(str(out)), "processes of the interrupted run are still alive"
    names = [c["name"] for c in json.loads((out / "logs" / "children.json").read_text())]
    assert names == ["store0", "store1", "trainer", "rollout"]
    assert not _alive_children(out)
    assert (out / "metadata.parquet").exists()  # the stores' metadata was saved before they stopped
    assert json.loads((out / "policy_summary.json").read_text())["interrupted"] is True
