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


def test_encoding_leaves_nothing_resident_of_the_tensors_it_copied() -> None:
    """A trainer encodes a version every step from temporary casts: what stays resident must not grow with the
    versions (``pa.array`` over memoryviews of torch tensors kept each version's bytes: 270 MB a step for SmolLM2,
    until the OOM killer stopped the trainer)."""
    torch = pytest.importorskip("torch")
    psutil = pytest.importorskip("psutil")
    from schemas.weights import from_tensors

    src = {f"w{i}": torch.randn(1024, 1024) for i in range(16)}  # 32 MiB a version as bfloat16
    from_tensors(src.items(), torch, dtype="bfloat16")
    before = psutil.Process().memory_info().rss
    for _ in range(10):
        table = from_tensors(src.items(), torch, dtype="bfloat16")
    after = psutil.Process().memory_info().rss
    assert table.column("data")[3].as_py() == bytes(src["w3"].to(torch.bfloat16).view(torch.uint8).numpy())
    assert after - before < 3 * 32 * 2**20, f"{(after - before) / 2**20:.0f} MiB more resident after 10 versions"
