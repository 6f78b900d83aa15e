"""The pydantic mirrors and the Arrow schema agree field for field; wire documents decode strictly."""

from __future__ import annotations

import json
import typing

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas import TRAJECTORY_SCHEMA, TrajectoryRecord, records_to_batch
from schemas.arrow import METADATA_SCHEMA, SCHEMA_VERSION
from schemas.plan import MicroBatch, MiniBatchPlan, PlannedSlice, RankPlan
from schemas.read_channel import CANONICAL_JSON, slices_by_hand
from schemas.trajectory import TrajectoryError
from schemas.wire import (
    MetadataTicket,
    PutGroup,
    SlicesTicket,
    WireError,
    decode_action_body,
    decode_descriptor,
    decode_ticket,
)

# Arrow type -> the Python type the pydantic field must accept (after unwrapping Optional/Annotated)
_PY = {
    pa.string(): str,
    pa.int16(): int,
    pa.int32(): int,
    pa.int64(): int,
    pa.float32(): float,
    pa.timestamp("us"): "datetime",
}


def _base(tp: typing.Any) -> typing.Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, __import__("types").UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0]
        else:
            return tp


def test_record_model_mirrors_arrow_schema_field_for_field() -> None:
    model_fields = list(TrajectoryRecord.model_fields)
    assert model_fields == TRAJECTORY_SCHEMA.names
    for field in TRAJECTORY_SCHEMA:
        ann = _base(TrajectoryRecord.model_fields[field.name].annotation)
        if pa.types.is_list(field.type):
            assert typing.get_origin(ann) is list, field.name
            continue
        want = _PY[field.type]
        if want == "datetime":
            assert ann.__name__ == "datetime", field.name
        else:
            assert ann is want, field.name


def test_records_to_batch_matches_schema_and_fills_defaults() -> None:
    r = TrajectoryRecord(
        group_id="g", sample_idx=1, policy_version=2, prompt_ids=[1, 2, 3], response_ids=[4, 5],
        response_logprobs=[-0.5, -0.25],
    )
    b = records_to_batch([r])
    assert b.schema.equals(TRAJECTORY_SCHEMA)
    row = b.to_pylist()[0]
    assert row["prompt_len"] == 3 and row["response_len"] == 2
    assert row["loss_mask"] == [1, 1] and row["policy_version_min"] == 2


def test_records_to_batch_refuses_mismatched_lengths() -> None:
    record = TrajectoryRecord(group_id="g", sample_idx=0, policy_version=0, prompt_ids=[1],
                              response_ids=[1, 2], response_logprobs=[0.0])
    with pytest.raises(ValueError, match="response_logprobs"):
        records_to_batch([record])


def test_records_fill_unset_fields_row_by_row() -> None:
    rows = [TrajectoryRecord(group_id="g", sample_idx=0, policy_version=3, policy_version_min=1, prompt_ids=[1],
                             response_ids=[2], response_logprobs=[0.0], loss_mask=[0], status="aborted"),
            TrajectoryRecord(group_id="g", sample_idx=1, policy_version=3, prompt_ids=[1],
                             response_ids=[2, 3], response_logprobs=[0.0, 0.0])]
    got = records_to_batch(rows).to_pydict()
    assert got["policy_version_min"] == [1, 3]
    assert got["loss_mask"] == [[0], [1, 1]]
    assert got["status"] == ["aborted", "completed"]
    assert got["response_len"] == [1, 2] and got["data_source"] == ["default", "default"]
    assert got["num_turns"] == [1, 1] and got["loss_tokens"] == [0, 2]  # one turn; the mask's ones


def test_records_of_a_multi_turn_response_carry_turns_and_trained_tokens() -> None:
    def record(**kw: object) -> TrajectoryRecord:
        return TrajectoryRecord(group_id="g", sample_idx=0, policy_version=0, prompt_ids=[1], response_ids=[2, 3, 4, 5],
                                response_logprobs=[-0.5, 0.0, 0.0, -0.25], loss_mask=[1, 0, 0, 1], **kw)  # type: ignore[arg-type]

    row = records_to_batch([record(num_turns=2)]).to_pylist()[0]
    assert row["num_turns"] == 2 and row["loss_tokens"] == 2
    assert records_to_batch([record(num_turns=2, loss_tokens=2)]).to_pylist()[0]["loss_tokens"] == 2
    with pytest.raises(ValueError, match=r"'loss_tokens' row 0: 4 values, expected 2 \(sum\(loss_mask\)\)"):
        records_to_batch([record(loss_tokens=4)])
    with pytest.raises(ValueError, match="num_turns"):
        record(num_turns=0)


def test_metadata_schema_is_a_projection_of_trajectory_schema() -> None:
    assert METADATA_SCHEMA.names[0] == "seq" and METADATA_SCHEMA.names[-1] == "released"
    for f in METADATA_SCHEMA:
        if f.name not in ("seq", "released"):
            assert TRAJECTORY_SCHEMA.field(f.name).equals(f)


