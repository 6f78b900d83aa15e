"""The native pass of the write path (schemas/_kernels.c) against the Python rules it stands in for.

Differential: on any batch, the native pass accepts only what the Python rules accept, and then returns the
very batch they would (``bytes`` included); a batch breaking a rule it declines with a reason naming the
column the Python rules name; a batch outside the common case it hands to them. And the batches the
project's own writers send (the records helpers, the engine connector) take the native pass: a change that
pushes them off it fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.fake_engine import FakeCompletion, FakeFlatLogprobs, FakeRequestOutput
from connectors.vllm import aborted_batch, group_to_batch
from schemas.arrow import TRAJECTORY_SCHEMA
from schemas.native import (
    ACCEPTED,
    ACCEPTED_OTHER_FIELDS,
    RULE_COLUMNS,
    STEPS_ASIDE,
    checked_natively,
    native_verdict,
    row_bytes,
)
from schemas.trajectory import TrajectoryError, group_by_rules, normalize_batch, normalize_group

GID = "g-native"
Verdict = pa.RecordBatch | TrajectoryError


def _python_rules(batch: pa.RecordBatch, group_id: str = GID) -> Verdict:
    """The reference: the Python rules on ``batch`` as a whole group."""
    try:
        return group_by_rules([batch], group_id, batch.num_rows)[0]
    except TrajectoryError as exc:
        return exc


def _differ(batch: pa.RecordBatch, group_id: str = GID) -> tuple[int, Verdict]:
    """Both verdicts on ``batch`` as a whole group, after checking they agree: the native pass accepts only what
    the Python rules accept (and returns their batch), and declines what they accept only as outside its
    common case, never for a rule."""
    code, _ = native_verdict(batch, group_id)
    python = _python_rules(batch, group_id)
    assert code in (ACCEPTED, ACCEPTED_OTHER_FIELDS) or code in STEPS_ASIDE or code in RULE_COLUMNS, code
    if code in (ACCEPTED, ACCEPTED_OTHER_FIELDS):
        assert isinstance(python, pa.RecordBatch), python
        native = checked_natively(batch, group_id)
        assert native is not None and native.batch.equals(python)
        assert native.batch.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True)
        # the row sizes read off the same export: the stored batch's, whenever the writer sent every column
        assert (native.row_bytes is None) == (batch.num_columns < len(TRAJECTORY_SCHEMA))
        if native.row_bytes is not None:
            assert np.array_equal(native.row_bytes, row_bytes(python))
    elif isinstance(python, pa.RecordBatch):
        assert code in STEPS_ASIDE, f"the native pass refused rule {RULE_COLUMNS.get(code)} of a valid batch"
    return code, python


def _with(batch: pa.RecordBatch, name: str, array: pa.Array) -> pa.RecordBatch:
    i = batch.schema.get_field_index(name)
    return batch.set_column(i, batch.schema.field(i).with_type(array.type), array)


def _wire(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` as a node receives it: one IPC stream of its schema (what a Flight DoPut carries)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return pa.ipc.open_stream(sink.getvalue()).read_next_batch()


# ---- the project's writers take the native pass ----------------------------------------------------


def _engine_output(n: int, lengths: list[int], reasons: list[str | None]) -> FakeRequestOutput:
    outs = []
    for i, (length, reason) in enumerate(zip(lengths, reasons, strict=True)):
        ids = [(7 * i + j) % 500 for j in range(length)]
        logprobs = FakeFlatLogprobs.from_positions([[(t, -0.25)] for t in ids])
        outs.append(FakeCompletion(index=i, token_ids=ids, logprobs=logprobs, finish_reason=reason))
    return FakeRequestOutput(request_id="r", prompt_token_ids=[1, 2, 3, 4], outputs=outs[::-1][:n])


def _writer_batches(make_group) -> dict[str, pa.RecordBatch]:  # type: ignore[no-untyped-def]
    key = bytes(range(32))
    when = datetime(2026, 1, 1, 12, 0)
    return {
        "records": make_group(GID, size=4, response_len=8),
        "records, one row, empty response": make_group(GID, size=1, response_len=0),
        "records with images": make_group(GID, size=3, image_keys=[key, key]),
        "engine, completed": group_to_batch(_engine_output(4, [5, 6, 0, 9], ["stop", "length", "stop", "stop"]),
                                            group_id=GID, policy_version=3, data_source="math",
                                            rewards=[1.0, 0.0, 0.5, 0.0], created_at=when),
        "engine, processed logprobs, images": group_to_batch(
            _engine_output(2, [3, 4], ["stop", "stop"]), group_id=GID, policy_version=2, policy_version_min=1,
            data_source="vision", logprobs_mode="processed_logprobs", image_keys=[key]),
        "engine, aborted and missing samples": group_to_batch(
            _engine_output(2, [3, 4], ["abort", "stop"]), group_id=GID, policy_version=0, data_source="s",
            group_size=4),
        "engine, aborted group": aborted_batch(group_id=GID, group_size=4, prompt_token_ids=[1, 2, 3],
                                               policy_version=1, data_source="s"),
    }


@pytest.mark.parametrize("name", ["records", "records, one row, empty response", "records with images",
                                  "engine, completed", "engine, processed logprobs, images",
                                  "engine, aborted and missing samples", "engine, aborted group"])
def test_every_batch_the_project_writes_takes_the_native_pass(make_group, name: str) -> None:
    sent = _writer_batches(make_group)[name]
    for batch in (sent, _wire(sent)):
        code, python = _differ(batch)
        assert code in (ACCEPTED, ACCEPTED_OTHER_FIELDS), f"{name}: off the native pass ({STEPS_ASIDE.get(code)})"
        assert isinstance(python, pa.RecordBatch)
        assert normalize_group([batch], GID, batch.num_rows)[0].equals(python)


# ---- named cases -------------------------------------------------------------------------------


def test_a_valid_group_is_accepted_natively_as_the_python_rules_return_it(make_group) -> None:
    for batch in (make_group(GID, size=1), make_group(GID, size=8, response_len=33), make_group(GID, response_len=0)):
        code, _ = _differ(batch)
        assert code == ACCEPTED
    # rows in any order, and a writer's `bytes` column that is wrong: recomputed
    batch = make_group(GID, size=4)
    shuffled = _with(batch, "sample_idx", pa.array([2, 0, 3, 1], pa.int32()))
    shuffled = _with(shuffled, "bytes", pa.array([0, 1, 2, 3], pa.int64()))
    code, python = _differ(shuffled)
    assert code == ACCEPTED and python.column("sample_idx").to_pylist() == [2, 0, 3, 1]  # type: ignore[union-attr]
    assert normalize_group([shuffled], GID, 4)[0].equals(python)


def _mutations() -> dict[str, tuple[Callable[[pa.RecordBatch], pa.RecordBatch], str | None]]:
    """Each way to break a rule (or to leave the common case), and the column the Python rules then name
    (``None``: they accept it)."""
    i32, f32 = pa.list_(pa.int32()), pa.list_(pa.float32())
    return {
        "another group": (lambda b: _with(b, "group_id", pa.array([GID, "other", GID, GID])), "group_id"),
        "a repeated sample_idx": (lambda b: _with(b, "sample_idx", pa.array([0, 1, 1, 3], pa.int32())), "sample_idx"),
        "a negative sample_idx": (lambda b: _with(b, "sample_idx", pa.array([0, 1, -2, 3], pa.int32())), "sample_idx"),
        "sample_idx past the rows": (lambda b: _with(b, "sample_idx", pa.array([0, 1, 2, 9], pa.int32())),
                                     "sample_idx"),
        "an unknown status": (lambda b: _with(b, "status", pa.array(["completed"] * 3 + ["lost"])), "status"),
        "an aborted row": (lambda b: _with(b, "status", pa.array(["completed"] * 3 + ["aborted"])), None),
        "a NaN reward": (lambda b: _with(b, "reward", pa.array([0.0, float("nan"), 1.0, 0.0], pa.float32())), "reward"),
        "an infinite reward": (lambda b: _with(b, "reward", pa.array([0.0, 1.0, float("-inf"), 0.0], pa.float32())),
                               "reward"),
        "a loss mask of 2": (lambda b: _with(b, "loss_mask", pa.array([[1, 1], [1, 2], [0, 1], [1, 1]],
                                                                    pa.list_(pa.uint8()))), "loss_mask"),
        "a negative version": (lambda b: _with(_with(b, "policy_version", pa.array([0, -1, 0, 0], pa.int64())),
                                               "policy_version_min", pa.array([0, -1, 0, 0], pa.int64())),
                               "policy_version"),
        "min above the version": (lambda b: _with(b, "policy_version_min", pa.array([0, 0, 3, 0], pa.int64())),
                                  "policy_version_min"),
        "logprobs short": (lambda b: _with(b, "response_logprobs", pa.array([[0.0, 0.0]] * 3 + [[0.0]], f32)),
                           "response_logprobs"),
        "loss mask long": (lambda b: _with(b, "loss_mask", pa.array([[1, 1]] * 3 + [[1, 1, 1]], pa.list_(pa.uint8()))),
                           "loss_mask"),
        "response_len off": (lambda b: _with(b, "response_len", pa.array([2, 2, 3, 2], pa.int32())), "response_len"),
        "prompt_len off": (lambda b: _with(b, "prompt_len", pa.array([4, 4, 4, 5], pa.int32())), "prompt_len"),
        "num_images off": (lambda b: _with(b, "num_images", pa.array([0, 1, 0, 0], pa.int16())), "num_images"),
        "loss_tokens off": (lambda b: _with(b, "loss_tokens", pa.array([2, 2, 1, 2], pa.int32())), "loss_tokens"),
        "a mask of a tool span, loss_tokens its sum": (lambda b: _with(_with(
            b, "loss_mask", pa.array([[1, 0], [0, 0], [1, 1], [0, 1]], pa.list_(pa.uint8()))),
            "loss_tokens", pa.array([1, 0, 2, 1], pa.int32())), None),
        "a mask of a tool span, loss_tokens of all ones": (lambda b: _with(
            b, "loss_mask", pa.array([[1, 0], [1, 1], [1, 1], [1, 1]], pa.list_(pa.uint8()))), "loss_tokens"),
        "no model turn": (lambda b: _with(b, "num_turns", pa.array([1, 0, 1, 1], pa.int16())), "num_turns"),
        "several turns": (lambda b: _with(b, "num_turns", pa.array([3, 1, 2, 1], pa.int16())), None),
        "num_turns and loss_tokens left out": (lambda b: b.drop_columns(["num_turns", "loss_tokens"]), None),
        "a null reward": (lambda b: _with(b, "reward", pa.array([0.0, None, 1.0, 0.0], pa.float32())), "reward"),
        "a null token": (lambda b: _with(b, "prompt_ids", pa.array([[1, 2, 3, 4]] * 3 + [[1, None, 3, 4]], i32)),
                         "prompt_ids"),
        "a null list": (lambda b: _with(b, "prompt_ids", pa.array([[1, 2, 3, 4]] * 3 + [None], i32)), "prompt_ids"),
        "validity bitmaps without nulls": (lambda b: b.take([0, 1, 2, 3]), None),  # take allocates them
        "a zoned timestamp": (lambda b: _with(b, "created_at", b.column("created_at").cast(pa.timestamp("us", "UTC"))),
                              None),
        "a large list": (lambda b: _with(b, "response_ids", b.column("response_ids").cast(pa.large_list(pa.int32()))),
                         None),
        "int64 sample_idx": (lambda b: _with(b, "sample_idx", b.column("sample_idx").cast(pa.int64())), None),
        "list values named otherwise": (lambda b: _with(b, "prompt_ids", b.column("prompt_ids").cast(
            pa.list_(pa.field("element", pa.int32(), nullable=False)))), None),
        "a column missing": (lambda b: b.drop_columns(["finish_reason"]), None),
        "a column renamed": (lambda b: b.rename_columns([*b.schema.names[:-1], "image_refs"]), "image_refs"),
    }


@pytest.mark.parametrize("name", list(_mutations()))
def test_each_broken_rule_is_declined_naming_the_column_the_python_rules_name(make_group, name) -> None:
    mutate, column = _mutations()[name]
    batch = mutate(make_group(GID, size=4, response_len=2))
    code, python = _differ(batch)
    if column is None:
        assert isinstance(python, pa.RecordBatch), python
        return
    assert isinstance(python, TrajectoryError) and python.column == column, python
    assert code in STEPS_ASIDE or column in RULE_COLUMNS[code], (code, column)
    with pytest.raises(TrajectoryError) as err:
        normalize_group([batch], GID, 4)
    assert err.value.column == column


@pytest.mark.parametrize("nullable", [True, False])
@pytest.mark.parametrize("note", [None, "writer"])
def test_a_writer_schema_of_other_fields_is_accepted_as_the_schema_itself(make_group, nullable, note) -> None:
    batch = make_group(GID, size=3)
    loose = pa.schema([f.with_nullable(nullable).with_metadata(note and {"note": note}) for f in TRAJECTORY_SCHEMA],
                      metadata={"knittrans.logprobs_mode": "processed"})
    code, _ = _differ(pa.RecordBatch.from_arrays(batch.columns, schema=loose))
    assert code in (ACCEPTED, ACCEPTED_OTHER_FIELDS)  # _differ: equal to what the Python rules return


def test_a_sliced_batch_and_one_with_images_agree(make_group) -> None:
    batch = make_group(GID, size=8, response_len=5)
    part = batch.slice(3, 4)  # offsets not starting at 0; sample_idx 3..6 of 4 rows: not 0..3
    code, python = _differ(part)
    assert code in RULE_COLUMNS and isinstance(python, TrajectoryError) and python.column == "sample_idx"
    assert isinstance(normalize_batch(part, GID), pa.RecordBatch)  # a part of a group: distinct sample_idx suffice
    renumbered = _with(part, "sample_idx", pa.array([1, 0, 3, 2], pa.int32()))
    code, _ = _differ(renumbered)
    assert code == ACCEPTED
    key = bytes(range(32))
    with_images = _with(_with(renumbered, "image_keys", pa.array([[key], [], [key, key], []], pa.list_(pa.binary(32)))),
                        "num_images", pa.array([1, 0, 2, 0], pa.int16()))
    code, python = _differ(with_images)  # equal to the Python rules' batch, `bytes` (32 per key) included
    assert code == ACCEPTED
    sizes = python.column("bytes").to_pylist()  # type: ignore[union-attr]
    assert sizes[2] - sizes[3] == 64


def test_token_versions_sent_checked_and_left_out_filled(make_group) -> None:
    """A partial rollout's per-token versions pass natively when each lies in its row's [min, version]; one
    outside is refused naming ``token_versions``; left out, they are each row's ``policy_version``."""
    batch = make_group(GID, size=2, response_len=3)
    left_out = batch.drop_columns(["token_versions"])
    code, python = _differ(left_out)
    assert code == ACCEPTED_OTHER_FIELDS and isinstance(python, pa.RecordBatch)
    version = python.column("policy_version").to_pylist()
    assert python.column("token_versions").to_pylist() == [[v] * 3 for v in version]
    spans = _with(_with(batch, "policy_version", pa.array([5, 5], pa.int64())), "policy_version_min",
                  pa.array([3, 5], pa.int64()))
    code, python = _differ(_with(spans, "token_versions", pa.array([[3, 4, 5], [5, 5, 5]], pa.list_(pa.int32()))))
    assert code == ACCEPTED and isinstance(python, pa.RecordBatch)
    code, python = _differ(_with(spans, "token_versions", pa.array([[3, 4, 5], [4, 5, 5]], pa.list_(pa.int32()))))
    assert code == 11 and isinstance(python, TrajectoryError) and python.column == "token_versions"
    assert "row 1 holds version 4" in str(python)


