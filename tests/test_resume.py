"""``knit run --resume``: a run SIGKILLed whole at three points, and resumed each time, trains each prompt once.

One run (real stores, vLLM rollout, 2-rank Megatron trainer; tiny model) is killed as a user's machine would
kill it: SIGKILL of the driver and of every process it started, at once. The points are found by following the
run's own event logs (``events/``), never by sleeping: mid-generation (groups dispatched, before any step of
that life), between admission and the step (the planner admitted a step not yet taken), and during the weight
publish (a checkpoint written, then the next step taken, its weights being checkpointed and published). After
each kill ``knit run --resume`` takes it up; the last one runs to the end: rc 0, every train batch trained,
``ledger.parquet`` exact (one polars query: each prompt has one attempt trained), the steps continuous, no
process left.

The pure parts (the ledger's rules, the settling of prompts at a resume) are checked without processes below.
"""

from __future__ import annotations

import contextlib
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
import pyarrow as pa
import pytest

from launcher import ledger, resume
from schemas.ledger import ROLLOUT_EVENT, TRAINED_EVENT
from schemas.run_folder import append_line, read_document, read_lines

ROOT = Path(__file__).resolve().parents[1]
B, G, K, BATCHES = 4, 4, 2, 3


# ---- the pure rules -------------------------------------------------------------------------------------------


METRICS = {"train_batch": 0, "position": 0, "loss": 0.5, "rows": 4, "abs_logp_diff": 0.0, "step_time_s": 0.1}
"""A step's metrics where the rule under test does not read them."""


def _adapter(name: str) -> Any:
    return ROLLOUT_EVENT if name == ledger.ROLLOUT_EVENTS else TRAINED_EVENT


def _write(out: Path, name: str, events: list[dict[str, Any]]) -> None:
    """Append ``events`` (a step's metrics and time filled in where a test leaves them out) through the codec."""
    for e in events:
        if e["kind"] == "step":
            e = {"metrics": METRICS | {"step": e["step"]}, "t_end": 100.0 + e["step"]} | e
        append_line(out / ledger.EVENTS / name, _adapter(name).validate_python(e))


def _dispatch(i: int, attempt: int = 0, gid: str | None = None, reason: str | None = None) -> dict[str, object]:
    return {"kind": "dispatch", "index": i, "prompt_id": f"p{i}", "attempt": attempt, "group_id": gid or f"p{i}",
            "version": 0, "reason": reason}