def test_wire_documents_round_trip() -> None:
    t = SlicesTicket(slices=[{"group_id": "g", "start": 0, "stop": 4}], columns=["response_ids"])
    assert decode_ticket(t.to_bytes()) == t
    assert decode_ticket(MetadataTicket(since=7).to_bytes()).since == 7
    assert decode_descriptor(b'{"v": 3, "kind": "put_group", "group_id": "x", "rows": 4}') == PutGroup(
        group_id="x", rows=4)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"kind": "metadata"}', "'v'"),
        (b'{"v": 99, "kind": "metadata"}', "unsupported schema version"),
        (b'{"v": 3, "kind": "nope"}', "kind"),
        (b'{"v": 3, "kind": "slices", "slices": [{"group_id": "g", "start": 5, "stop": 2}]}', "reversed"),
        (b'{"v": 3, "kind": "metadata", "since": -1}', "since"),
        (b'{"v": 3, "kind": "metadata", "extra": 1}', "extra"),
    ],
)
def test_bad_tickets_raise_wire_error_naming_the_problem(raw: bytes, needle: str) -> None:
    with pytest.raises(WireError, match=needle):
        decode_ticket(raw)


_SLICES = st.fixed_dictionaries({
    "group_id": st.one_of(st.text(max_size=3), st.just("g" * 513), st.integers()),
    "start": st.one_of(st.integers(-1, 3), st.booleans()), "stop": st.integers(0, 4)})


@settings(max_examples=300, deadline=None)
@given(v=st.sampled_from([SCHEMA_VERSION, 99, True, "2"]), kind=st.sampled_from(["slices", "metadata"]),
       slices=st.lists(_SLICES, max_size=3), columns=st.one_of(st.none(), st.lists(st.sampled_from(["reward", 1]))),
       extra=st.sampled_from(["", ',"extra":1', ',"v":2', ' ']))
def test_slices_tickets_decoded_by_hand_get_the_models_verdict(v: object, kind: str, slices: list[object],
                                                                columns: object, extra: str) -> None:
    doc: dict[str, object] = {"v": v, "kind": kind, "slices": slices}
    if columns is not None:
        doc["columns"] = columns
    raw = (CANONICAL_JSON.encode(doc)[:-1] + extra + "}").encode()  # extra: another key, a repeated one, a space
    fast = slices_by_hand(raw)
    try:
        model = decode_ticket(raw)
    except WireError:
        assert fast is None
        return
    assert fast is None or (isinstance(model, SlicesTicket)
                            and fast == ([(s.group_id, s.start, s.stop) for s in model.slices], model.columns))
    if not extra and isinstance(model, SlicesTicket):
        assert fast is not None  # what clients send (canonical, valid) takes the fast path


def test_action_bodies() -> None:
    assert decode_action_body("health", b"").v == SCHEMA_VERSION
    with pytest.raises(WireError, match="unknown action"):
        decode_action_body("explode", b"{}")
    with pytest.raises(WireError, match="group_ids"):
        decode_action_body("release", b'{"v": 3, "group_ids": []}')


def test_an_image_whose_shape_overflows_int64_is_refused() -> None:
    from schemas.images import key_of
    from schemas.trajectory import TrajectoryError, normalize_images

    shape = [65536] * 4  # 2^64 elements: a product in int64 wraps to 0, matching 0 bytes of data
    table = pa.table({"image_key": pa.array([key_of("uint8", shape, pa.py_buffer(b""))], pa.binary(32)),
                      "shape": pa.array([shape], pa.list_(pa.int32())), "dtype": ["uint8"],
                      "data": pa.array([b""], pa.large_binary())})
    with pytest.raises(TrajectoryError, match="needs 18446744073709551616") as exc:
        normalize_images(table)
    assert exc.value.column == "data"


def test_a_table_naming_a_column_twice_is_a_schema_error_not_a_crash() -> None:
    from schemas.trajectory import TrajectoryError, normalize_images
    from schemas.weights import WeightsError, check

    images = pa.Table.from_arrays([pa.array([b"x" * 32], pa.binary(32)), pa.array(["uint8"]), pa.array(["uint8"])],
                                  names=["image_key", "dtype", "dtype"])
    with pytest.raises(TrajectoryError, match="'dtype' appears more than once"):
        normalize_images(images)
    weights = pa.Table.from_arrays([pa.array(["w"]), pa.array(["float32"]), pa.array(["float32"])],
                                   names=["name", "dtype", "dtype"])
    with pytest.raises(WeightsError, match=r"\['dtype'\] more than once"):
        check(weights)


