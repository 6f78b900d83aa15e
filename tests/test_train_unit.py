"""The trainer's parts in-process (no Megatron): packing, prefetch, loss, weights table, planning, config, launcher."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from admission import AdmissionConfig, GrpoConfig, Planner, Quota
from schemas import documents
from schemas.records import TrajectoryRecord, records_to_batch
from train.config import ModelConfig, PackMode, TrainConfig, VisionConfig
from train.packing import PACK_COLUMNS, list_arrays, pack_tensors
from train.prefetch import Prefetcher

ADMISSION = AdmissionConfig(train_batch_groups=4, group_size=4, mini_batches=2)


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
    got = pack_tensors(table, adv, mode=mode)
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
        pack_tensors(_table([(2, 2)] * 4), [1.0, 2.0])


def test_block_causal_mask_stays_within_sequences() -> None:
    torch = pytest.importorskip("torch")
    from train.packing import block_causal_mask

    m = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 6)[0, 0]
    allowed = ~m
    assert allowed[1].tolist() == [True, True, False, False, False, False]
    assert allowed[3].tolist() == [False, False, True, True, False, False]  # not into sequence 0
    assert allowed[5].tolist() == [False] * 5 + [True]  # padding sees only itself


def test_prefetcher_fetches_one_ahead_of_the_step_in_order() -> None:
    """Depth 1: item 0 is fetched before the step asks; item k+1 begins once the step took item k, without
    the step asking for it (the fetch overlaps the step's compute), never further ahead; results in order."""
    asks: list[int] = []  # the step appends k just before its k-th get()
    asked_when_begun: dict[int, int] = {}  # item -> get() calls made when its fetch began
    begun = {i: threading.Event() for i in range(4)}

    def fetch(i: int) -> int:
        asked_when_begun[i] = len(asks)
        begun[i].set()
        return i * 10

    pf = Prefetcher(fetch, depth=1)
    try:
        pf.submit(range(4))
        assert begun[0].wait(timeout=30)  # fetched before anyone asks
        values = []
        for k in range(4):
            asks.append(k)
            values.append(pf.get(timeout=30).value)
            if k + 1 < 4:
                assert begun[k + 1].wait(timeout=30)  # fetched while step k computes, before step k+1 asks
        assert values == [0, 10, 20, 30]
        assert asked_when_begun == {0: 0, 1: 1, 2: 2, 3: 3}  # one ahead of the step, never more
    finally:
        pf.close()


def test_prefetcher_depth0_fetches_on_demand_and_reraises() -> None:
    asks: list[int] = []
    asked_when_begun: dict[int, int] = {}

    def fetch(i: int) -> int:
        asked_when_begun[i] = len(asks)
        if i == 1:
            msg = "node down"
            raise ConnectionError(msg)
        return i

    pf = Prefetcher(fetch, depth=0)
    try:
        pf.submit([0, 1])
        asks.append(0)
        got = pf.get(timeout=30)
        assert got.value == 0 and asked_when_begun == {0: 1}  # nothing fetched ahead: item 0 began once asked
        assert got.wait_s >= got.fetch_s  # so the step waited through the whole fetch (the wait is exposed)
        asks.append(1)
        with pytest.raises(ConnectionError, match="node down"):
            pf.get(timeout=30)
        assert asked_when_begun == {0: 1, 1: 2}
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
    loss_sum, count, report = policy_loss(ce, batch, GrpoConfig(clip_low=0.2, clip_high=0.2))
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
    from schemas.weights import WEIGHTS_SCHEMA
    from train.hf_llama import read_weights, weights_table

    named = {"a.weight": torch.randn(3, 4), "b.weight": torch.randn(5).to(torch.bfloat16)}
    table = weights_table(named)
    assert table.schema.equals(WEIGHTS_SCHEMA)
    assert table.column("shape").to_pylist() == [[3, 4], [5]]
    assert table.column("dtype").to_pylist() == ["float32", "bfloat16"]
    back = read_weights(table)
    assert all(torch.equal(back[k], v) for k, v in named.items())


def test_publisher_stores_weights_then_version_then_records_then_releases_off_the_training_thread(  # type: ignore[no-untyped-def]
        store_nodes, make_group) -> None:
    """The trainer's publisher: ``submit`` returns while the weights are still being stored (the next step runs);
    on the publish thread the weights land on every node, then the version, then the step is recorded, then its
    groups are released (what a store released was recorded as trained); one version at a time; an error
    reaches the next call and publishes nothing."""
    from flight_store.publishing import StorePublisher
    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter
    from train.loop import Publisher, StepRecord

    servers = store_nodes(2)
    table = pa.table({"name": ["w"], "shape": [[1]], "dtype": ["int16"], "data": [b"\x01\x02"]})
    gate = threading.Event()
    calls: list[tuple[str, Any, str]] = []

    class Recording:  # the real clients, each call noted with the thread it ran on
        def __init__(self, client: StoreReader, publisher: StorePublisher) -> None:
            self.client, self.publisher = client, publisher

        def put_weights(self, t: pa.Table, version: int) -> None:
            assert gate.wait(30)
            if version == 4:
                raise RuntimeError("node gone while storing v4")
            calls.append(("weights", version, threading.current_thread().name))
            self.publisher.put_weights(t, version)

        def publish_version(self, version: int) -> None:
            calls.append(("version", version, threading.current_thread().name))
            self.publisher.publish_version(version)

        def release(self, group_ids: list[str]) -> None:
            calls.append(("release", group_ids, threading.current_thread().name))
            self.client.release(group_ids)

    recorded: list[StepRecord] = []

    def record(step: StepRecord) -> None:
        recorded.append(step)
        calls.append(("record", step.metrics["step"], threading.current_thread().name))

    def taken(step: int, version: int) -> StepRecord:
        metrics = {"step": step, "train_batch": 0, "position": step, "loss": 0.0, "rows": 1, "abs_logp_diff": 0.0,
                   "step_time_s": 0.1}
        return StepRecord(metrics=metrics, version=version, plan_wait_s=0.0, t_end=0.0)

    with StoreReader([s.location for s in servers]) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as weights:
        def released() -> int:
            return sum(node.groups.released for node in client.stats().values())

        writer.put_group(make_group("g1"))
        recording = Recording(client, weights)
        publisher = Publisher(recording, recording, record)
        publisher.submit(table, ["g1"], taken(0, 1), time.perf_counter())  # returns at once: nothing published yet
        assert client.get_version() < 1 and calls == [] and released() == 0
        gate.set()
        publisher.drain()
        assert [(what, arg) for what, arg, _ in calls] == [("weights", 1), ("version", 1), ("record", 0),
                                                            ("release", ["g1"])]
        assert all(thread.startswith("knit-publish") for _, _, thread in calls)
        assert recorded[0].publish_done_s >= recorded[0].publish_s >= 0  # type: ignore[operator]
        line = recorded[0].to_line()  # the rank report's line carries both times
        assert (line.publish_s, line.publish_done_s) == (recorded[0].publish_s, recorded[0].publish_done_s)
        assert client.get_version() == 1 and released() == 1
        assert all(writer.get_weights(node=s.location).num_rows == 1 for s in servers)

        publisher.submit(table, [], taken(1, 2), time.perf_counter())
        publisher.submit(None, [], taken(2, 3), time.perf_counter())  # after v2 is published
        publisher.drain()
        assert [(what, arg) for what, arg, _ in calls[4:]] == [  # v3: the version alone
            ("weights", 2), ("version", 2), ("record", 1), ("release", []), ("version", 3), ("record", 2),
            ("release", [])]
        publisher.submit(table, [], taken(3, 4), time.perf_counter())
        with pytest.raises(RuntimeError, match="node gone while storing v4"):
            publisher.drain()
        assert client.get_version() == 3 and calls[-1][:2] == ("release", [])  # nothing published, nor recorded
        publisher.close()


def test_plan_source_scans_metadata_and_plans(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter
    from train.planning import PlanSource

    servers = store_nodes(2)
    with StoreReader([s.location for s in servers]) as client, StoreWriter.sharing(client) as writer:
        planner = Planner(AdmissionConfig(train_batch_groups=4, group_size=4, mini_batches=2, dp_ranks=2))
        source = PlanSource(client, planner)
        assert source.poll(0) == []
        for gid in "abcd":
            writer.put_group(make_group(gid))
        plans = source.wait(0, idle_timeout_s=5, poll_interval_s=0.01)
        plans += source.wait(0, idle_timeout_s=0.2, poll_interval_s=0.01)
        assert sorted(g for p in plans for g in p.group_ids) == ["a", "b", "c", "d"]
        assert [p.step for p in plans] == [0, 1]
        for p in plans:
            assert {r.dp_rank for r in p.ranks} == {0, 1}
        assert source.poll(0) == []  # admitted groups are not planned twice
        assert source.pending_rows == 0 and source.admitted_groups == 4
        assert source.planner.state.admitted == frozenset()  # their rows are gone, so are their ids


def test_plan_source_keeps_only_rows_of_pending_groups(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter
    from train.planning import PlanSource

    (server,) = store_nodes(1)
    with StoreReader([server.location]) as client, StoreWriter.sharing(client) as writer:
        source = PlanSource(client, Planner(AdmissionConfig(train_batch_groups=1, group_size=4)))
        writer.put_group(make_group("short", size=2))  # 2 rows for G=4: a whole group of the wrong size
        writer.put_group(make_group("lost", status="aborted"))  # dropped
        assert source.poll(0) == []
        assert source.dropped == {"size": 1, "aborted": 1}
        assert source.pending_rows == 0 and source.planner.state.dropped == frozenset()  # rows and ids gone
        writer.put_group(make_group("whole"))
        plans = source.poll(0)
        assert [g for p in plans for g in p.group_ids] == ["whole"]
        assert source.pending_rows == 0


def test_dp_ranks_come_from_the_process_group() -> None:
    from train.planning import with_dp_ranks

    assert with_dp_ranks(ADMISSION, 2).dp_ranks == 2
    assert with_dp_ranks(AdmissionConfig(train_batch_groups=4, group_size=4, dp_ranks=2), 2).dp_ranks == 2
    with pytest.raises(ValueError, match=r"dp_ranks=2 differs from the data-parallel size 4"):
        with_dp_ranks(AdmissionConfig(train_batch_groups=4, group_size=4, dp_ranks=2), 4)


def test_config_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="num_query_groups=3"):
        ModelConfig(num_attention_heads=4, num_query_groups=3)
    with pytest.raises(ValueError, match="stores is empty"):
        TrainConfig(stores=[], admission=ADMISSION)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="pack must be"):
        TrainConfig(stores=["grpc://x:1"], admission=ADMISSION, pack="ragged")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"does not support \['publish_weights'\]"):
        TrainConfig(stores=["grpc://x:1"], admission=ADMISSION, vision=VisionConfig(), publish_weights=True)
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\), got 1\.5"):
        GrpoConfig(clip_low=1.5)
    with pytest.raises(ValueError, match="eps must be finite and >= 0, got -1"):
        GrpoConfig(eps=-1)


