"""The weights table's codec and rules (``schemas.weights``), one implementation for writer, store and reader."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from schemas.weights import WEIGHTS_SCHEMA, WeightsError, WeightTensor, check, decode, encode


def _table(**cols: object) -> pa.Table:
    base: dict[str, object] = {"name": ["a", "b"], "shape": [[2], [1, 3]], "dtype": ["float32", "bfloat16"],
                               "data": [np.ones(2, np.float32).tobytes(), b"\0" * 6]}
    base.update(cols)
    return pa.table(base)


def test_codec_round_trips_bytes_of_every_dtype() -> None:
    rows = [WeightTensor("bf", (3,), "bfloat16", b"\x01\x02" * 3), WeightTensor("i", (2, 2), "int64", bytes(32)),
            WeightTensor("empty", (0, 4), "float32", b"")]
    back = decode(encode(rows))
    assert [(w.name, w.shape, w.dtype, bytes(w.data)) for w in back] == [
        (w.name, w.shape, w.dtype, bytes(w.data)) for w in rows]


@pytest.mark.parametrize(("table", "needle"), [
    (_table().slice(0, 0), "no tensor"),
    (_table(name=["a", "a"]), "'a' is empty or repeated"),
    (_table(name=["", "b"]), "'' is empty or repeated"),
    (_table(dtype=["float32", "object"]), "unsupported dtype 'object'"),
    (_table(shape=[[-2], [1, 3]]), "negative dimension"),
    (_table(shape=[[3], [1, 3]]), "'a' has 8 bytes of data, but shape \\[3\\] of float32 needs 12"),
    (_table(name=pa.array(["a", None])), "null"),
    (_table().append_column("extra", pa.array([1, 2])), "unknown \\['extra'\\]"),
    (_table().drop_columns(["dtype"]), "missing \\['dtype'\\]"),
    (_table(shape=[["x"], ["y"]]), "types"),
])
def test_check_refuses_a_broken_table_naming_the_problem(table: pa.Table, needle: str) -> None:
    with pytest.raises(WeightsError, match=needle):
        check(table)


def test_check_accepts_columns_in_any_order_and_castable_types() -> None:
    t = _table().select(["data", "dtype", "shape", "name"])
    t = t.set_column(0, "data", t.column("data").cast(pa.binary()))
    assert check(t).schema.equals(WEIGHTS_SCHEMA)