# ---- the differential property -------------------------------------------------------------------

_RULE_FAULTS = ("group_id", "sample_idx<0", "sample_idx>=n", "sample_idx repeated", "status odd", "reward nan",
                "reward inf", "version<0", "min>version", "prompt_len", "response_len", "num_images",
                "logprobs length", "mask length", "mask 2", "null reward", "null token", "token version>version",
                "token_versions length", "loss_tokens", "num_turns")
_FAULT_COLUMN = {
    "group_id": "group_id", "sample_idx<0": "sample_idx", "sample_idx>=n": "sample_idx",
    "sample_idx repeated": "sample_idx", "status odd": "status", "reward nan": "reward", "reward inf": "reward",
    "null reward": "reward", "version<0": "version", "min>version": "version", "prompt_len": "prompt_len",
    "response_len": "response_len", "num_images": "num_images", "logprobs length": "response_logprobs",
    "mask length": "loss_mask", "mask 2": "loss_mask", "null token": "prompt_ids",
    "token version>version": "token_versions", "token_versions length": "token_versions",
    "loss_tokens": "loss_tokens", "num_turns": "num_turns",
}
"""The values each fault overwrites (two faults of the same values would overwrite each other)."""
_SHAPES = ("shuffled rows", "status aborted", "validity bitmaps", "large list", "int64 sample_idx", "column missing",
           "columns reordered", "zoned timestamp", "writer fields", "sliced", "wire", "token_versions left out")
