"""The rollout worker against real store servers: with the scripted engine (fast) and with real vLLM (slow).

The real-engine tests run vLLM in subprocesses: ``python -m connectors --config FILE`` (exact round
trip of token ids and logprobs, and streaming to two nodes while generation runs), and this file run as
a script (``__main__``: weight sync into the running engine, checked against a transformers forward; then, on the
same engine, partial rollouts interrupted by new weights and resumed from their prefix).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from connectors.fake_engine import FakeEngine
from connectors.lookahead import LookaheadLimit, StoreStats, unreleased_groups
from connectors.rollout import RolloutConfig, RolloutWorker, run_rollout
from connectors.tasks import Prompt
from flight_store.publishing import StorePublisher
from flight_store.reading import StoreReader
from flight_store.store import Store
from flight_store.writing import StoreWriter
from launcher.children import CHILD_ENV, child_env
from schemas import documents
from schemas.images import image_key, table_to_images
from schemas.plan import PlannedSlice
from schemas.replies import GroupCounts
from schemas.weights import WEIGHTS_SCHEMA

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ENV = CHILD_ENV


def _env() -> dict[str, str]:
    return child_env()


def _config(nodes: list[str], **kw: Any) -> RolloutConfig:
    base: dict[str, Any] = {"model": "unused", "stores": nodes, "group_size": 4, "max_groups": 16,
                            "prompts_per_wave": 4, "version_poll_s": 0.0, "group_id_prefix": "t-"}
    base.update(kw)
    return RolloutConfig(**base)


def _all_rows(client: StoreReader, frame: pl.DataFrame, columns: list[str]) -> pa.Table:
    groups = frame.group_by(["node", "group_id"]).agg(pl.len().alias("n")).sort("group_id")
    slices = [PlannedSlice(node=n, group_id=g, start=0, stop=k) for n, g, k in groups.iter_rows()]
    return client.fetch(slices, columns=columns)


# ---- scripted engine, real stores ---------------------------------------------------------------


@pytest.mark.parametrize("async_writes", [False, True])
def test_worker_streams_scored_groups_to_two_nodes(store_nodes, async_writes: bool) -> None:  # type: ignore[no-untyped-def]
    servers = store_nodes(2)
    nodes = [s.location for s in servers]
    with StoreReader(nodes) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        publisher.publish_version(3)
        engine = FakeEngine(max_steps=5)
        seen_during_run: list[int] = []

        class Spy(RolloutWorker):
            def _write_group(self, batch: pa.RecordBatch, node: str, *, aborted: bool) -> None:
                super()._write_group(batch, node, aborted=aborted)
                if self.tally.groups == 8 and not async_writes:  # half-way: the store has what was written
                    seen_during_run.append(client.scan_metadata(columns=["group_id"])["group_id"].n_unique())

        with Spy(_config(nodes, async_writes=async_writes), client=writer, engine=engine) as worker:
            report = worker.run()
        assert report.groups == 16 and report.rows == 64 and report.aborted_groups == 0
        assert len(report.write_times) == 16 and report.write_times == sorted(report.write_times)
        assert seen_during_run == ([] if async_writes else [8])
        assert engine.max_running <= 4  # prompts_per_wave bounds what is in the engine
        frame = client.scan_metadata()
        assert frame.height == 64 and frame["group_id"].n_unique() == 16
        assert set(frame["node"].unique()) == set(nodes)  # groups hashed over both nodes
        assert set(frame["policy_version"].unique()) == {3}
        assert set(frame["data_source"].unique()) <= {"add_small", "mul_large"}
        # the fake answers correctly on even sample indices only
        assert frame.filter(pl.col("sample_idx") % 2 == 0)["reward"].to_list() == [1.0] * 32
        assert frame.filter(pl.col("sample_idx") % 2 == 1)["reward"].to_list() == [0.0] * 32
        table = _all_rows(client, frame, ["group_id", "sample_idx", "response_ids", "response_logprobs"])
        assert all(len(r) > 0 for r in table.column("response_ids").to_pylist())
        assert report.to_dict()["groups_per_s"] > 0


def test_refused_and_unfinished_groups_are_written_as_aborted(store_nodes) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    prompts = iter([Prompt(data_source="s", text="ok 1", sample={"answer": "1"}),
                    Prompt(data_source="s", text="REFUSE me", sample={"answer": "1"}),
                    Prompt(data_source="s", text="ok 2", sample={"answer": "1"})])
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        engine = FakeEngine(max_steps=10**9, refuse="REFUSE")  # never finishes on its own
        cfg = _config([server.location], max_groups=3, max_seconds=0.3)
        report = RolloutWorker(cfg, client=writer, engine=engine, prompts=prompts).run()
        assert report.groups == 3 and report.aborted_groups == 3
        assert sorted(engine.aborted) == ["t-0", "t-2"]
        frame = client.scan_metadata().sort(["group_id", "sample_idx"])
        assert frame.height == 12
        assert set(frame["status"].unique()) == {"aborted"}
        reasons = frame.group_by("group_id").agg(pl.col("finish_reason").first()).sort("group_id")
        assert reasons["finish_reason"].to_list() == ["abort", "error", "abort"]


def test_lookahead_limit_pauses_dispatch_until_groups_are_released(store_nodes) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        cfg = _config([server.location], max_groups=12, prompts_per_wave=2, max_unreleased_groups=6,
                      lookahead_poll_s=0.01)
        worker = RolloutWorker(cfg, client=writer, engine=FakeEngine(max_steps=2))
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.setdefault("report", worker.run()), daemon=True)
        thread.start()
        stalled_at = None
        for _ in range(100):
            time.sleep(0.05)
            n = int(client.stats()[server.location].groups.stored)
            if n >= 6 and stalled_at == n:
                break
            stalled_at = n
        assert thread.is_alive(), "the worker should be paused by the lookahead limit"
        assert stalled_at is not None and 6 <= stalled_at < 12
        client.release(client.scan_metadata(columns=["group_id"])["group_id"].unique().to_list())
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert result["report"].groups == 12
    one = Store().stats().model_copy(update={"groups": GroupCounts(stored=1, released=3, inflight=0)})
    stats = {"a": one, "b": one}
    assert unreleased_groups(stats) == 2
    assert not LookaheadLimit(lambda: stats, limit=2, poll_s=0.0).allows(running=0)
    assert LookaheadLimit(lambda: stats, limit=3, poll_s=0.0).allows(running=0)
    # counting running groups: 2 stored + 1 running reach a limit of 3
    assert not LookaheadLimit(lambda: stats, limit=3, counts_running=True, poll_s=0.0).allows(running=1)
    assert LookaheadLimit(lambda: stats, limit=3, poll_s=0.0).allows(running=1)


def test_custom_lookahead_hook_pauses_dispatch(store_nodes) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    seen: list[int] = []

    def hook(stats: StoreStats) -> bool:
        seen.append(unreleased_groups(stats))
        return unreleased_groups(stats) >= 4

    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        cfg = _config([server.location], max_groups=8, prompts_per_wave=1, lookahead_poll_s=0.0)
        worker = RolloutWorker(cfg, client=writer, engine=FakeEngine(max_steps=1), lookahead=hook)
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.setdefault("report", worker.run()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and seen.count(4) < 3:  # checked again and again at 4: paused
            time.sleep(0.02)
        assert thread.is_alive(), "the hook should pause dispatch"
        assert int(client.stats()[server.location].groups.stored) == 4
        client.release(client.scan_metadata(columns=["group_id"])["group_id"].unique().to_list())
        thread.join(timeout=10)
        assert not thread.is_alive() and result["report"].groups == 8


def test_lookahead_counts_running_groups(store_nodes) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        engine = FakeEngine(max_steps=3)
        cfg = _config([server.location], group_size=2, max_groups=12, prompts_per_wave=8, lookahead_poll_s=0.01,
                      max_unreleased_groups=3, lookahead_counts_running=True)
        worker = RolloutWorker(cfg, client=writer, engine=engine)
        done = threading.Event()
        thread = threading.Thread(target=lambda: (worker.run(), done.set()), daemon=True)
        thread.start()
        released: set[str] = set()
        deadline = time.monotonic() + 20
        while not done.is_set() and time.monotonic() < deadline:  # a trainer that consumes slowly
            time.sleep(0.05)
            ids = set(client.scan_metadata(columns=["group_id"])["group_id"].unique().to_list()) - released
            if ids:
                client.release(ids)
                released |= ids
        thread.join(timeout=5)
        assert done.is_set()
        # the last groups may land after the last poll, once the worker no longer waits for releases
        stored = set(client.scan_metadata(columns=["group_id"])["group_id"].unique().to_list())
        assert len(released | stored) == 12
        # running + stored-unreleased never exceeded the limit, although prompts_per_wave allows 8 at once
        assert engine.max_running <= 3


def test_rollout_waits_for_and_loads_the_initial_weights(store_nodes) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    table = pa.table({"name": ["w"], "shape": [[1]], "dtype": ["float32"], "data": [b"\0\0\0\0"]},
                     schema=WEIGHTS_SCHEMA)
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        engine = FakeEngine(max_steps=2)
        cfg = _config([server.location], max_groups=2, weight_sync=True, wait_initial_weights_s=20.0)
        timer = threading.Timer(0.5, lambda: publisher.put_weights(table, 0))  # the trainer publishes v0 later
        timer.start()
        report = RolloutWorker(cfg, client=writer, engine=engine).run()
        timer.join()
        # it waited for the weights before generating: it loaded the v0 published after it started
        assert len(engine.loaded) == 1 and engine.loaded[0].column("name").to_pylist() == ["w"]
        assert report.groups == 2 and report.policy_versions == [0]
        cfg = _config([server.location], max_groups=1, weight_sync=True, wait_initial_weights_s=0.3,
                      initial_version=5)
        with pytest.raises(TimeoutError, match="version 5"):
            RolloutWorker(cfg, client=writer, engine=FakeEngine()).run()


def test_images_are_stored_once_and_referenced_by_every_row(store_nodes) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 255, (3, 16, 16), dtype=np.uint8)
    own = [rng.random((3, 8, 8), dtype=np.float32) for _ in range(3)]
    prompts = [Prompt(data_source="mm", text=f"describe {i}", sample={"answer": "0"},
                      images=(shared, own[i], shared)) for i in range(3)]
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        report = RolloutWorker(_config([server.location], max_groups=3), client=writer, engine=FakeEngine(),
                               prompts=iter(prompts)).run()
        assert report.groups == 3
        assert report.images_written == 6  # 2 distinct per prompt, dedup inside the prompt
        stats = client.stats()[server.location]
        assert stats.images == 4  # the shared image once across prompts
        frame = client.scan_metadata()
        assert set(frame["num_images"].to_list()) == {3}
        table = _all_rows(client, frame, ["group_id", "image_keys"])
        text_of = {f"t-{i}": i for i in range(3)}
        for gid, keys in zip(table.column("group_id").to_pylist(), table.column("image_keys").to_pylist(),
                             strict=True):
            i = text_of[gid]
            assert keys == [image_key(shared), image_key(own[i]), image_key(shared)]
        want = {image_key(shared): shared, **{image_key(a): a for a in own}}
        got = table_to_images(client.fetch_images(list(want)))
        assert set(got) == set(want)
        for k, a in want.items():
            np.testing.assert_array_equal(got[k], a)


def test_weight_sync_loads_published_weights_and_tags_versions(store_nodes) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    weights = pa.table({"name": ["lm_head.weight"], "shape": [[2]], "dtype": ["float32"],
                        "data": [np.float32([1, 2]).tobytes()]},
                       schema=pa.schema([("name", pa.string()), ("shape", pa.list_(pa.int32())),
                                         ("dtype", pa.string()), ("data", pa.large_binary())]))
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        publisher.put_weights(weights, 2)
        publisher.publish_version(2)
        engine = FakeEngine()
        report = RolloutWorker(_config([server.location], max_groups=4, weight_sync=True), client=writer,
                               engine=engine).run()
        assert len(engine.loaded) == 1 and engine.loaded[0].column("name").to_pylist() == ["lm_head.weight"]
        assert report.policy_versions == [2]


def test_config_refuses_bad_values_and_travels_as_a_document(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stores is empty"):
        RolloutConfig(model="m", stores=[])
    with pytest.raises(ValueError, match="group_size=0"):
        RolloutConfig(model="m", stores=["grpc://x:1"], group_size=0)
    with pytest.raises(ValueError, match="logprobs_mode"):
        RolloutConfig(model="m", stores=["grpc://x:1"], logprobs_mode="raw_logits")
    with pytest.raises(ValueError, match="reward='nope'"):
        RolloutConfig(model="m", stores=["grpc://x:1"], reward="nope")
    with pytest.raises(ValueError, match=r"unknown sources \['sub_small'\]"):
        RolloutConfig(model="m", stores=["grpc://x:1"], data_sources={"sub_small": 1.0})
    cfg = RolloutConfig(model="m", stores=["grpc://a:1", "grpc://b:2"], data_sources={"add_small": 3.0},
                        reward="digits")
    assert documents.read(RolloutConfig, documents.write(cfg, tmp_path / "rollout.json")) == cfg
    assert cfg.group_id_prefix == ""  # resolved to r<pid>- by the worker's process, not here


def _run_module(config_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "connectors", "--config", str(config_path)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)


def test_module_refuses_a_bad_document_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "rollout.json"
    path.write_text(json.dumps({"model": "m", "stores": ["grpc://127.0.0.1:1"], "group_size": 0}))
    res = _run_module(path)
    assert res.returncode != 0 and "group_size=0" in res.stderr, res.stderr
    path.write_text(json.dumps({"model": "m", "nodes": ["grpc://127.0.0.1:1"]}))
    res = _run_module(path)
    assert res.returncode != 0 and "unknown field(s) nodes" in res.stderr, res.stderr
    res = _run_module(tmp_path / "missing.json")
    assert res.returncode != 0 and "missing.json" in res.stderr, res.stderr


def test_run_rollout_writes_the_report_and_stops_cleanly_on_sigterm(store_nodes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    report_path = tmp_path / "report.json"
    cfg = _config([server.location], max_groups=6, reward="digits", report_path=str(report_path))
    report = run_rollout(cfg, engine=FakeEngine(answer_text="n {answer}"))
    doc = json.loads(report_path.read_text())
    assert doc["groups"] == report.groups == 6 and doc["aborted_groups"] == 0
    assert len(doc["write_times"]) == 6 and doc["tokens_per_s"] > 0
    assert doc["reward_mean"] and set(doc["reward_mean"]) <= {"add_small", "mul_large"}
    assert all(0 < r < 1 for r in doc["reward_mean"].values())  # "digits": partial credit

    # SIGTERM: no more dispatch, the running groups are written as "aborted", the handler is restored
    previous = signal.getsignal(signal.SIGTERM)
    engine = FakeEngine(max_steps=10**9)  # never finishes on its own
    cfg = _config([server.location], max_groups=3, group_id_prefix="s-", report_path=None)
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    report = run_rollout(cfg, engine=engine)
    timer.join()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert report.groups == 3 and report.aborted_groups == 3 and sorted(engine.aborted) == ["s-0", "s-1", "s-2"]
    with StoreReader(server.location) as client:
        frame = client.scan_metadata().filter(pl.col("group_id").str.starts_with("s-"))
        assert frame.height == 12 and set(frame["status"].unique()) == {"aborted"}


# ---- real vLLM ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "llama"
    code = f"from connectors.tiny_model import build_tiny_llama; build_tiny_llama({str(out)!r}, hidden=128, seed=0)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), check=True, timeout=120,
                   capture_output=True)
    return out


def _perturbed_weights(model_dir: Path) -> pa.Table:
    """The tiny model's tensors plus noise, as a weights table (numpy only, no torch in this process)."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(1)
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    arrays = [(tensors[k] + 0.05 * rng.standard_normal(tensors[k].shape)).astype(np.float32) for k in names]
    return pa.table({"name": names, "shape": [list(a.shape) for a in arrays], "dtype": ["float32"] * len(names),
                     "data": [a.tobytes() for a in arrays]},
                    schema=pa.schema([("name", pa.string()), ("shape", pa.list_(pa.int32())),
                                      ("dtype", pa.string()), ("data", pa.large_binary())]))


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_round_trip_is_exact_and_streams_to_two_nodes(store_nodes, tiny_model: Path,  # type: ignore[no-untyped-def]
                                                                  tmp_path: Path) -> None:
    servers = store_nodes(2)
    nodes = [s.location for s in servers]
    report_path, raw_path = tmp_path / "report.json", tmp_path / "raw.jsonl"
    groups = 64
    cfg = RolloutConfig(model=str(tiny_model), stores=nodes, max_groups=groups, group_size=4, max_tokens=32,
                        prompts_per_wave=8, group_id_prefix="v-", report_path=str(report_path),
                        dump_raw=str(raw_path), weight_sync=True, initial_version=7, version_poll_s=0.05)
    cmd = [sys.executable, "-m", "connectors", "--config", str(documents.write(cfg, tmp_path / "rollout.json"))]
    polls: list[tuple[float, int]] = []
    with StoreReader(nodes) as client, \
            StorePublisher.sharing(client) as publisher:
        publisher.publish_version(7)
        with subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as proc:
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
            reader.start()
            deadline = time.monotonic() + 300
            published = False
            while proc.poll() is None and time.monotonic() < deadline:
                n = client.scan_metadata(columns=["group_id"])["group_id"].n_unique()
                polls.append((time.time(), n))
                if n and not published:  # the trainer publishes new weights while the rollout runs
                    publisher.put_weights(_perturbed_weights(tiny_model), 8)
                    publisher.publish_version(8)
                    published = True
                time.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
            rc = proc.wait(timeout=30)
            reader.join(timeout=10)
        assert rc == 0, "".join(lines[-40:])
        report = json.loads(report_path.read_text())
        # stdout: the report's summary, without the per-group write times
        (summary,) = [json.loads(line) for line in lines if line.startswith('{"groups"')]
        assert "write_times" not in summary and summary["groups"] == report["groups"]

        # streaming: the planner-side scan saw groups while the worker was still generating
        assert report["groups"] == groups and report["aborted_groups"] == 0
        partial = [(t, n) for t, n in polls if 0 < n < groups and t < report["last_write_at"]]
        assert len({n for _, n in partial}) >= 2, f"no partial scans before the last write: {polls[-5:]}"
        assert report["write_times"] == sorted(report["write_times"])
        assert report["write_times"][0] < report["last_write_at"] - 0.05

        frame = client.scan_metadata()
        assert frame.height == groups * 4
        assert set(frame["node"].unique()) == set(nodes)
        # weights of version 8 reached the running engine: later groups carry it
        assert report["policy_versions"] == [7, 8]
        assert set(frame["policy_version"].unique()) == {7, 8}
        assert (frame["policy_version_min"] <= frame["policy_version"]).all()
        # once the engine runs version 8, no later group is tagged with the old version
        by_completion = frame.sort("completed_at")["policy_version"].to_list()
        assert by_completion == sorted(by_completion)
        assert set(frame["status"].unique()) == {"completed"}
        assert set(frame["data_source"].unique()) == {"add_small", "mul_large"}

        # exactness: what the store serves equals what vLLM returned, token for token, bit for bit
        table = _all_rows(client, frame, ["group_id", "sample_idx", "prompt_ids", "response_ids",
                                          "response_logprobs", "finish_reason"])
        stored = {(g, i): (p, r, lp, f) for g, i, p, r, lp, f in zip(*(table.column(c).to_pylist()
                  for c in table.column_names), strict=True)}
        raw = [json.loads(line) for line in raw_path.read_text().splitlines()]
        assert len(raw) == groups
        n_tokens = 0
        for doc in raw:
            for s in doc["samples"]:
                p, r, lp, f = stored[(doc["group_id"], s["index"])]
                assert p == doc["prompt_token_ids"]
                assert r == s["token_ids"] == s["flat_token_ids"]  # logprobs=0: one entry per position
                assert s["start_indices"] == list(range(len(r)))
                np.testing.assert_array_equal(np.float32(lp), np.float32(s["flat_logprobs"]))
                assert f == s["finish_reason"]
                n_tokens += len(r)
        assert n_tokens == report["response_tokens"] > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_weight_sync_matches_a_transformers_forward(store_nodes, tiny_model: Path,  # type: ignore[no-untyped-def]
                                                              tmp_path: Path) -> None:
    (server,) = store_nodes(1)
    out = tmp_path / "weights.json"
    res = subprocess.run([sys.executable, __file__, str(tiny_model), server.location, str(out)], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    # before: vLLM agrees with transformers on the original weights
    assert doc["before_vs_hf"] < 1e-4
    # after loading weights fetched from the store, vLLM agrees with transformers on the NEW weights ...
    assert doc["after_vs_hf_new"] < 1e-4
    # ... and no longer with the old ones
    assert doc["after_vs_hf_old"] > 1e-2
    assert doc["tensors_loaded"] == doc["tensors_in_model"]
    # partial rollouts: both greedy samples, interrupted mid-response by the new weights, resumed from their prefix
    partial = doc["partial"]
    assert partial["interrupted"] == 2
    for sample in partial["samples"]:
        n_old = sample["versions"].count(0)
        assert 0 < n_old < len(sample["versions"])
        assert sample["versions"] == [0] * n_old + [1] * (len(sample["versions"]) - n_old)
        assert sample["resumed"] == sample["uninterrupted"]  # the new weights' own greedy continuation
        assert sample["resumed"] != sample["old_weights"]  # not what the old weights would have said
    assert partial["stored_token_versions"] == [s["versions"] for s in partial["samples"]]


def _partial_rollouts(llm: Any, model: str, old: pa.Table, new: pa.Table) -> dict[str, Any]:
    """A greedy group of 2 run as partial rollouts on ``llm`` (weights ``old``, version 0), interrupted after a few
    tokens by ``new`` (version 1); each sample's versions, its resumed tokens, and what the new and the old
    weights generate greedily from its prefix."""
    from vllm import SamplingParams

    from connectors.engine import VllmEngine
    from connectors.engine_weights import load_weights_into_llm
    from connectors.vllm import group_to_batch
    from schemas.trajectory import normalize_group

    load_weights_into_llm(llm, old)
    cfg = RolloutConfig(model=model, stores=["grpc://127.0.0.1:1"], temperature=0.0, max_tokens=16, ignore_eos=True,
                        weight_sync=True, partial_rollouts=True, chat_template=False)
    engine = VllmEngine(cfg, llm=llm)
    assert engine.partial is not None

    def greedy(ids: list[int], n: int) -> list[int]:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return list(llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0].token_ids)

    engine.submit("g", Prompt(data_source="s", text="What is 3 + 4?"), 2)
    for _ in range(5):  # a few tokens under version 0
        assert engine.step() == []
    interrupted = len(engine.partial.running())
    engine.load_weights(new, 1)
    finished: list[Any] = []
    while not finished:
        finished = engine.step()
    (group,) = finished
    prompt, samples = list(group.prompt_token_ids), []
    for c, versions in zip(group.outputs, group.token_versions, strict=True):
        n_old = int((versions == 0).sum())
        samples.append({"versions": versions.tolist(), "resumed": list(c.token_ids[n_old:]),
                        "uninterrupted": greedy(prompt + list(c.token_ids[:n_old]), len(c.token_ids) - n_old)})
    load_weights_into_llm(llm, old)
    for s, c in zip(samples, group.outputs, strict=True):
        s["old_weights"] = greedy(prompt + list(c.token_ids[:s["versions"].count(0)]), len(s["resumed"]))
    batch = group_to_batch(group, group_id="g", policy_version=1, policy_version_min=0, data_source="s",
                           token_versions=group.token_versions)
    (stored,) = normalize_group([batch], "g", 2)
    return {"interrupted": interrupted, "samples": samples,
            "stored_token_versions": stored.column("token_versions").to_pylist()}