def test_train_config_round_trips_as_a_document(tmp_path: Path) -> None:
    cfg = TrainConfig(
        stores=["grpc://a:1", "grpc://b:2"], model=ModelConfig.preset("tiny-vllm"), vision=VisionConfig(dedup=False),
        admission=AdmissionConfig(
            train_batch_groups=4, group_size=2, mini_batches=2, grpo=GrpoConfig(clip_high=0.28, normalize_std=False),
            quotas=(Quota(column="data_source", counts={"math": 2, "chat": 2}),
                    Quota(column="level", shares={"easy": 0.5, "hard": 0.5}))),
        pack="thd", report_path=str(tmp_path / "rank{rank}.json"))
    back = documents.read(TrainConfig, documents.write(cfg, tmp_path / "train.json"))
    assert back == cfg
    assert back.admission.quotas[1].shares == {"easy": 0.5, "hard": 0.5} and back.vision == VisionConfig(dedup=False)
    doc = json.loads(documents.dump(cfg))
    doc["admission"]["grpo"]["clip_hi"] = 0.3
    with pytest.raises(documents.ConfigDocumentError, match=r"admission\.grpo\.clip_hi"):
        documents.load(TrainConfig, json.dumps(doc))


def test_python_m_train_rejects_a_bad_document_before_starting(tmp_path: Path) -> None:
    doc = json.loads(documents.dump(TrainConfig(stores=["grpc://a:1"], admission=ADMISSION)))
    doc["max_steps"] = "5"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "-m", "train", "--config", str(tmp_path / "bad.json")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "max_steps" in proc.stderr, proc.stderr