"""Ways to send a valid group outside the native pass's common case, or through the wire (all valid)."""


def _group(n: int, faults: set[str], row: int, draw: st.DataObject) -> pa.RecordBatch:
    """A group of ``n`` rows with each of ``faults`` in row ``row`` (a rule fault breaks exactly its rule)."""
    resp = draw.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="response lengths")
    prompt = draw.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="prompt lengths")
    version = draw.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="versions")
    images = draw.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n), label="images per row")

    def at(values: list[object], fault: str, wrong: object) -> list[object]:
        return [wrong if i == row and fault in faults else v for i, v in enumerate(values)]

    sample_idx = at(at(at(list(range(n)), "sample_idx<0", -1), "sample_idx>=n", n), "sample_idx repeated",
                    (row + 1) % n)
    logprobs = [r + (i == row and "logprobs length" in faults) for i, r in enumerate(resp)]
    masks = [r + (i == row and "mask length" in faults) for i, r in enumerate(resp)]
    mask_values = [[2 if i == row and "mask 2" in faults else b
                    for b in draw.draw(st.lists(st.integers(0, 1), min_size=k, max_size=k), label="mask")]
                   for i, k in enumerate(masks)]
    loss_tokens = at([sum(m) for m in mask_values], "loss_tokens", sum(mask_values[row]) + 1)
    turns = at(draw.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n), label="turns"), "num_turns", 0)
    reward = at(at(at([0.5] * n, "reward nan", float("nan")), "reward inf", float("inf")), "null reward", None)
    token_versions = [[v] * (r + (i == row and "token_versions length" in faults))
                      for i, (v, r) in enumerate(zip(version, resp, strict=True))]
    if "token version>version" in faults and token_versions[row]:
        token_versions[row][0] += 1
    key = bytes(range(32))
    cols = {
        "group_id": pa.array(at([GID] * n, "group_id", "x")),
        "sample_idx": pa.array(sample_idx, pa.int32()),
        "policy_version": pa.array(at(list(version), "version<0", -1), pa.int64()),
        "policy_version_min": pa.array(at(at(list(version), "version<0", -1), "min>version", version[row] + 1),
                                       pa.int64()),
        "data_source": pa.array(["math"] * n),
        "prompt_len": pa.array(at(list(prompt), "prompt_len", prompt[row] + 1), pa.int32()),
        "response_len": pa.array(at(list(resp), "response_len", resp[row] + 1), pa.int32()),
        "reward": pa.array(reward, pa.float32()),
        "finish_reason": pa.array(["stop"] * n),
        "status": pa.array(at(["completed"] * n, "status odd", "odd")),
        "num_images": pa.array(at(list(images), "num_images", images[row] + 1), pa.int16()),
        "num_turns": pa.array(turns, pa.int16()),
        "loss_tokens": pa.array(loss_tokens, pa.int32()),
        "created_at": pa.array(np.zeros(n, dtype="datetime64[us]")),
        "completed_at": pa.array(np.zeros(n, dtype="datetime64[us]")),
        "bytes": pa.array([0] * n, pa.int64()),
        "prompt_ids": pa.array([[None if i == row and "null token" in faults and j == 0 else j for j in range(p)]
                                for i, p in enumerate(prompt)], pa.list_(pa.int32())),
        "response_ids": pa.array([list(range(r)) for r in resp], pa.list_(pa.int32())),
        "response_logprobs": pa.array([[0.0] * k for k in logprobs], pa.list_(pa.float32())),
        "loss_mask": pa.array(mask_values, pa.list_(pa.uint8())),
        "image_keys": pa.array([[key] * k for k in images], pa.list_(pa.binary(32))),
        "token_versions": pa.array(token_versions, pa.list_(pa.int32())),
    }
    return pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)