def _weights_driver(model: str, location: str, out: str) -> None:
    """Start vLLM on ``model``; perturb the weights in transformers; move them through the store; reload."""
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from connectors.engine_weights import WORKER_EXTENSION, load_weights_into_llm
    from schemas.weights import from_tensors

    llm = LLM(model=model, dtype="float32", max_model_len=256, seed=0, enforce_eager=True, max_num_seqs=8,
              distributed_executor_backend="uni", worker_extension_cls=WORKER_EXTENSION)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    old = {k: v.clone() for k, v in hf.state_dict().items()}
    prompt = "What is 3 + 4? Give only the final number. Answer:"
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, flat_logprobs=True)

    def vllm_run() -> tuple[list[int], list[int], list[float]]:
        o = llm.generate([prompt], sp, use_tqdm=False)[0]
        return list(o.prompt_token_ids), list(o.outputs[0].token_ids), list(o.outputs[0].logprobs.logprobs)

    def hf_logprobs(state: dict[str, Any], p: list[int], r: list[int]) -> np.ndarray:
        hf.load_state_dict(state)
        with torch.no_grad():
            logits = hf(torch.tensor([p + r])).logits[0]
        lp = torch.log_softmax(logits.double(), -1)
        return np.array([lp[len(p) - 1 + i, t].item() for i, t in enumerate(r)])

    p, r, lp = vllm_run()
    before = float(np.abs(hf_logprobs(old, p, r) - lp).max())
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter

    with StoreReader(location) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        publisher.put_weights(from_tensors(new.items(), torch), 1)
        publisher.publish_version(1)
        table = writer.get_weights(client.get_version())
    loaded = load_weights_into_llm(llm, table)
    p2, r2, lp2 = vllm_run()
    doc = {
        "before_vs_hf": before,
        "after_vs_hf_new": float(np.abs(hf_logprobs(new, p2, r2) - lp2).max()),
        "after_vs_hf_old": float(np.abs(hf_logprobs(old, p2, r2) - lp2).max()),
        "tensors_loaded": loaded,
        "tensors_in_model": len(old),
        "partial": _partial_rollouts(llm, model, from_tensors(old.items(), torch), table),
    }
    Path(out).write_text(json.dumps(doc))


def _main(argv: list[str]) -> None:
    _weights_driver(*argv)


if __name__ == "__main__":
    _main(sys.argv[1:])