def test_settling_and_the_ledger_follow_the_surviving_steps(tmp_path: Path) -> None:
    """Five prompts at a resume from the checkpoint of step 1: p0 trained by step 0 (done), p1 by step 1 (rolled
    back), p2 stored completed (kept), p3 stored aborted, p4 never written (in flight); p2's group is then trained
    by step 1 of the new life and p1, p3, p4 go out again and are trained."""
    draws = [{"kind": "draw", "index": i, "prompt_id": f"p{i}", "group_id": f"p{i}"} for i in range(5)]
    _write(tmp_path, ledger.ROLLOUT_EVENTS, draws + [_dispatch(i) for i in range(5)])
    _write(tmp_path, ledger.TRAINED_EVENTS, [
        {"kind": "step", "step": 0, "version": 1, "groups": {"p0": {"data_source": "a"}}},
        {"kind": "checkpoint", "step": 1, "seconds": 0.1},
        {"kind": "step", "step": 1, "version": 2, "groups": {"p1": {"data_source": "b"}}},
        {"kind": "resume", "life": 1, "step": 1}])
    meta = pl.DataFrame({"group_id": ["p0", "p1", "p2", "p3"], "status": ["completed", "completed", "completed",
                                                                          "aborted"]})
    assert resume.resumes(tmp_path) == []  # a run never resumed
    h = ledger.read_history(tmp_path)
    assert h.trained == {"p0": 0} and h.rolled_back == {"p1"}
    reissue, kept = resume.settle(h, ledger.group_status(meta))
    assert kept == 1
    assert [(r.prompt_id, r.attempt, r.reason) for r in reissue] == [("p1", 1, "rolled_back"), ("p3", 1, "aborted"),
                                                                       ("p4", 1, "interrupted")]
    from admission import AdmissionConfig

    state = resume.planner_state(h, 1, AdmissionConfig(train_batch_groups=2, group_size=4, mini_batches=2),
                                 sorted(h.rolled_back))
    assert (state.train_batch, state.position, state.admitted, state.dropped) == (0, 1, {"p0"}, {"p1"})
    assert state.quota_used == (("data_source", "a", 1),)
    assert ledger.summary_line(ledger.build(tmp_path, meta)).startswith("ledger: 5 prompts, 1 trained once")

    _write(tmp_path, ledger.ROLLOUT_EVENTS, [{"kind": "resume", "life": 1, "step": 1}] + [
        _dispatch(i, 1, f"L1-p{i}", r.reason) for i, r in zip((1, 3, 4), reissue, strict=True)])
    _write(tmp_path, ledger.TRAINED_EVENTS, [
        {"kind": "step", "step": 1, "version": 2, "groups": {"p2": {}, "L1-p1": {}}},
        {"kind": "step", "step": 2, "version": 3, "groups": {"L1-p3": {}, "L1-p4": {}}}])
    table = ledger.build(tmp_path, pl.concat([meta, pl.DataFrame({"group_id": ["L1-p1", "L1-p3", "L1-p4"],
                                                                  "status": ["completed"] * 3})]))
    assert ledger.exceptions(table).height == 0
    assert ledger.summary_line(table) == "ledger: 5 prompts, each trained once"
    row = table.filter(pl.col("group_id") == "p1").row(0, named=True)
    assert (row["trained_step"], row["dropped_reason"]) == (None, "rolled_back")
    assert table.filter(pl.col("attempt") == 1)["dispatch_reason"].to_list() == ["rolled_back", "aborted",
                                                                                  "interrupted"]


def test_a_lost_node_and_a_dead_rollout_name_their_prompts_and_supersede_their_groups(tmp_path: Path) -> None:
    """p0 written to node A and trained; p1 written to node B, which is then lost for good; p2 in the engine of a
    rollout that died; p3 stored completed on A. At the resume p1 goes out again as ``node_lost``, p2 as
    ``rollout_lost``, p3 is kept; once p1's new attempt is dispatched its old group is superseded (never planned,
    even if B came back with it)."""
    draws = [{"kind": "draw", "index": i, "prompt_id": f"p{i}", "group_id": f"p{i}"} for i in range(4)]
    written = [{"kind": "written", "group_id": g, "node": n} for g, n in (("p0", "A"), ("p1", "B"), ("p3", "A"))]
    _write(tmp_path, ledger.ROLLOUT_EVENTS, draws + [_dispatch(i) for i in range(4)] + written)
    _write(tmp_path, ledger.TRAINED_EVENTS, [{"kind": "step", "step": 0, "version": 1, "groups": {"p0": {}}}])
    resume.note_lost(tmp_path, "node1", "B")
    meta = pl.DataFrame({"group_id": ["p0", "p3"], "status": ["completed", "completed"]})
    h = ledger.read_history(tmp_path)
    assert h.lost == {"B"} and h.written["p1"] == "B"
    reissue, kept = resume.settle(h, ledger.group_status(meta), unwritten="rollout_lost")
    assert kept == 1 and [(r.prompt_id, r.reason) for r in reissue] == [("p1", "node_lost"), ("p2", "rollout_lost")]
    assert resume.superseded(h) == set()
    table = ledger.build(tmp_path, meta)
    assert dict(zip(table["group_id"], table["dropped_reason"], strict=True)) == {
        "p0": None, "p1": "node_lost", "p2": "interrupted", "p3": "not_trained"}

    _write(tmp_path, ledger.ROLLOUT_EVENTS, [_dispatch(1, 1, "L1-p1", "node_lost")])
    assert resume.superseded(ledger.read_history(tmp_path)) == {"p1"}