def _reshape(batch: pa.RecordBatch, shape: str, draw: st.DataObject) -> pa.RecordBatch:
    """``batch`` sent another valid way (the Python rules' verdict on it stays the same)."""
    n = batch.num_rows
    if shape == "shuffled rows":  # the rows in another order: sample_idx permuted (no rule ties it to the row)
        order = draw.draw(st.permutations(range(n)), label="order")
        return _with(batch, "sample_idx", batch.column("sample_idx").take(pa.array(order)))
    if shape == "status aborted":  # every "completed" row "aborted" (another status stays)
        status = batch.column("status")
        return _with(batch, "status", pc.if_else(pc.equal(status, "completed"), "aborted", status))
    if shape == "validity bitmaps":
        return batch.take(list(range(n)))
    if shape == "large list":
        return _with(batch, "response_ids", batch.column("response_ids").cast(pa.large_list(pa.int32())))
    if shape == "int64 sample_idx":
        return _with(batch, "sample_idx", batch.column("sample_idx").cast(pa.int64()))
    if shape == "column missing":
        return batch.drop_columns(["finish_reason"])
    if shape == "columns reordered":
        return batch.select(list(reversed(batch.schema.names)))
    if shape == "zoned timestamp":
        return _with(batch, "created_at", batch.column("created_at").cast(pa.timestamp("us", "UTC")))
    if shape == "writer fields":
        loose = pa.schema([f.with_nullable(True) for f in batch.schema], metadata={"knittrans.note": "w"})
        return pa.RecordBatch.from_arrays(batch.columns, schema=loose)
    if shape == "token_versions left out":  # each row's policy_version once per token (a fault in it goes too)
        return batch.drop_columns(["token_versions"])
    if shape == "sliced":  # the group as rows 1..n of a larger batch (offsets that do not start at 0)
        return pa.concat_batches([batch.slice(0, 1), batch]).slice(1, n)
    return _wire(batch)


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 6), faults=st.sets(st.sampled_from(_RULE_FAULTS), max_size=2).filter(
    lambda f: len({_FAULT_COLUMN[x] for x in f}) == len(f)),
       shapes=st.lists(st.sampled_from(_SHAPES), max_size=2, unique=True), data=st.data())
