"""Rank 0's planning path and every rank's records stay bounded over a long run.

Counts, not timings or RSS: over hundreds of groups written to real store nodes (port 0), released
as they are consumed, the planner's state and ``PlanSource``'s frame hold only the pending work, the
planner keeps no consumed rows, and the plans and ``consumed.parquet`` equal those of a planner that
keeps everything (a reference ``admission.Planner`` given every row). ``ConsumedLog`` and
``train.loop.RankReport`` write their records to disk as the run goes and end with the documents a
whole-run writer would write; the progress lines keep their JSON form.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq
from polars.testing import assert_frame_equal

from admission import CONSUMED_SCHEMA, AdmissionConfig, Planner
from schemas.run_folder import append_line, read_document, read_lines
from schemas.run_records import CONSUMED_ENTRY, ProgressLine, RankReportDocument
from train.loop import RankReport, StepRecord, progress_line
from train.planning import ConsumedLog, PlanSource, StepFigures


def test_rank0_planning_stays_bounded_and_plans_as_a_planner_that_keeps_everything(  # type: ignore[no-untyped-def]
        store_nodes, make_group, tmp_path: Path) -> None:
    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter

    cfg = AdmissionConfig(train_batch_groups=4, group_size=2, mini_batches=2, dp_ranks=2)
    groups, lookahead = 240, 6
    servers = store_nodes(2)
    locations = [s.location for s in servers]
    path = tmp_path / "consumed.parquet"
    reference = Planner(cfg)  # sees every row ever scanned, forgets nothing, keeps every consumed frame
    written = aborted = consumed = steps = 0
    max_pending = max_state = 0
    with StoreReader(locations) as client, StoreWriter.sharing(client) as writer, \
            StoreReader(locations) as ref_client, \
            ConsumedLog(str(path), rows_per_group=50) as log:
        source = PlanSource(client, Planner(cfg), consumed_log=log)
        seen = ref_client.scan_new()  # no rows yet, the metadata columns
        while consumed < groups:
            while written - aborted < min(groups, consumed + lookahead):
                lost = written % 7 == 3
                writer.put_group(make_group(f"g{written}", size=2, response_len=1 + written % 5,
                                            policy_version=steps, status="aborted" if lost else "completed"))
                written, aborted = written + 1, aborted + lost
            plans = source.poll(steps)
            seen = pl.concat([seen, ref_client.scan_new()], how="vertical_relaxed")
            assert plans == reference.update(seen, current_version=steps)
            for plan in plans:
                client.release(plan.group_ids)
                figures = log.take_step(plan.step)
                assert figures is not None and figures.reward_mean is not None
                assert log.take_step(plan.step) is None  # taken once, then forgotten
                steps, consumed = steps + 1, consumed + len(plan.group_ids)
            state = source.planner.state
            max_state = max(max_state, len(state.admitted) + len(state.dropped))
            max_pending = max(max_pending, source.pending_rows)
            assert source.planner.consumed_frame().height == 0  # drained into the log every poll
    assert steps == groups // cfg.groups_per_mini_batch and source.admitted_groups == groups
    assert source.dropped == {"aborted": aborted} and aborted > 30
    assert max_state == 0  # settled ids leave the state in the poll that settles them
    assert max_pending <= (lookahead + 1) * cfg.group_size  # the frame holds the pending groups only
    assert len(reference.state.admitted) == groups  # a planner never pruned holds one id per group
    assert_frame_equal(pl.read_parquet(path), reference.consumed_frame())
    assert pq.ParquetFile(path).metadata.num_row_groups <= groups * cfg.group_size // 50  # not one per step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["consumed.parquet"]


def _consumed(step: int, rewards: list[float], arch: list[int]) -> pl.DataFrame:
    n = len(rewards)
    cols: dict[str, Any] = {c: [0] * n for c, dt in CONSUMED_SCHEMA.items() if dt == pl.Int64}
    cols.update(group_id=[f"s{step}"] * n, node=["n0"] * n, sample_idx=list(range(n)), step=[step] * n,
                reward=rewards, advantage=[0.0] * n, arch_staleness=arch)
    return pl.DataFrame(cols, schema=CONSUMED_SCHEMA)


def test_consumed_log_streams_rows_to_disk_and_keeps_step_figures_until_taken(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "consumed.parquet"
    spool = tmp_path / "sub" / "consumed.parquet.arrows"
    frames = [_consumed(0, [1.0, 0.0], [0, 2]), _consumed(1, [1.0, 1.0], [1, 1]), _consumed(2, [0.0, 0.5], [3, 0])]
    with ConsumedLog(str(path), rows_per_group=3) as log:
        log.append(frames[0])
        log.append(pl.DataFrame(schema=CONSUMED_SCHEMA))  # an update that admitted nothing
        size = spool.stat().st_size
        log.append(pl.concat(frames[1:]))  # one update admitting two steps
        assert spool.stat().st_size > size and not path.exists()  # on disk as it comes, Parquet at the end
        assert log.take_step(0) == StepFigures(arch_staleness_mean=1.0, arch_staleness_max=2, reward_mean=0.5)
        assert log.take_step(2) == StepFigures(arch_staleness_mean=1.5, arch_staleness_max=3, reward_mean=0.25)
        assert log.take_step(7) is None
    assert_frame_equal(pl.read_parquet(path), pl.concat(frames))
    assert [pq.ParquetFile(path).metadata.row_group(i).num_rows for i in range(2)] == [4, 2]
    assert not spool.exists()
    log.close()  # twice is fine


def test_consumed_log_without_rows_writes_an_empty_file_and_without_path_none(tmp_path: Path) -> None:
    path = tmp_path / "consumed.parquet"
    ConsumedLog(str(path)).close()
    assert_frame_equal(pl.read_parquet(path), pl.DataFrame(schema=CONSUMED_SCHEMA))
    figures_only = ConsumedLog(None)
    figures_only.append(_consumed(4, [1.0], [2]))
    figures_only.close()
    assert figures_only.take_step(4) == StepFigures(arch_staleness_mean=2.0, arch_staleness_max=2, reward_mean=1.0)
    assert list(tmp_path.iterdir()) == [path]


def test_rank_report_is_written_as_the_run_goes_into_the_same_document(tmp_path: Path) -> None:
    env = {"rank": 1, "world": 2, "dp_rank": 1, "dp_size": 2, "tp_rank": 0, "tp_size": 1}
    base = {"train_batch": 0, "position": 0, "rows": 2, "abs_logp_diff": 0.0, "step_time_s": 0.3}
    steps = [base | {"step": 0, "loss": 0.5, "fetch_s": [0.1, 0.2]}, base | {"step": 1, "loss": 0.25, "fetch_s": []}]
    entries = [[["slice", 0, "grpc://n0", "a", 0, 2], ["row", 0, "a", 0], ["row", 0, "a", 1]], []]
    records = [StepRecord(metrics=m, version=i + 1, plan_wait_s=0.5, t_end=10.0 + i,
                          consumed=tuple(CONSUMED_ENTRY.validate_python(e) for e in c), publish_s=0.01)
               for i, (m, c) in enumerate(zip(steps, entries, strict=True))]
    with RankReport(str(tmp_path / "out" / "trainer_rank{rank}.json"), env) as report:
        report.add(records[0])
        side = tmp_path / "out" / "trainer_rank1.json.consumed.jsonl"
        assert [json.loads(line) for line in side.read_text().splitlines()] == entries[0]  # on disk already
        report.add(records[1])
    doc = json.loads((tmp_path / "out" / "trainer_rank1.json").read_text())
    assert doc["env"] == env and doc["consumed"] == entries[0]
    for i, (m, line) in enumerate(zip(steps, doc["steps"], strict=True)):  # the metrics, then the loop's fields
        loop = {"version": i + 1, "plan_wait_s": 0.5, "t_end": 10.0 + i, "publish_s": 0.01}
        assert line.items() >= (m | loop).items()
    back = read_document(RankReportDocument, tmp_path / "out" / "trainer_rank1.json")
    assert [s.fetch_s for s in back.steps] == [[0.1, 0.2], []] and [r.sample_idx for r in back.rows()] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["trainer_rank1.json"]  # side files removed
    report.close()  # twice is fine


def test_progress_lines_keep_their_json_form_and_read_back(tmp_path: Path) -> None:
    """Rank 0's progress line: the step's fields in a fixed order, the groups admitted so far, then the step's
    figures (null when no trajectory was logged for it); the codec reads a line back as the same record."""
    metrics = {"step": 3, "train_batch": 1, "position": 1, "loss": 0.5, "rows": 16, "abs_logp_diff": 0.01,
               "step_time_s": 0.2, "grad_norm": 1.0}
    step = StepRecord(metrics=metrics, version=4, plan_wait_s=0.1, t_end=100.0,
                      figures=StepFigures(arch_staleness_mean=1.5, arch_staleness_max=3, reward_mean=0.25))
    path = tmp_path / "progress.jsonl"
    append_line(path, progress_line(step, admitted_groups=8))
    append_line(path, progress_line(dataclasses.replace(step, figures=None), admitted_groups=9))
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert list(first.items()) == [
        ("step", 3), ("train_batch", 1), ("position", 1), ("version", 4), ("loss", 0.5), ("rows", 16),
        ("abs_logp_diff", 0.01), ("plan_wait_s", 0.1), ("step_time_s", 0.2), ("t_end", 100.0),
        ("admitted_groups", 8), ("arch_staleness_mean", 1.5), ("arch_staleness_max", 3), ("reward_mean", 0.25)]
    assert second["arch_staleness_mean"] is None and second["admitted_groups"] == 9
    a, b = read_lines(ProgressLine, path)
    assert a == progress_line(step, admitted_groups=8) and b.reward_mean is None