def _record_rank(out: str) -> None:
    """A rank of :func:`test_run_ranks_spawns_ranks_with_the_torch_env` (module level: spawn pickles it)."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps({k: os.environ[k] for k in keys}))


def _fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        msg = "rank 1 failed"
        raise RuntimeError(msg)


def test_run_ranks_spawns_ranks_with_the_torch_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from train.launch import run_ranks

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run_ranks(_record_rank, str(tmp_path), nproc=2)
    envs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2", "2"), ("1", "1", "2", "2")]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and len({e["MASTER_PORT"] for e in envs}) == 1
    with pytest.raises(Exception, match="rank 1 failed"):
        run_ranks(_fail_on_rank_one, nproc=2)
    with pytest.raises(ValueError, match="nproc must be >= 1, got 0"):
        run_ranks(_record_rank, str(tmp_path), nproc=0)


def test_run_ranks_under_torchrun_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    from train.launch import run_ranks

    calls: list[tuple[int, str]] = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    run_ranks(lambda a, b: calls.append((a, b)), 1, "x", nproc=0)  # nproc is not used: this process is one rank
    assert calls == [(1, "x")]


def test_train_package_imports_without_torch() -> None:
    code = ("import sys, train, train.__main__, train.launch, train.loop, train.trainer, train.mm_trainer, "
            "train.backbone, train.planning, train.hf_llama, train.model, train.mcore_compat; "
            "assert 'torch' not in sys.modules and 'megatron' not in sys.modules and 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_bench_baseline_builds_verl_dataproto_layout() -> None:
    torch = pytest.importorskip("torch")
    from bench.cluster.workload import dataproto_shards, serialize

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


def test_sigterm_to_the_rank_launcher_stops_its_local_ranks() -> None:
    """``knit train --nproc N`` killed by pid (SIGTERM) must not leave its spawned ranks running."""
    import signal

    psutil = pytest.importorskip("psutil")
    from launcher.children import child_env

    code = "import time; from train.launch import run_ranks; run_ranks(time.sleep, 600, nproc=2)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=child_env())
    ranks: list[Any] = []
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while len(ranks := [c for c in parent.children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks still running after the launcher was terminated: {alive}"
    finally:  # whatever happened, nothing this test started outlives it
        for p in [*ranks, psutil.Process(proc.pid)] if proc.poll() is None else ranks:
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.wait(timeout=30)