def test_the_native_verdict_is_the_python_verdict(n: int, faults: set[str], shapes: list[str],
                                                    data: st.DataObject) -> None:
    """A random group, with up to two rule faults in one random row, sent up to two other valid ways: the native
    pass accepts exactly the valid ones it reads (as the Python rules return them), declines each broken rule
    naming a column the Python rules name, and never declines a valid batch for a rule."""
    row = data.draw(st.integers(0, n - 1), label="faulty row")
    batch = _group(n, faults, row, data)
    # a fault can be no fault at all: a mask value or a token in an empty list, a repeat in a group of one row
    real = faults - ({"mask 2"} if not len(batch.column("loss_mask")[row]) else set()) - (
        {"null token"} if not len(batch.column("prompt_ids")[row]) else set()) - (
        {"sample_idx repeated"} if n == 1 else set()) - (
        {"token version>version"} if not len(batch.column("token_versions")[row]) else set()) - (
        {"token version>version", "token_versions length"} if "token_versions left out" in shapes else set())
    for shape in shapes:
        batch = _reshape(batch, shape, data)
    code, python = _differ(batch)
    if not real:
        assert isinstance(python, pa.RecordBatch), python
        read_natively = not set(shapes) - {"shuffled rows", "status aborted", "sliced", "wire", "writer fields",
                                           "token_versions left out"}
        assert code in (ACCEPTED, ACCEPTED_OTHER_FIELDS) or not read_natively, (code, shapes)
        return
    assert isinstance(python, TrajectoryError), (faults, shapes)
    if len(real) == 1 and code in RULE_COLUMNS:
        assert python.column in RULE_COLUMNS[code], (real, code, python)


def test_row_bytes_sum_to_the_batch_size_and_refuse_other_columns(make_group) -> None:
    batch = normalize_group([make_group(GID, size=5, response_len=7)], GID, 5)[0]
    sizes = row_bytes(batch)
    assert sizes.shape == (5, len(TRAJECTORY_SCHEMA)) and int(sizes.sum()) == batch.nbytes
    assert int(row_bytes(batch.slice(1, 3)).sum()) == int(sizes[1:4].sum())
    with pytest.raises(ValueError, match="not of the schema"):
        row_bytes(batch.drop_columns(["bytes"]))
    with pytest.raises(ValueError, match="not of the schema"):
        row_bytes(_with(batch, "sample_idx", batch.column("sample_idx").cast(pa.int64())))
