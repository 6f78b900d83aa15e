"""The run folder as one typed contract (``schemas.run_folder`` and its models).

Every record a run writes round-trips through its codec; a damaged file, a record lacking a field, or a folder of
another contract version raises ``RunFolderError`` naming the file, the line and the field (never a ``KeyError``),
from the codec and from the commands that read a folder (``knit report``, ``--resume``, ``bench.learning``). The
launcher reads records by attribute: at most :data:`MAX_LAUNCHER_SUBSCRIPTS` string-constant subscripts are left in
it. The trainer's, the rollout's and the launcher's modules import one another in no cycle, counting the imports
made inside functions.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pytest
from pydantic import BaseModel, TypeAdapter

from schemas import run_folder
from schemas.ledger import (
    ROLLOUT_EVENT,
    TRAINED_EVENT,
    Admitted,
    Checkpoint,
    Dispatch,
    Draw,
    Dropped,
    NodeLost,
    Reissue,
    Resume,
    ResumeRecord,
    RolloutResume,
    TrainedStep,
    TrainerResume,
    Written,
)
from schemas.run_folder import CONTRACT_VERSION, RunFolderError
from schemas.run_frames import CONSUMED_FRAME, INFLIGHT_FRAME, LEDGER_FRAME
from schemas.run_records import (
    CONSUMED_ENTRY,
    ProgressLine,
    RankEnv,
    RankReportDocument,
    RolloutRecord,
    RowEntry,
    SliceEntry,
    StepLine,
    StepMetrics,
)
from schemas.run_summary import (
    LedgerFigures,
    PolicySummary,
    RewardWindow,
    RunSummary,
    StoreOutage,
    read_summary,
)

ROOT = Path(__file__).resolve().parents[1]
MAX_LAUNCHER_SUBSCRIPTS = 100
"""String-constant subscripts (``x["key"]``) left in launcher/: records are read by attribute."""

METRICS: dict[str, Any] = {"step": 2, "train_batch": 1, "position": 0, "loss": 0.25, "rows": 8,
                           "abs_logp_diff": 0.01, "step_time_s": 0.5, "fetch_s": [0.1, 0.2],
                           "exposed_wait_s": [0.01, 0.0], "bytes_fetched": 4096, "encoder_passes": 3}


def _records() -> list[BaseModel]:
    """One of every record a run folder holds, with its optional fields set where they have any."""
    step = StepLine.model_validate(METRICS | {"version": 3, "plan_wait_s": 0.2, "t_end": 10.0, "publish_s": 0.01,
                                              "publish_done_s": 0.05})
    return [
        Draw(index=0, prompt_id="p0", group_id="p0"),
        Dispatch(index=0, prompt_id="p0", attempt=1, group_id="L1-p0", version=2, reason="rolled_back"),
        Written(group_id="p0", node="grpc://n0"), NodeLost(node="node1", location="grpc://n1", at=5.0),
        Resume(life=1, step=2),
        TrainedStep(step=2, version=3, groups={"p0": {"data_source": "a"}}, metrics=StepMetrics(**METRICS),
                    t_end=10.0),
        Admitted(steps=[2, 3]), Dropped(groups={"p1": "aborted"}), Checkpoint(step=3, seconds=0.4),
        ResumeRecord(life=1, step=2, launched_at=9.0, cause="stopped", prompts_drawn=4, groups_kept=1,
                     rolled_back=1, reissued={"rolled_back": 1}, first_step_s=2.5),
        RolloutResume(life=1, drawn=4, reissue=[Reissue(index=1, prompt_id="p1", attempt=1, reason="aborted")]),
        TrainerResume(life=1, step=2, planner={"train_batch": 1}),
        step,
        RankReportDocument(env=RankEnv(rank=1, world=2, dp_rank=1, dp_size=2, tp_rank=0, tp_size=1), steps=[step],
                           consumed=[SliceEntry(step=2, node="grpc://n0", group_id="p0", start=0, stop=2),
                                     RowEntry(step=2, group_id="p0", sample_idx=1)]),
        ProgressLine(step=2, train_batch=1, position=0, version=3, loss=0.25, rows=8, abs_logp_diff=0.01,
                     plan_wait_s=0.2, step_time_s=0.5, t_end=10.0, admitted_groups=4, arch_staleness_mean=0.5,
                     arch_staleness_max=1, reward_mean=0.75),
        RolloutRecord(groups=4, rows=16, policy_versions=[0, 1], redispatched={"L1-p0": "p0"}, write_s=0.3),
        RunSummary(policies={"mini_batch": PolicySummary(
            policy="mini_batch", arch_staleness_mean=0.5, reward_per_train_batch=[0.1, 0.2],
            reward_first5=RewardWindow(mean=0.1, ci95=0.05, train_batches=1),
            store_outages=[StoreOutage(store="store1", node="node1", location="grpc://n1", died_at=1.0,
                                       restarts=1, cause="exited")],
            ledger=LedgerFigures(prompts=4, attempts=5, exact=True, exceptions=[],
                                 attempts_again_by_reason={"rolled_back": 1}, summary="ledger: 4 prompts"))},
            arch_staleness_reduction=0.5),
    ]


@pytest.mark.parametrize("record", _records(), ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_its_codec(record: BaseModel, tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    run_folder.write_document(record, path)
    assert run_folder.read_document(type(record), path) == record
    log = tmp_path / "log.jsonl"
    run_folder.append_line(log, record)
    run_folder.append_line(log, record)
    assert list(run_folder.read_lines(type(record), log)) == [record, record]


def test_events_are_read_back_by_their_kind(tmp_path: Path) -> None:
    rollout = [r for r in _records() if isinstance(r, Draw | Dispatch | Written | NodeLost | Resume)]
    trained = [r for r in _records() if isinstance(r, TrainedStep | Admitted | Dropped | Checkpoint | Resume)]
    for adapter, events in ((ROLLOUT_EVENT, rollout), (TRAINED_EVENT, trained)):
        writer = run_folder.LineWriter(tmp_path / "events.jsonl", mode="w")
        for e in events:
            writer.write(e)
        writer.close()
        assert list(run_folder.read_lines(adapter, tmp_path / "events.jsonl")) == events
    step = next(e for e in run_folder.read_lines(TRAINED_EVENT, tmp_path / "events.jsonl")
                if isinstance(e, TrainedStep))
    assert step.metrics.model_extra == {"encoder_passes": 3}  # a step kind's own metrics ride along


def test_consumed_entries_keep_their_compact_arrays() -> None:
    doc = next(r for r in _records() if isinstance(r, RankReportDocument))
    assert json.loads(doc.model_dump_json())["consumed"] == [["slice", 2, "grpc://n0", "p0", 0, 2], ["row", 2, "p0", 1]]
    assert doc.rows() == [RowEntry(step=2, group_id="p0", sample_idx=1)]
    assert CONSUMED_ENTRY.validate_python(["slice", 2, "n", "g", 0, 1]) == SliceEntry(step=2, node="n", group_id="g",
                                                                                      start=0, stop=1)


def test_a_log_line_cut_short_by_a_kill_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    line = next(r for r in _records() if isinstance(r, ProgressLine))
    run_folder.append_line(path, line)
    with path.open("a") as f:
        f.write(line.model_dump_json()[:20])
    assert list(run_folder.read_lines(ProgressLine, path)) == [line]


def _error(call: Any) -> RunFolderError:
    with pytest.raises(RunFolderError) as info:
        call()
    return info.value


def test_a_damaged_log_names_the_file_the_line_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "events" / "trained.jsonl"
    good = TrainedStep(step=0, version=1, groups={}, metrics=StepMetrics(**METRICS), t_end=1.0)
    run_folder.append_line(path, good)
    doc = json.loads(good.model_dump_json())
    del doc["metrics"]["loss"]
    with path.open("a") as f:
        f.write(json.dumps(doc) + "\n")
    err = _error(lambda: list(run_folder.read_lines(TRAINED_EVENT, path)))
    assert (err.path, err.line, err.field) == (str(path), 2, "step.metrics.loss")
    assert str(err).startswith(f"{path}: line 2: field step.metrics.loss: ")
    path.write_text('{"kind": "checkpoint", "step": 1}\n{"kind": "snapshot"}\n')
    err = _error(lambda: list(run_folder.read_lines(TRAINED_EVENT, path)))
    assert (err.line, err.field) == (1, "checkpoint.seconds")
    path.write_text("{not json\n")
    err = _error(lambda: list(run_folder.read_lines(TRAINED_EVENT, path)))
    assert err.line == 1 and "not valid JSON" in str(err)
    assert not isinstance(err, KeyError) and isinstance(err, ValueError)


def test_a_damaged_document_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "trainer_rank0.json"
    path.write_text(json.dumps({"env": {"rank": 0}, "steps": [METRICS], "consumed": [["row", 0, "g"]]}))
    err = _error(lambda: run_folder.read_document(RankReportDocument, path))
    assert err.path == str(path) and err.field == "steps.0.version"
    path.write_text(json.dumps({"env": {"rank": 0}, "steps": [], "consumed": [["row", 0, "g"]]}))
    assert "a row entry holds 3 fields" in str(_error(lambda: run_folder.read_document(RankReportDocument, path)))
    path.write_text('{"env": ')
    assert "not valid JSON" in str(_error(lambda: run_folder.read_document(RankReportDocument, path)))
    assert _error(lambda: run_folder.read_document(RankReportDocument, tmp_path / "none.json")).problem == "missing"


def test_a_frame_is_checked_against_its_schema(tmp_path: Path) -> None:
    path = tmp_path / "ledger.parquet"
    table = pl.DataFrame({"prompt_id": ["p0"], "attempt": [0], "group_id": ["p0"], "dispatched_version": [0],
                          "completed": [True], "trained_step": [0], "dropped_reason": [None], "life": [0],
                          "dispatch_reason": [None]}, schema_overrides={"dropped_reason": pl.String,
                                                                       "dispatch_reason": pl.String}).to_arrow()
    run_folder.write_frame(table, path, LEDGER_FRAME)
    assert run_folder.read_frame(path, LEDGER_FRAME).schema.names == LEDGER_FRAME.names
    err = _error(lambda: run_folder.write_frame(table.drop_columns(["life"]), path, LEDGER_FRAME))
    assert err.field == "life" and "column missing" in str(err)
    bad = table.set_column(1, "attempt", pa.array(["first"]))
    pa.parquet.write_table(bad, path)
    err = _error(lambda: run_folder.read_frame(path, LEDGER_FRAME))
    assert (err.path, err.field) == (str(path), "attempt")
    consumed = pa.table({"step": pa.array([0], pa.int32()), "arch_staleness": [1]})
    pa.parquet.write_table(consumed, tmp_path / "consumed.parquet")
    got = run_folder.read_frame(tmp_path / "consumed.parquet", CONSUMED_FRAME, required=("step",))
    assert got.schema.field("step").type == pa.int64()  # cast to the contract's type
    assert _error(lambda: run_folder.read_frame(tmp_path / "consumed.parquet", CONSUMED_FRAME)).field == "group_id"
    assert INFLIGHT_FRAME.names[-1] == "node"


def test_an_older_or_damaged_run_folder_is_refused_by_name(tmp_path: Path) -> None:
    from launcher.run_config import RunConfig

    path = tmp_path / run_folder.RUN_CONFIG
    run_folder.write_run_config(RunConfig(out=tmp_path), path)
    assert run_folder.read_run_config(RunConfig, path).out == tmp_path
    assert json.loads(path.read_text())["contract_version"] == CONTRACT_VERSION
    flat = json.loads(path.read_text())["config"]
    path.write_text(json.dumps(flat))  # as a folder of an older knit holds it
    err = _error(lambda: run_folder.read_run_config(RunConfig, path))
    assert (err.path, err.field) == (str(path), "contract_version") and "older than the contract" in str(err)
    path.write_text(json.dumps({"contract_version": CONTRACT_VERSION + 1, "config": flat}))
    assert f"this knit reads version {CONTRACT_VERSION}" in str(_error(lambda: run_folder.check_run_folder(tmp_path)))
    path.write_text(json.dumps({"contract_version": CONTRACT_VERSION, "config": flat | {"train_batches": "3"}}))
    assert _error(lambda: run_folder.read_run_config(RunConfig, path)).field == "config"

    summary = tmp_path / run_folder.SUMMARY
    run_folder.write_document(RunSummary(policies={}), summary)
    assert read_summary(summary).policies == {}
    summary.write_text(json.dumps({"policies": {}}))
    assert _error(lambda: read_summary(summary)).field == "contract_version"


def test_resume_and_knit_report_refuse_an_older_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from launcher import resume
    from launcher.cli import main

    run_folder.append_line(tmp_path / run_folder.EVENTS / run_folder.ROLLOUT_EVENTS,
                           Dispatch(index=0, prompt_id="p0", attempt=0, group_id="p0", version=0))
    (tmp_path / run_folder.RUN_CONFIG).write_text(json.dumps({"policy": "mini_batch"}))
    err = _error(lambda: resume.begin(tmp_path))
    assert err.field == "contract_version"
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path / run_folder.RUN_CONFIG}: field contract_version" in capsys.readouterr().err
    (tmp_path / run_folder.RUN_CONFIG).unlink()
    with (tmp_path / run_folder.EVENTS / run_folder.ROLLOUT_EVENTS).open("a") as f:
        f.write('{"kind": "dispatch", "index": 1, "prompt_id": "p1"}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "rollout.jsonl: line 2: field dispatch.attempt" in capsys.readouterr().err


def test_bench_learning_reads_a_run_through_the_codec(tmp_path: Path) -> None:
    from bench.learning import read_arm

    step = next(r for r in _records() if isinstance(r, StepLine))
    run_folder.write_document(RankReportDocument(env=RankEnv(rank=0), steps=[step]), tmp_path / "trainer_rank0.json")
    run_folder.write_document(RunSummary(policies={"mini_batch": PolicySummary(reward_per_train_batch=[0.5])}),
                              tmp_path / run_folder.SUMMARY)
    arm = read_arm(tmp_path)
    assert arm["reward"] == [0.5] and arm["wall_s"] == [0.5] and arm["task_success_after"] is None
    (tmp_path / run_folder.SUMMARY).write_text(json.dumps({"policies": {}}))  # a folder of an older knit
    assert _error(lambda: read_arm(tmp_path)).field == "contract_version"


def launcher_subscripts() -> dict[str, int]:
    """String-constant subscripts (``x["key"]``) per module of launcher/."""
    counts = {}
    for path in sorted((ROOT / "launcher").rglob("*.py")):
        tree = ast.parse(path.read_text())
        counts[path.name] = sum(1 for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                                and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str))
    return counts


def test_the_launcher_reads_records_by_attribute() -> None:
    counts = launcher_subscripts()
    assert sum(counts.values()) <= MAX_LAUNCHER_SUBSCRIPTS, counts
    tree = ast.parse('doc["steps"][0]["loss"]; doc[0]; doc.steps')
    assert sum(1 for n in ast.walk(tree) if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)
               and isinstance(n.slice.value, str)) == 2  # the count sees what it is meant to


def _imports(package: str) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in it (in functions and ``TYPE_CHECKING`` blocks too)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for pk in ("schemas", package) for p in (ROOT / pk).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module and not n.level:
                found |= {f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in modules else n.module for a in n.names}
            elif isinstance(n, ast.Import):
                found |= {a.name for a in n.names}
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(f"{m}.")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (its modules in order), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n):], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        state[m] = 2
        path.pop()
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m)) is not None), None)


@pytest.mark.parametrize("package", ["train", "connectors", "launcher"])
def test_no_import_cycle_counting_imports_inside_functions(package: str) -> None:
    assert _cycle(_imports(package)) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the search finds one


def _polars(schema: pa.Schema) -> dict[str, Any]:
    return dict(pl.from_arrow(schema.empty_table()).schema)  # type: ignore[union-attr]


def test_the_frames_the_planner_and_the_store_build_are_the_contracts() -> None:
    """The planner's consumed frame and the store reader's in-flight frame have the columns and types of the run
    folder's schemas, so what ``consumed.parquet`` holds is what the readers check it against."""
    from admission.planner import CONSUMED_SCHEMA
    from flight_store.reading import INFLIGHT_COLUMNS
    from launcher.ledger import LEDGER_SCHEMA

    assert _polars(CONSUMED_FRAME) == dict(CONSUMED_SCHEMA)
    assert _polars(INFLIGHT_FRAME) == dict(INFLIGHT_COLUMNS)
    assert _polars(LEDGER_FRAME) == dict(LEDGER_SCHEMA)
    assert isinstance(ROLLOUT_EVENT, TypeAdapter) and isinstance(TRAINED_EVENT, TypeAdapter)
