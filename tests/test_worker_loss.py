"""``knit run`` survives a store node lost for good and a rollout process that dies: each prompt is trained once.

Real runs (store nodes, vLLM rollout, 2-rank Megatron trainer; tiny model), as ``knit run`` subprocesses:

* a store node SIGKILLed with ``--max-store-restarts 0`` (it is never started again: as if its host were gone),
  once groups were written to it and a step was taken: the driver stops the trainer and the rollout and takes the
  run up again from the last checkpoint without it, in the same launcher. The groups written there and not trained
  go out again as ``node_lost``;
* the rollout process SIGKILLed while a group is in its engine: the same, its prompts in flight go out again as
  ``rollout_lost``.

Each run ends with status 0 and ``ledger.parquet`` exact (``ledger_check.ledger_exact``: each prompt trained by
one attempt, every other attempt with its reason). The kill points are found in the run's own event logs, never
by sleeping.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from launcher import ledger
from schemas.ledger import ROLLOUT_EVENT, TRAINED_EVENT
from schemas.run_folder import read_lines

pytestmark = [pytest.mark.megatron, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]
B, G, K, BATCHES = 4, 4, 2, 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from launcher.model import prepare_model

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    prepare_model(path)
    return path


def _start(out: Path, model_dir: Path, *extra: str) -> subprocess.Popen[str]:
    from launcher.children import child_env

    return subprocess.Popen([sys.executable, "-m", "launcher", "run", "--plain", "--out", str(out), "--model-dir",
                             str(model_dir), "--train-batch-groups", str(B), "--group-size", str(G), "--mini-batches",
                             str(K), "--train-batches", str(BATCHES), "--max-tokens", "24", "--timeout-s", "400",
                             *extra], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _events(out: Path, name: str) -> list[dict[str, Any]]:
    adapter: Any = ROLLOUT_EVENT if name == ledger.ROLLOUT_EVENTS else TRAINED_EVENT
    return [e.model_dump() for e in read_lines(adapter, out / ledger.EVENTS / name)]


def _kill_when(proc: subprocess.Popen[str], out: Path, child: str, ready: Callable[[], bool]) -> float:
    """SIGKILL the run's child ``child`` (by the pid ``children.json`` records) once ``ready()``; the kill's time."""
    deadline = time.monotonic() + 300
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run never got to the kill (rc {proc.returncode}):\n"
                                 f"{proc.communicate()[0][-4000:]}")
        time.sleep(0.02)
    pid = next(int(c["pid"]) for c in json.loads((out / "logs" / "children.json").read_text()) if c["name"] == child)
    os.killpg(pid, signal.SIGKILL)
    return time.time()


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        output, _ = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-5000:]
    return output


def _trained(out: Path) -> set[str]:
    return {g for e in _events(out, ledger.TRAINED_EVENTS) if e["kind"] == "step" for g in e["groups"]}  # type: ignore[attr-defined]


def test_a_store_node_lost_for_good_is_survived_and_its_groups_regenerated(model_dir: Path, tmp_path: Path) -> None:
    from ledger_check import ledger_exact

    out = tmp_path / "run"
    proc = _start(out, model_dir, "--max-store-restarts", "0")

    def node0_holds_an_untrained_group() -> bool:
        cfg = out / "configs" / "store0.json"
        if not cfg.exists() or not _trained(out):
            return False
        node0 = json.loads(cfg.read_text())["cluster"][0]["location"]
        return any(e["kind"] == "written" and e["node"] == node0 and e["group_id"] not in _trained(out)
                   for e in _events(out, ledger.ROLLOUT_EVENTS))

    killed_at = _kill_when(proc, out, "store0", node0_holds_an_untrained_group)
    output = _finish(proc)

    again = ledger_exact(out, prompts=B * BATCHES)
    assert again.get("node_lost", 0) >= 1, again
    table = pl.read_parquet(out / "ledger.parquet")
    r = json.loads((out / "summary.json").read_text())["policies"]["mini_batch"]
    (outage,) = r["store_outages"]
    assert outage["node"] == "node0" and outage["lost_at"] is not None and outage["back_at"] is None
    written = {e["group_id"]: e["node"] for e in _events(out, ledger.ROLLOUT_EVENTS) if e["kind"] == "written"}
    lost_groups = table.filter(pl.col("dropped_reason") == "node_lost")["group_id"].to_list()
    assert lost_groups and all(written[g] == outage["location"] for g in lost_groups)
    # each of them was regenerated under a new group id, on a node alive, and that attempt was trained
    regenerated = table.filter(pl.col("dispatch_reason") == "node_lost")
    assert set(regenerated["prompt_id"]) >= set(table.filter(pl.col("group_id").is_in(lost_groups))["prompt_id"])
    assert regenerated["trained_step"].is_not_null().all()
    assert all(written[g] != outage["location"] for g in regenerated["group_id"])
    (resumed,) = r["resumes"]
    assert resumed["cause"] == "node_lost" and resumed["reissued"].get("node_lost", 0) == len(lost_groups)
    assert r["steps"] == BATCHES * K and r["duplicate_rows"] == 0
    assert "each trained once" in output
    print(f"\nnode0 killed; lost for good +{outage['lost_at'] - killed_at:.2f} s, the run taken up again "
          f"+{resumed['launched_at'] - killed_at:.2f} s, its first step +{resumed['first_step_s']} s after that; "
          f"regenerated {dict(again)}; groups lost {len(lost_groups)}; wall {r['wall_s']:.0f} s")


def test_a_rollout_killed_is_taken_up_again_and_its_prompts_regenerated(model_dir: Path, tmp_path: Path) -> None:
    from ledger_check import ledger_exact

    out = tmp_path / "run"
    proc = _start(out, model_dir)

    def a_group_in_the_engine() -> bool:
        events = _events(out, ledger.ROLLOUT_EVENTS)
        done = {e["group_id"] for e in events if e["kind"] == "written"}
        return bool(_trained(out)) and any(e["kind"] == "dispatch" and e["group_id"] not in done for e in events)

    killed_at = _kill_when(proc, out, "rollout", a_group_in_the_engine)
    output = _finish(proc)

    again = ledger_exact(out, prompts=B * BATCHES)
    assert again.get("rollout_lost", 0) >= 1, again
    table = pl.read_parquet(out / "ledger.parquet")
    assert table.filter(pl.col("dispatch_reason") == "rollout_lost")["trained_step"].is_not_null().all()
    r = json.loads((out / "summary.json").read_text())["policies"]["mini_batch"]
    (resumed,) = r["resumes"]
    assert resumed["cause"] == "rollout_lost" and r["steps"] == BATCHES * K and r["duplicate_rows"] == 0
    assert "each trained once" in output
    print(f"\nrollout killed; the run taken up again +{resumed['launched_at'] - killed_at:.2f} s, its first step "
          f"+{resumed['first_step_s']} s after that; regenerated {dict(again)}; wall {r['wall_s']:.0f} s")
