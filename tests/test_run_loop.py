"""``knit run`` end to end (real stores, vLLM rollout, 2-rank Megatron trainer), small; and Ctrl-C.

Both runs are subprocesses (``python -m launcher run``, i.e. ``knit run``). The loop test checks the run folder: the
summary keys, the plots, that versions advanced and reached the engine, that every consumed
trajectory was received exactly once, that no payload went through the driver, and that the engine
started from the trainer's weights (the first step's trainer/rollout logprob gap is ~0). The Ctrl-C
test interrupts a run and checks that every process it started is gone. The outage test SIGKILLs one
store node once training runs and checks that the run still ends well: the node was started again
(same port, its spill log replayed), every trajectory was trained exactly once, the summary records
the outage, and no process is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from launcher.lifeline import processes_naming

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
    # the engine runs the trainer's published weights: version 0 came through the store (the logprob gap below).
    # Whether a later version lands mid-run is timing here (the rollout may fill the current train batch's
    # demand and finish every group during the trainer's first step); tests/test_weight_sync.py checks a reload
    # into the running engine exactly.
    assert r["abs_logp_diff_first_step"] < 1e-4  # the engine started from the trainer's version-0 weights
    assert 0 <= r["arch_staleness_mean"] <= r["arch_staleness_max"]
    assert not processes_naming(str(out)), "processes of the run are still alive"
    assert not _alive_children(out)

    import polars as pl

    meta = pl.read_parquet(out / "metadata.parquet")
    assert meta.height == rows and meta["node"].n_unique() == 2  # both store nodes held groups
    # local placement (the default): the rollout shares the host with both nodes, so each id names its home node,
    # and each home's groups sit on one node
    homes = meta.select(pl.col("group_id").str.extract(r"^(node\d)/", 1).alias("home"), "node")
    assert homes["home"].null_count() == 0
    assert homes.unique().height == 2 and homes["home"].n_unique() == 2


def _start_training(out: Path, model_dir: Path, batches: int, *extra: str, within_s: float) -> subprocess.Popen[str]:
    """``knit run`` of ``batches`` train batches into ``out``, returned once its trainer has started training."""
    from launcher.children import child_env

    proc = subprocess.Popen(_cmd(out, model_dir, "--train-batches", str(batches), *extra), cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not (out / "progress.jsonl").exists() and proc.poll() is None:
        time.sleep(0.2)
    if not (out / "progress.jsonl").exists():
        proc.send_signal(signal.SIGINT)  # the driver stops its children
        try:
            output, _ = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
        raise AssertionError(f"the run did not start training:\n{output[-3000:]}")
    return proc


def test_ctrl_c_stops_every_process(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start_training(out, model_dir, 50, "--checkpoint-every", "1000", within_s=120)
    try:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output
    time.sleep(1.0)
    assert not processes_naming(str(out)), "processes of the interrupted run are still alive"
    names = [c["name"] for c in json.loads((out / "logs" / "children.json").read_text())]
    assert names == ["store0", "store1", "trainer", "rollout"]
    assert not _alive_children(out)
    assert (out / "metadata.parquet").exists()  # the stores' metadata was saved before they stopped
    assert json.loads((out / "policy_summary.json").read_text())["interrupted"] is True
    from train.checkpointing import latest_step

    last = json.loads((out / "progress.jsonl").read_text().splitlines()[-1])
    assert latest_step(out / "checkpoints") == last["version"]  # the clean stop checkpointed its last step


def _retry_window(log: Path, location: str) -> tuple[float, float] | None:
    """Unix times ``log`` tells of calls to ``location`` failing or skipped: the first, and the last (plus the backoff
    it announced: when the call was tried again)."""
    stamps = []
    for line in log.read_text(errors="replace").splitlines():
        if location in line and ("failed (attempt" in line or "unavailable" in line):
            m = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", line)
            backoff = re.search(r"retrying in ([0-9.]+)s", line)
            if m:
                t = datetime.strptime(m.group(0), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                stamps.append((t, t + (float(backoff.group(1)) if backoff else 0.0)))
    return (min(a for a, _ in stamps), max(b for _, b in stamps)) if stamps else None


def test_a_store_killed_mid_run_is_restarted_and_every_trajectory_trained_once(model_dir: Path,
                                                                                tmp_path: Path) -> None:
    out, batches = tmp_path / "run", 3
    proc = _start_training(out, model_dir, batches, within_s=150)
    try:
        victim = next(c for c in json.loads((out / "logs" / "children.json").read_text()) if c["name"] == "store0")
        os.kill(victim["pid"], signal.SIGKILL)  # node0: groups, the weights the rollout reads, the version
        killed_at = time.time()
        output, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    r = json.loads((out / "summary.json").read_text())["policies"]["mini_batch"]
    rows = batches * B * G
    assert r["trajectories_consumed"] == r["rows_received"] == rows and r["duplicate_rows"] == 0
    assert r["steps"] == batches * K and r["final_version"] == batches * K
    assert r["rollout"]["groups"] == batches * B and r["rollout"]["aborted_groups"] == 0
    (outage,) = r["store_outages"]
    assert r["store_restarts"] == 1 and outage["restarts"] == 1
    assert outage["store"] == "store0" and outage["node"] == "node0" and outage["exit_code"] == -signal.SIGKILL
    assert killed_at - 0.1 <= outage["died_at"] <= killed_at + 5  # found dead within the driver's poll
    assert outage["back_at"] > outage["died_at"]
    assert outage["down_s"] == pytest.approx(outage["back_at"] - outage["died_at"], abs=0.01)
    assert "store node0 (store0) exited with -9" in output and "store restarts (down s)" in output
    store0 = next(c for c in json.loads((out / "logs" / "children.json").read_text()) if c["name"] == "store0")
    assert store0["pid"] != victim["pid"] and store0["restarts"] == 1
    assert not processes_naming(str(out)), "processes of the run are still alive"
    assert not _alive_children(out)

    import polars as pl

    meta = pl.read_parquet(out / "metadata.parquet")
    assert meta.select(["group_id", "sample_idx"]).is_unique().all() and meta["node"].n_unique() == 2
    loc = outage["location"]
    waits = {name: _retry_window(out / "logs" / f"{name}.log", loc) for name in ("trainer", "rollout")}
    print(f"outage: killed {killed_at:.2f}, found dead +{outage['died_at'] - killed_at:.2f} s, back "
          f"+{outage['back_at'] - killed_at:.2f} s; retries/skips seen (s after the kill): "
          + ", ".join(f"{n}: {w[0] - killed_at:+.2f} .. {w[1] - killed_at:+.2f}" if w else f"{n}: none"
                      for n, w in waits.items()))