def test_a_group_whose_prompt_goes_out_again_is_never_planned_even_if_its_node_answers_later(tmp_path: Path) -> None:
    """Found by the chaos run (seed 0): at a resume, a node cut off held p0's group, so no store answered for it and
    p0 went out again; when the node answered, the planner took the old group too and p0 was trained twice. The
    group a prompt is dispatched again for is dropped for the planner and released at the resume."""
    from admission import AdmissionConfig

    draws = [{"kind": "draw", "index": i, "prompt_id": f"p{i}", "group_id": f"p{i}"} for i in range(2)]
    written = [{"kind": "written", "group_id": g, "node": "A"} for g in ("p0", "p1")]
    _write(tmp_path, ledger.ROLLOUT_EVENTS, [*draws, _dispatch(0), _dispatch(1), *written])
    h = ledger.read_history(tmp_path)
    reissue, kept = resume.settle(h, {"p1": True})  # node A answered for p1 only (say, it came back between)
    assert kept == 1 and [(r.prompt_id, r.reason) for r in reissue] == [("p0", "interrupted")]
    stale = resume.stale_groups(h, reissue)
    assert stale == ["p0"]
    state = resume.planner_state(h, 0, AdmissionConfig(train_batch_groups=2, group_size=4, mini_batches=2), stale)
    assert state.dropped == {"p0"} and "p1" not in state.dropped


