"""The trainer's parts in-process (no Megatron): packing, prefetch, loss, weights table, planning, config."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from schemas.records import TrajectoryRecord, records_to_batch
from train.config import LossConfig, ModelConfig, PackMode, TrainConfig
from train.packing import PACK_COLUMNS, list_arrays, pack
from train.prefetch import Prefetcher


def _table(lengths: list[tuple[int, int]], seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    recs = []
    for i, (p, r) in enumerate(lengths):
        mask = rng.integers(0, 2, r).tolist()
        recs.append(TrajectoryRecord(group_id="g", sample_idx=i, policy_version=0,
                                     prompt_ids=rng.integers(1, 100, p).tolist(),
                                     response_ids=rng.integers(1, 100, r).tolist(),
                                     response_logprobs=(-rng.random(r)).tolist(), loss_mask=mask))
    return pa.Table.from_batches([records_to_batch(recs)]).select(list(PACK_COLUMNS))


def _naive(table: pa.Table, adv: list[float]) -> list[dict[str, list[float]]]:
    """Per-row reference, built with plain Python loops."""
    out = []
    for i, row in enumerate(table.to_pylist()):
        toks = row["prompt_ids"] + row["response_ids"]
        p = len(row["prompt_ids"])
        n = len(toks)
        labels = [*toks[1:], 0]
        lp, mk, ad = [0.0] * n, [0.0] * n, [0.0] * n
        for j in range(len(row["response_ids"])):
            lp[p - 1 + j] = row["response_logprobs"][j]
            mk[p - 1 + j] = float(row["loss_mask"][j])
            ad[p - 1 + j] = adv[i]
        out.append({"tokens": toks, "labels": labels, "lp": lp, "mask": mk, "adv": ad})
    return out


def test_list_arrays_respects_slices() -> None:
    arr = pa.array([[1, 2], [3], [4, 5, 6], []], type=pa.list_(pa.int32())).slice(1, 2)
    offsets, values = list_arrays(pa.chunked_array([arr]))
    assert offsets.tolist() == [0, 1, 4]
    assert values.tolist() == [3, 4, 5, 6]


@pytest.mark.parametrize("mode", ["padded", "thd"])
def test_pack_matches_naive_reference(mode: PackMode) -> None:
    lengths = [(3, 5), (1, 1), (6, 2), (2, 7)]
    table = _table(lengths)
    # chunked + sliced input, the way a multi-node fetch returns it
    table = pa.concat_tables([table.slice(0, 1), table.slice(1, 3)])
    adv = [0.5, -1.0, 2.0, 0.25]
    got = pack(table, adv, mode=mode)
    ref = _naive(table, adv)
    assert got.rows == 4 and got.tokens_total == sum(p + r for p, r in lengths)
    if mode == "padded":
        assert got.tokens.shape == (4, 9) and got.cu_seqlens is None
        spans = [(i, 0, len(r["tokens"])) for i, r in enumerate(ref)]
    else:
        cu = got.cu_seqlens
        assert cu is not None and got.tokens.shape == (1, got.tokens_total)
        assert cu.tolist() == [0, 8, 10, 18, 27]
        spans = [(0, int(cu[i]), int(cu[i + 1]) - int(cu[i])) for i in range(4)]
    for (row, start, n), r in zip(spans, ref, strict=True):
        sl = slice(start, start + n)
        assert got.tokens[row, sl].tolist() == r["tokens"]
        assert got.labels[row, sl].tolist() == r["labels"]
        np.testing.assert_array_equal(got.rollout_logprobs[row, sl], np.asarray(r["lp"], dtype=np.float32))
        np.testing.assert_array_equal(got.loss_mask[row, sl], np.asarray(r["mask"], dtype=np.float32))
        np.testing.assert_array_equal(got.advantages[row, sl], np.asarray(r["adv"], dtype=np.float32))
        assert got.position_ids[row, sl].tolist() == list(range(n))
    assert got.loss_mask.sum() == sum(sum(r["mask"]) for r in ref)  # nothing on padding


def test_pack_rejects_mismatched_advantages() -> None:
    with pytest.raises(ValueError, match="2 advantages for 4 rows"):
        pack(_table([(2, 2)] * 4), [1.0, 2.0])


def test_block_causal_mask_stays_within_sequences() -> None:
    torch = pytest.importorskip("torch")
    from train.packing import block_causal_mask

    m = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 6)[0, 0]
    allowed = ~m
    assert allowed[1].tolist() == [True, True, False, False, False, False]
    assert allowed[3].tolist() == [False, False, True, True, False, False]  # not into sequence 0
    assert allowed[5].tolist() == [False] * 5 + [True]  # padding sees only itself


def test_prefetcher_order_depth_and_exposed_wait() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def fetch(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.02)
        return i * 10

    pf = Prefetcher(fetch, depth=1)
    try:
        pf.submit(range(4))
        time.sleep(0.1)
        assert started == [0]  # depth 1: only the first is fetched before anyone asks
        first = pf.get()
        assert first.value == 0 and first.wait_s < 0.015  # already there: no exposed wait
        time.sleep(0.1)  # "compute" micro-batch 0 while 1 is fetched
        assert started == [0, 1]
        assert [pf.get().value for _ in range(3)] == [10, 20, 30]
    finally:
        pf.close()


def test_prefetcher_depth0_fetches_on_demand_and_reraises() -> None:
    def fetch(i: int) -> int:
        if i == 1:
            msg = "node down"
            raise ConnectionError(msg)
        time.sleep(0.03)
        return i

    pf = Prefetcher(fetch, depth=0)
    try:
        pf.submit([0, 1])
        time.sleep(0.05)
        got = pf.get()
        assert got.value == 0 and got.wait_s >= 0.02  # nothing fetched ahead: the wait is exposed
        with pytest.raises(ConnectionError, match="node down"):
            pf.get()
    finally:
        pf.close()


def test_policy_loss_values() -> None:
    torch = pytest.importorskip("torch")
    from train.loss import policy_loss

    logp = torch.tensor([[-1.0, -1.0, -2.0, -0.5]])
    batch = {
        "rollout_logprobs": torch.tensor([[-1.0, -1.5, -1.0, -0.5]]),
        "advantages": torch.tensor([[1.0, 1.0, -1.0, 2.0]]),
        "loss_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
    }
    ce = (-logp).requires_grad_(True)
    loss_sum, count, report = policy_loss(ce, batch, LossConfig(clip_low=0.2, clip_high=0.2))
    ratio = np.exp([0.0, 0.5, -1.0])
    expected = [-1.0, -min(ratio[1], 1.2), -min(-ratio[2], -0.8)]
    assert int(count) == 3
    assert loss_sum.item() == pytest.approx(sum(expected), rel=1e-6)
    assert report["clip_frac"].tolist() == pytest.approx([2.0, 3.0])
    loss_sum.backward()
    # clipped tokens carry no gradient; the unclipped one has d/dce (-ratio*A) = ratio*A
    assert ce.grad.tolist()[0] == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_weights_table_roundtrip_including_bf16() -> None:
    torch = pytest.importorskip("torch")
    from train.weights import WEIGHTS_SCHEMA, arrow_to_weights, weights_to_arrow

    named = {"a.weight": torch.randn(3, 4), "b.weight": torch.randn(5).to(torch.bfloat16)}
    table = weights_to_arrow(named)
    assert table.schema.equals(WEIGHTS_SCHEMA)
    assert table.column("shape").to_pylist() == [[3, 4], [5]]
    assert table.column("dtype").to_pylist() == ["float32", "bfloat16"]
    back = arrow_to_weights(table)
    assert all(torch.equal(back[k], v) for k, v in named.items())


def test_plan_source_scans_metadata_and_plans(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    from flight_store.client import StoreClient
    from train.planning import PlanSource, load_planner

    servers = store_nodes(2)
    with StoreClient([s.location for s in servers]) as client:
        planner = load_planner("admission:Planner", {"train_batch_groups": 4, "group_size": 4, "mini_batches": 2},
                               dp_ranks=2)
        source = PlanSource(client, planner)
        assert source.poll(0) == []
        for gid in "abcd":
            client.put_group(make_group(gid))
        plans = source.wait(0, idle_timeout_s=5, poll_interval_s=0.01)
        plans += source.wait(0, idle_timeout_s=0.2, poll_interval_s=0.01)
        assert sorted(g for p in plans for g in p.group_ids) == ["a", "b", "c", "d"]
        assert [p.step for p in plans] == [0, 1]
        for p in plans:
            assert {r.dp_rank for r in p.ranks} == {0, 1}
        assert source.poll(0) == []  # admitted groups are not planned twice


def test_config_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="num_query_groups=3"):
        ModelConfig(num_attention_heads=4, num_query_groups=3)
    with pytest.raises(ValueError, match="stores is empty"):
        TrainConfig(stores=[])
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="pack must be"):
        TrainConfig(stores=["grpc://x:1"], pack="ragged")  # type: ignore[arg-type]


def test_entry_parses_into_typed_config() -> None:
    from train.entry import config_from_args, parser

    args = parser().parse_args(["--stores", "grpc://a:1,grpc://b:2", "--tp", "2", "--planner-option",
                                "train_batch_groups=8", "--planner-option", 'quotas=[{"column": "data_source"}]',
                                "--pack", "thd"])
    cfg = config_from_args(args)
    assert cfg.stores == ["grpc://a:1", "grpc://b:2"]
    assert cfg.parallel.tensor_parallel == 2 and cfg.pack == "thd"
    assert cfg.planner_options == {"train_batch_groups": 8, "quotas": [{"column": "data_source"}]}


def test_train_package_imports_without_torch() -> None:
    code = ("import sys, train, train.entry, train.trainer, train.planning, train.weights, train.model, "
            "train.mcore_compat; assert 'torch' not in sys.modules and 'megatron' not in sys.modules "
            "and 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_bench_baseline_builds_verl_dataproto_layout() -> None:
    torch = pytest.importorskip("torch")
    from bench.transfer import dataproto_shards, serialize

    table = _table([(3, 5), (1, 1), (6, 2)])
    shards = dataproto_shards(table, np.array([1.0, -1.0, 0.5], dtype=np.float32), ranks=2)
    assert [s["input_ids"].shape for s in shards] == [(2, 8), (1, 8)]  # right-padded to the batch max
    assert all(s["input_ids"].dtype == torch.int64 and s["position_ids"].dtype == torch.int64 for s in shards)
    first = table.slice(0, 1).to_pylist()[0]
    assert shards[0]["input_ids"][0, :8].tolist() == first["prompt_ids"] + first["response_ids"]
    assert shards[0]["attention_mask"][1].tolist() == [1, 1] + [0] * 6
    assert shards[0]["position_ids"][1].tolist() == [0, 1] + [1] * 6
    assert shards[0]["responses"][0].tolist() == first["response_ids"]
    assert shards[0]["response_mask"][1].tolist() == [table.column("loss_mask")[1].as_py()[0], 0, 0, 0, 0]
    assert shards[0]["advantages"][0].tolist() == [1.0] * 5
    back = torch.load(__import__("io").BytesIO(serialize(shards[1])), weights_only=True)
    assert torch.equal(back["old_log_probs"], shards[1]["old_log_probs"])
