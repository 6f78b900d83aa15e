"""``python -m bench.chaos --quick``: the main job on five namespace hosts (three store hosts, the rollout's, the
trainer's) under faults drawn from a seed for two minutes, together (store nodes SIGKILLed, links cut, a store host
lost, the rollout and the launcher SIGKILLed and taken up again, idle and malformed DoPuts, a stalled reader).
Afterwards every invariant holds: the run ends with every train batch trained, the prompt ledger has each prompt
trained exactly once, every group a store acknowledged is in it, no malformed put was taken, no process is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.children import child_env

pytestmark = [pytest.mark.hosts, pytest.mark.megatron, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def test_a_quick_chaos_run_loses_nothing_trains_nothing_twice_and_leaves_no_process(tmp_path: Path) -> None:
    from launcher.hosts import HostsUnavailableError, check_available

    try:
        check_available()
    except HostsUnavailableError as exc:
        pytest.skip(f"needs hosts as network namespaces: {exc}")
    out = tmp_path / "chaos.json"
    res = subprocess.run([sys.executable, "-m", "bench.chaos", "--quick", "--seed", "0", "--work",
                          str(tmp_path / "work"), "--out", str(out)], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=1500)
    doc = json.loads(out.read_text()) if out.exists() else {}
    assert res.returncode == 0 and doc["invariants_broken"] == [], res.stdout[-3000:] + res.stderr[-3000:]
    m, (run,) = doc["metrics"], doc["runs"]
    # faults of several kinds came during training, and training went on after them
    assert m["faults"] >= 5 and sum(m[f"faults_{k}"] > 0 for k in (
        "store_kill", "link_cut", "store_lost", "rollout_kill", "idle_connections", "malformed_puts",
        "stalled_reader", "launcher_kill")) >= 3
    assert m["recoveries"] >= 1
    assert (m["lost_prompts"], m["trained_twice"], m["unexplained_groups"], m["orphans"]) == (0, 0, 0, 0)
    assert run["steps"] == run["steps_wanted"] and run["launcher_rc"] == 0
    assert run["ledger"].endswith("each trained once")