def test_records_token_versions_fill_row_by_row_and_set_the_oldest_version() -> None:
    """A partial rollout's record gives each token's version, its policy_version_min is their minimum; a record
    without them gets its policy_version for every token."""
    rows = [TrajectoryRecord(group_id="g", sample_idx=0, policy_version=5, prompt_ids=[1], response_ids=[2, 3, 4],
                             response_logprobs=[0.0] * 3, token_versions=[3, 4, 5]),
            TrajectoryRecord(group_id="g", sample_idx=1, policy_version=5, prompt_ids=[1], response_ids=[2, 3],
                             response_logprobs=[0.0] * 2)]
    batch = records_to_batch(rows)
    assert batch.column("token_versions").to_pylist() == [[3, 4, 5], [5, 5]]
    assert batch.column("policy_version_min").to_pylist() == [3, 5]
    with pytest.raises(TrajectoryError, match="token_versions' row 0 holds version 6") as exc:
        records_to_batch([rows[0].model_copy(update={"token_versions": [3, 4, 6]})])
    assert exc.value.column == "token_versions"


def _two_rank_plan() -> MiniBatchPlan:
    def mb(slices: list[tuple[str, str, int, int]], tokens: int) -> MicroBatch:
        ps = [PlannedSlice(node=n, group_id=g, start=a, stop=b) for n, g, a, b in slices]
        return MicroBatch(slices=ps, advantages=[float(i) for i in range(sum(s.rows for s in ps))], tokens=tokens)
    return MiniBatchPlan(step=3, train_batch=1, position=1, group_ids=["g1", "g2", "g3"], ranks=[
        RankPlan(dp_rank=0, micro_batches=[mb([("n1", "g1", 0, 2), ("n2", "g2", 0, 1)], 30), mb([], 0)]),
        RankPlan(dp_rank=1, micro_batches=[mb([("n2", "g3", 1, 3)], 12), mb([("n2", "g3", 0, 1)], 5)]),
    ])


def test_a_plan_written_as_rank_objects_is_stored_as_columns_and_read_back_per_rank() -> None:
    p = _two_rank_plan()
    assert p.nodes == ["n1", "n2"] and p.slice_group == [0, 1, 2, 2] and p.micro_slices == [0, 2, 2, 3, 4]
    assert p.advantages == [0.0, 1.0, 2.0, 0.0, 1.0, 0.0]
    r1 = p.for_rank(1)
    assert [[(s.group_id, s.start, s.stop) for s in m.slices] for m in r1.micro_batches] == [[("g3", 1, 3)],
                                                                                            [("g3", 0, 1)]]
    assert [m.advantages for m in r1.micro_batches] == [[0.0, 1.0], [0.0]]
    assert [m.tokens for m in r1.micro_batches] == [12, 5]
    back = MiniBatchPlan.model_validate_json(p.model_dump_json())
    assert back == p and [r.model_dump() for r in back.ranks] == [r.model_dump() for r in p.ranks]
    assert MiniBatchPlan(step=3, train_batch=1, position=1, group_ids=p.group_ids, ranks=p.ranks) == p
    with pytest.raises(KeyError, match="no dp_rank 2"):
        p.for_rank(2)


@pytest.mark.parametrize(("change", "needle"), [
    ({"slice_stop": [2, 1, 3]}, "wrong length"),
    ({"micro_slices": [0, 2, 1, 3, 4]}, "micro_slices must rise"),
    ({"slice_group": [0, 1, 2, 3]}, "names group 3 of 3"),
    ({"slice_node": [0, 1, 1, 2]}, "names node 2 of 2"),
    ({"advantages": [0.0]}, "6 rows but 1 advantages"),
    ({"slice_start": [0, 0, 4, 0]}, "rows but 6 advantages"),
])
def test_a_malformed_plan_on_the_wire_is_refused_naming_what_is_wrong(change: dict[str, object], needle: str) -> None:
    raw = {**_two_rank_plan().model_dump(), **change}
    with pytest.raises(ValidationError, match=needle):
        MiniBatchPlan.model_validate_json(json.dumps(raw))


def test_a_plan_of_rank_objects_refuses_unequal_micro_batch_counts_and_unknown_groups() -> None:
    mb = MicroBatch(slices=[PlannedSlice(node="n", group_id="g", start=0, stop=1)], advantages=[1.0])
    with pytest.raises(ValidationError, match="different micro-batch counts"):
        MiniBatchPlan(step=0, train_batch=0, position=0, group_ids=["g"],
                      ranks=[RankPlan(dp_rank=0, micro_batches=[mb]), RankPlan(dp_rank=1, micro_batches=[mb, mb])])
    with pytest.raises(ValidationError, match="not among the plan's group_ids"):
        MiniBatchPlan(step=0, train_batch=0, position=0, group_ids=["h"],
                      ranks=[RankPlan(dp_rank=0, micro_batches=[mb])])