def test_a_resume_leaves_out_a_node_that_does_not_answer_and_sends_its_prompts_again(
        store_nodes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Found by the chaos run (seed 2): a store node SIGKILLed while the launcher took the run up again (nothing
    restarts it before the next life) failed the resume's metadata scan, and the run. Its groups now count as
    unstored: their prompts go out again and the groups are dropped for good."""
    import numpy as np

    from admission import AdmissionConfig
    from bench.store_groups import make_group
    from flight_store.writing import StoreWriter
    from schemas.ledger import RolloutResume, TrainerResume

    a, b = store_nodes(2)
    for server, gid in ((a, "p0"), (b, "p1")):
        with StoreWriter([server.location]) as writer:
            writer.put_group(pa.Table.from_batches([make_group(gid, 4, 8, np.random.default_rng(0))]))
    draws = [{"kind": "draw", "index": i, "prompt_id": f"p{i}", "group_id": f"p{i}"} for i in range(2)]
    written = [{"kind": "written", "group_id": g, "node": n.location} for g, n in (("p0", a), ("p1", b))]
    _write(tmp_path, ledger.ROLLOUT_EVENTS, [*draws, _dispatch(0), _dispatch(1), *written])
    b.shutdown()
    res = resume.Resumption(life=1, step=0, launched_at=time.time())
    trainer, rollout = resume.prepare(tmp_path, res, AdmissionConfig(train_batch_groups=2, group_size=4,
                                                                     mini_batches=2), [a.location, b.location])
    again = read_document(RolloutResume, rollout).reissue
    assert [(r.prompt_id, r.reason) for r in again] == [("p1", "interrupted")]  # p0 is kept: its node answered
    assert read_document(TrainerResume, trainer).planner["dropped"] == ["p1"]


def test_knit_report_says_the_ledger_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from launcher.cli import main

    _write(tmp_path, ledger.ROLLOUT_EVENTS, [_dispatch(0), _dispatch(1)])
    _write(tmp_path, ledger.TRAINED_EVENTS, [{"kind": "step", "step": 0, "version": 1, "groups": {"p0": {}}}])
    assert main(["report", str(tmp_path)]) == 1  # p1 was never trained: named, with why
    assert "ledger: 2 prompts, 1 trained once; never trained 1 (interrupted: 1): p1" in capsys.readouterr().out
    _write(tmp_path, ledger.TRAINED_EVENTS, [{"kind": "step", "step": 1, "version": 2, "groups": {"p1": {}}}])
    assert main(["report", str(tmp_path)]) == 0
    assert "ledger: 2 prompts, each trained once" in capsys.readouterr().out
    assert pl.read_parquet(tmp_path / "ledger.parquet").height == 2


# ---- a real run killed three times ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from launcher.model import prepare_model

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    prepare_model(path)
    return path


def _start(*args: str) -> subprocess.Popen[str]:
    from launcher.children import child_env

    return subprocess.Popen([sys.executable, "-m", "launcher", "run", "--plain", *args], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _events(out: Path, name: str) -> list[dict[str, Any]]:
    return [e.model_dump() for e in read_lines(_adapter(name), out / ledger.EVENTS / name)]


def _wait_for(proc: subprocess.Popen[str], what: str, ready: Callable[[], bool], within_s: float = 240) -> None:
    deadline = time.monotonic() + within_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            output = proc.communicate()[0]
            raise AssertionError(f"the run never reached {what} (rc {proc.returncode}):\n{output[-4000:]}")
        time.sleep(0.02)


def _kill_everything(proc: subprocess.Popen[str], out: Path) -> None:
    """SIGKILL the driver and every process group it started, at once (as a machine's end would)."""
    groups = [c["pid"] for c in json.loads((out / "logs" / "children.json").read_text())]
    proc.kill()
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    proc.communicate()
    time.sleep(0.5)


def _in_life(out: Path, name: str, kind: str) -> list[dict[str, object]]:
    """The events of ``kind`` since the last resume line."""
    found: list[dict[str, object]] = []
    for e in _events(out, name):
        if e["kind"] == "resume":
            found = []
        elif e["kind"] == kind:
            found.append(e)
    return found


@pytest.mark.megatron
@pytest.mark.vllm
def test_a_run_killed_at_three_points_resumes_and_trains_each_prompt_once(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start("--out", str(out), "--model-dir", str(model_dir), "--train-batch-groups", str(B),
                  "--group-size", str(G), "--mini-batches", str(K), "--train-batches", str(BATCHES),
                  "--max-tokens", "24", "--timeout-s", "400")
    # 1. mid-generation: groups dispatched, no step taken yet
    _wait_for(proc, "dispatch", lambda: len(_in_life(out, ledger.ROLLOUT_EVENTS, "dispatch")) >= 2)
    _kill_everything(proc, out)
    # 2. between admission and the step: a step admitted that this life has not taken
    proc = _start("--resume", str(out))
    _wait_for(proc, "an admission", lambda: any(
        s not in {e["step"] for e in _in_life(out, ledger.TRAINED_EVENTS, "step")}
        for a in _in_life(out, ledger.TRAINED_EVENTS, "admitted") for s in a["steps"]))  # type: ignore[attr-defined]
    _kill_everything(proc, out)
    # 3. during the weight publish: a checkpoint written, then the next step taken, its weights being checkpointed
    # and published (so the last resume restores a checkpoint and rolls that step back)
    proc = _start("--resume", str(out))
    _wait_for(proc, "a step after a checkpoint", lambda: any(
        e["kind"] == "step" and e["step"] >= 1 for e in _in_life(out, ledger.TRAINED_EVENTS, "step")))
    _kill_everything(proc, out)
    # the last resume runs to the end
    proc = _start("--resume", str(out))
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output[-4000:]

    table = pl.read_parquet(out / "ledger.parquet")
    trained = table.filter(pl.col("trained_step").is_not_null())
    assert trained.group_by("prompt_id").len()["len"].to_list() == [1] * (B * BATCHES)  # each prompt trained once
    assert table["prompt_id"].n_unique() == B * BATCHES and ledger.exceptions(table).height == 0
    assert sorted(trained["trained_step"].to_list()) == sorted(s for s in range(BATCHES * K) for _ in range(B // K))
    assert f"ledger: {B * BATCHES} prompts, each trained once" in output
    steps = [json.loads(ln)["step"] for ln in (out / "progress.jsonl").read_text().splitlines()]
    assert steps == list(range(BATCHES * K))  # one continuous run: every step once, in order
    r = json.loads((out / "summary.json").read_text())["policies"]["mini_batch"]
    assert r["steps"] == BATCHES * K and r["trajectories_consumed"] == BATCHES * B * G and r["duplicate_rows"] == 0
    assert [x["life"] for x in r["resumes"]] == [1, 2, 3]
    for c in json.loads((out / "logs" / "children.json").read_text()):  # nothing of the last start is left
        with contextlib.suppress(OSError):
            assert Path(f"/proc/{c['pid']}/stat").read_text().split()[2] == "Z", f"{c['name']} still runs"
    last = r["resumes"][-1]
    assert last["first_step_s"] > 0 and last["step"] >= 1  # restored from a checkpoint the third kill left
    print("resumes:", json.dumps(r["resumes"]), "checkpoints:", r["checkpoint_s"],
          "attempts again:", r["ledger"]["attempts_again_by_reason"])


def test_salvage_rebuilds_a_surviving_step_whose_publish_a_kill_cut_short(tmp_path: Path) -> None:
    """Step 0 was checkpointed but killed while publishing: no progress line, no rank 0 record. The resume from
    the checkpoint of step 2 rebuilds both from the trained log and the consumed trajectories; step 2 (taken
    after the checkpoint) is cut."""
    metrics = {"train_batch": 0, "loss": 0.5, "rows": 4, "abs_logp_diff": 0.0, "step_time_s": 0.1}
    _write(tmp_path, ledger.TRAINED_EVENTS, [
        {"kind": "step", "step": s, "version": s + 1, "groups": {f"g{s}": {}}, "t_end": 100.0 + s,
         "metrics": metrics | {"step": s, "position": s % 2}} for s in range(3)])
    progress = [{"step": 1, "train_batch": 0, "position": 1, "version": 2, "loss": 0.4, "rows": 4,
                 "abs_logp_diff": 0.0, "plan_wait_s": 0.0, "step_time_s": 0.1, "t_end": 101.0, "admitted_groups": 2}]
    (tmp_path / "progress.jsonl").write_text("".join(json.dumps(p) + "\n" for p in progress))
    record = metrics | {"step": 1, "position": 1, "version": 2, "plan_wait_s": 0.0, "t_end": 101.0}
    (tmp_path / "trainer_rank0.json.steps.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "trainer_rank0.json.consumed.jsonl").write_text(json.dumps(["row", 1, "g1", 0]) + "\n")
    pl.DataFrame({"step": [0, 0, 1, 2], "group_id": ["g0", "g0", "g1", "g2"], "sample_idx": [0, 1, 0, 0],
                  "dp_rank": [0, 1, 0, 0], "arch_staleness": [0, 0, 1, 0], "reward": [1.0, 0.0, 1.0, 1.0]}
                 ).write_parquet(tmp_path / "consumed.parquet")
    resume.salvage(tmp_path, 2)
    lines = [json.loads(ln) for ln in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [(ln["step"], ln["version"]) for ln in lines] == [(0, 1), (1, 2)] and lines[0]["reward_mean"] == 0.5
    doc = json.loads((tmp_path / resume.HISTORY / "trainer_rank0.json").read_text())
    assert [s["step"] for s in doc["steps"]] == [0, 1]
    assert sorted(doc["consumed"]) == [["row", 0, "g0", 0], ["row", 1, "g1", 0]]  # rank 0's rows of step 0 rebuilt
    assert pl.read_parquet(tmp_path / resume.HISTORY / "consumed.parquet")["step"].to_list() == [0, 0, 1]
    assert not (tmp_path / "consumed.parquet").exists() and not list(tmp_path.glob("trainer_rank0.json*"))
