"""The native passes of the write path (schemas/_kernels.c) against the Python rules they stand in for.

The native check may only accept what the Python rules accept, and must then return the very batch they would
(``bytes`` included); anything else it hands to them, which name what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flight_store.groups import row_bytes
from schemas.arrow import TRAJECTORY_SCHEMA
from schemas.trajectory import (
    TrajectoryError,
    _checked_natively,
    _conformed,
    _finish,
    normalize_batch,
    normalize_group,
)

GID = "g-native"


def _python_rules(batch: pa.RecordBatch, group_id: str = GID) -> pa.RecordBatch | TrajectoryError:
    try:
        return _finish(_conformed(batch, None), group_id)
    except TrajectoryError as exc:
        return exc


def _agree(batch: pa.RecordBatch, group_id: str = GID) -> tuple[pa.RecordBatch | None, object]:
    """Both verdicts, after checking the native one is a subset of the Python one (and the same batch)."""
    native = _checked_natively(batch, group_id)
    python = _python_rules(batch, group_id)
    if native is not None:
        assert isinstance(python, pa.RecordBatch), python
        assert native.equals(python)
        assert native.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True)
    return native, python


def _with(batch: pa.RecordBatch, name: str, array: pa.Array) -> pa.RecordBatch:
    i = batch.schema.get_field_index(name)
    return batch.set_column(i, batch.schema.field(i).with_type(array.type), array)


def test_a_valid_group_is_accepted_natively_as_the_python_rules_return_it(make_group) -> None:
    for batch in (make_group(GID, size=1), make_group(GID, size=8, response_len=33), make_group(GID, response_len=0)):
        native, _ = _agree(batch)
        assert native is not None
        assert native.column("bytes").to_pylist() == _python_rules(batch).column("bytes").to_pylist()  # type: ignore[union-attr]
    # rows in any order, and a writer's `bytes` column that is wrong: recomputed
    batch = make_group(GID, size=4)
    shuffled = _with(batch, "sample_idx", pa.array([2, 0, 3, 1], pa.int32()))
    shuffled = _with(shuffled, "bytes", pa.array([0, 1, 2, 3], pa.int64()))
    native, _ = _agree(shuffled)
    assert native is not None and native.column("sample_idx").to_pylist() == [2, 0, 3, 1]
    assert normalize_group([shuffled], GID, 4)[0].equals(native)


def _mutations() -> dict[str, tuple[Callable[[pa.RecordBatch], pa.RecordBatch], str | None]]:
    """Each way to break a rule (or to leave the common case), and the column the Python rules then name
    (``None``: the Python rules accept it; only the native pass steps aside)."""
    i32, f32 = pa.list_(pa.int32()), pa.list_(pa.float32())
    return {
        "another group": (lambda b: _with(b, "group_id", pa.array([GID, "other", GID, GID])), "group_id"),
        "a repeated sample_idx": (lambda b: _with(b, "sample_idx", pa.array([0, 1, 1, 3], pa.int32())), "sample_idx"),
        "a negative sample_idx": (lambda b: _with(b, "sample_idx", pa.array([0, 1, -2, 3], pa.int32())), "sample_idx"),
        "sample_idx past the rows": (lambda b: _with(b, "sample_idx", pa.array([0, 1, 2, 9], pa.int32())), None),
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
def test_the_native_pass_steps_aside_for_what_breaks_a_rule_or_leaves_the_common_case(make_group, name) -> None:
    mutate, column = _mutations()[name]
    batch = mutate(make_group(GID, size=4, response_len=2))
    native, python = _agree(batch)
    assert native is None
    if column is None:
        assert isinstance(python, pa.RecordBatch), python
    else:
        assert isinstance(python, TrajectoryError) and python.column == column, python
        with pytest.raises(TrajectoryError) as err:
            normalize_batch(batch, GID)
        assert err.value.column == column


@pytest.mark.parametrize("nullable", [True, False])
@pytest.mark.parametrize("note", [None, "writer"])
def test_a_writer_schema_of_other_fields_is_accepted_as_the_schema_itself(make_group, nullable, note) -> None:
    batch = make_group(GID, size=3)
    loose = pa.schema([f.with_nullable(nullable).with_metadata(note and {"note": note}) for f in TRAJECTORY_SCHEMA],
                      metadata={"knittrans.logprobs_mode": "processed"})
    native, _ = _agree(pa.RecordBatch.from_arrays(batch.columns, schema=loose))
    assert native is not None  # _agree: equal to what the Python rules return, under TRAJECTORY_SCHEMA itself


def test_a_sliced_batch_and_one_with_images_agree(make_group) -> None:
    batch = make_group(GID, size=8, response_len=5)
    part = batch.slice(3, 4)  # offsets not starting at 0; sample_idx 3..6 of 4 rows: the Python rules decide
    native, python = _agree(part)
    assert native is None and isinstance(python, pa.RecordBatch)
    renumbered = _with(part, "sample_idx", pa.array([1, 0, 3, 2], pa.int32()))
    native, _ = _agree(renumbered)
    assert native is not None
    key = bytes(range(32))
    with_images = _with(_with(renumbered, "image_keys", pa.array([[key], [], [key, key], []], pa.list_(pa.binary(32)))),
                        "num_images", pa.array([1, 0, 2, 0], pa.int16()))
    native, _ = _agree(with_images)  # equal to the Python rules' batch, `bytes` (32 per key) included
    assert native is not None and native.column("bytes").to_pylist()[2] - native.column("bytes").to_pylist()[3] == 64


_FAULTS = (None, "group_id", "sample_idx<0", "sample_idx>=n", "sample_idx repeated", "status aborted", "status odd",
           "reward nan", "reward inf", "version<0", "min>version", "prompt_len", "response_len", "num_images",
           "logprobs length", "mask length", "mask 2")


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 6), fault=st.sampled_from(_FAULTS), data=st.data())
def test_any_small_group_gets_the_python_verdict_or_steps_aside(n: int, fault: str | None, data: st.DataObject) -> None:
    """A random group with at most one thing wrong in one random row (or none)."""
    resp = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    prompt = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    version = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    row = data.draw(st.integers(0, n - 1))

    def at(values: list[object], wrong: object, *faults: str) -> list[object]:
        return [wrong if i == row and fault in faults else v for i, v in enumerate(values)]

    sample_idx = list(data.draw(st.permutations(range(n))))
    sample_idx = at(at(at(sample_idx, -1, "sample_idx<0"), n, "sample_idx>=n"),  # type: ignore[assignment]
                    sample_idx[(row + 1) % n], "sample_idx repeated")
    lengths = [r + 1 if i == row and fault in ("logprobs length", "mask length") else r for i, r in enumerate(resp)]
    cols = {
        "group_id": pa.array(at([GID] * n, "x", "group_id")),
        "sample_idx": pa.array(sample_idx, pa.int32()),
        "policy_version": pa.array(at(list(version), -1, "version<0"), pa.int64()),
        "policy_version_min": pa.array(at(at(list(version), -1, "version<0"), version[row] + 1, "min>version"),
                                       pa.int64()),
        "data_source": pa.array(["math"] * n),
        "prompt_len": pa.array(at(list(prompt), prompt[row] + 1, "prompt_len"), pa.int32()),
        "response_len": pa.array(at(list(resp), resp[row] + 1, "response_len"), pa.int32()),
        "reward": pa.array(at([0.5] * n, float("nan"), "reward nan") if fault != "reward inf"
                           else at([0.5] * n, float("inf"), "reward inf"), pa.float32()),
        "finish_reason": pa.array(["stop"] * n),
        "status": pa.array(at(at(["completed"] * n, "aborted", "status aborted"), "odd", "status odd")),
        "num_images": pa.array(at([0] * n, 1, "num_images"), pa.int16()),
        "created_at": pa.array(np.zeros(n, dtype="datetime64[us]")),
        "completed_at": pa.array(np.zeros(n, dtype="datetime64[us]")),
        "bytes": pa.array([0] * n, pa.int64()),
        "prompt_ids": pa.array([list(range(p)) for p in prompt], pa.list_(pa.int32())),
        "response_ids": pa.array([list(range(r)) for r in resp], pa.list_(pa.int32())),
        "response_logprobs": pa.array([[0.0] * (lengths[i] if fault == "logprobs length" else r)
                                       for i, r in enumerate(resp)], pa.list_(pa.float32())),
        "loss_mask": pa.array([[2 if i == row and fault == "mask 2" else 1] * (lengths[i] if fault == "mask length"
                                                                              else r) for i, r in enumerate(resp)],
                              pa.list_(pa.uint8())),
        "image_keys": pa.array([[]] * n, pa.list_(pa.binary(32))),
    }
    batch = pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)
    native, python = _agree(batch)
    none = fault is None or (fault == "mask 2" and resp[row] == 0) or (fault == "sample_idx repeated" and n == 1)
    # the Python rules refuse every fault but these two, which only the native pass steps aside for
    assert isinstance(python, pa.RecordBatch) == (none or fault in ("sample_idx>=n", "status aborted")), python
    assert (native is not None) == none  # and it takes every group with nothing wrong


def test_row_bytes_sum_to_the_batch_size_and_refuse_other_columns(make_group) -> None:
    batch = normalize_group([make_group(GID, size=5, response_len=7)], GID, 5)[0]
    sizes = row_bytes(batch)
    assert sizes.shape == (5, len(TRAJECTORY_SCHEMA)) and int(sizes.sum()) == batch.nbytes
    assert int(row_bytes(batch.slice(1, 3)).sum()) == int(sizes[1:4].sum())
    with pytest.raises(ValueError, match="not of the schema"):
        row_bytes(batch.drop_columns(["bytes"]))
    with pytest.raises(ValueError, match="not of the schema"):
        row_bytes(_with(batch, "sample_idx", batch.column("sample_idx").cast(pa.int64())))
