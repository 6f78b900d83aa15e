"""``knit run`` parts that need no engine: config and lookahead defaults, shape check, reward, process
groups, the report and plots from a synthetic run folder, and the ``knit`` registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from flight_store import cli
from train.config import ModelConfig
from train.report import policy_summary, table_rows, write_summary
from train.run import (
    Children,
    RunConfig,
    build_parser,
    check_shapes,
    default_lookahead,
    digit_reward,
    trainer_cmd,
    trainer_model,
)
from train.weights import hf_llama_config


def test_lookahead_defaults_per_policy() -> None:
    assert default_lookahead("train_batch", 8, 2) == 16  # one whole train batch ahead
    assert default_lookahead("mini_batch", 8, 2) == 12  # B + B/K
    assert default_lookahead("mini_batch", 8, 4) == 10
    assert RunConfig(policy="train_batch").lookahead_groups == 16
    assert RunConfig(policy="mini_batch", lookahead=9).lookahead_groups == 9
    with pytest.raises(ValueError, match="colocated"):
        default_lookahead("colocated", 8, 2)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"policy": "fifo"}, "fifo"),
    ({"groups": 6, "mini_batches": 4}, "groups=6"),
    ({"groups": 4, "mini_batches": 4, "dp": 2}, "dp=2"),
    ({"train_batches": 0}, "train_batches=0"),
    ({"lookahead": 1}, "lookahead=1"),
])
def test_run_config_refuses_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig(**kwargs)


def test_trainer_command_carries_the_geometry(tmp_path: Path) -> None:
    cfg = RunConfig(policy="train_batch", train_batches=3, out=tmp_path)
    cmd = trainer_cmd(cfg, trainer_model(300), ["grpc://a:1", "grpc://b:2"])
    assert cmd[cmd.index("--max-steps") + 1] == "6"
    assert cmd[cmd.index("--vocab-size") + 1] == "300"
    assert "policy=train_batch" in cmd and "train_batch_groups=8" in cmd and "--publish-weights" in cmd


def test_shape_check_names_every_mismatch() -> None:
    model = trainer_model(400)
    hf = hf_llama_config(model)
    check_shapes(hf, model)  # equal: no error
    bad = dict(hf, hidden_size=64, num_key_value_heads=4)
    with pytest.raises(ValueError, match="hidden_size") as exc:
        check_shapes(bad, model)
    assert "num_key_value_heads" in str(exc.value)
    with pytest.raises(ValueError, match="vocab_size"):
        check_shapes(hf, trainer_model(401))
    assert model.head_dim >= 32  # vLLM's CPU attention refuses head_dim 16
    assert ModelConfig.preset("tiny").hidden_size == 64  # the unit-test preset is unchanged


def test_digit_reward_varies_within_a_group() -> None:
    assert digit_reward("", "12 34", {}) == 1.0
    assert digit_reward("", "ab", {}) == 0.0
    assert digit_reward("", "a1", {}) == 0.5
    assert digit_reward("", "   ", {}) == 0.0


def test_children_stop_their_whole_process_group(tmp_path: Path) -> None:
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            "print(p.pid, flush=True); time.sleep(60)")
    kids = Children(tmp_path / "logs")
    child = kids.start("sleeper", [sys.executable, "-c", code])
    log = tmp_path / "logs" / "sleeper.log"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not log.read_text().strip():
        time.sleep(0.1)
    grandchild = int(log.read_text().split()[0])
    assert os.getpgid(grandchild) == child.pid  # the grandchild is in the child's group
    kids.stop_all()
    assert not child.alive()
    time.sleep(0.2)
    try:  # gone, or a zombie waiting for its new parent to reap it
        state = Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z")
    assert json.loads((tmp_path / "logs" / "children.json").read_text())[0]["pid"] == child.pid


def _fake_run(folder: Path, arch: list[int], rewards: list[float]) -> None:
    """A run folder as the trainer writes it: 2 ranks, 2 steps, one micro-batch each."""
    folder.mkdir(parents=True)
    n = len(arch)
    consumed = pl.DataFrame({"group_id": [f"g{i // 2}" for i in range(n)], "sample_idx": [i % 2 for i in range(n)],
                             "step": [i * 2 // n for i in range(n)], "train_batch": [0] * n,
                             "response_len": [10] * n, "reward": rewards, "arch_staleness": arch,
                             "signed_staleness": arch})
    consumed.write_parquet(folder / "consumed.parquet")
    for rank in (0, 1):
        steps = [{"step": s, "version": s + 1, "loss": 0.1, "rows": n // 2, "abs_logp_diff": 1e-7,
                  "fetch_s": [0.01], "exposed_wait_s": [0.002], "bytes_fetched": 1000, "step_time_s": 0.5,
                  "publish_s": 0.05, "plan_wait_s": 1.0, "t_end": 100.0 + s} for s in (0, 1)]
        rows = [["row", i * 2 // n, f"g{i // 2}", i % 2] for i in range(n) if (i // 2) % 2 == rank]
        (folder / f"trainer_rank{rank}.json").write_text(json.dumps({"env": {"rank": rank}, "steps": steps,
                                                                     "consumed": rows}))


def test_report_from_a_run_folder(tmp_path: Path) -> None:
    _fake_run(tmp_path / "train_batch", [2, 2, 2, 2], [0.0, 1.0, 0.5, 0.5])
    _fake_run(tmp_path / "mini_batch", [0, 0, 1, 1], [0.0, 1.0, 0.5, 0.5])
    results = {}
    for name in ("train_batch", "mini_batch"):
        r = policy_summary(tmp_path / name, config={"policy": name}, wall_s=3.0)
        assert r["trajectories_consumed"] == 4 and r["rows_received"] == 4 and r["duplicate_rows"] == 0
        assert r["bytes_per_rank"] == {"0": 2000, "1": 2000}
        assert r["driver_payload_bytes"] == 0
        assert r["trainer_idle_s"] == 1.0  # step 0's wait is start-up
        assert r["training_window_s"] == pytest.approx(1.5)
        assert r["reward_per_train_batch"] == [0.5]
        assert len(table_rows(r)) > 10
        results[name] = r
    assert results["mini_batch"]["arch_staleness_mean"] == 0.5 and results["mini_batch"]["arch_staleness_max"] == 1
    doc = write_summary(tmp_path, results)
    assert doc["arch_staleness_reduction"] == 0.75
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["policies"]["train_batch"]["arch_staleness_mean"] == 2.0
    assert (tmp_path / "staleness_compare.png").stat().st_size > 1000

    from train.report import plot_policy

    paths = plot_policy(tmp_path / "mini_batch", results["mini_batch"])
    assert [p.name for p in paths] == ["staleness_per_step.png", "time_breakdown.png", "reward_per_train_batch.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_knit_run_is_registered_and_the_demo_kept() -> None:
    assert cli.LAZY_COMMANDS["run"][0] == "train.run:main"
    assert cli.LAZY_COMMANDS["demo"][0] == "flight_store.demo:main"
    args = build_parser().parse_args(["--quick", "--compare"])
    assert args.quick and args.compare


def test_run_driver_imports_neither_vllm_nor_torch() -> None:
    code = ("import sys, train.run, train.report, train.progress; "
            "print(sorted({'vllm', 'torch', 'megatron'} & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


# ---- the rollout options knit run relies on (scripted engine, real store) ------------------------


def _rollout_config(location: str, **kw: Any) -> Any:
    from connectors.rollout import RolloutConfig

    base: dict[str, Any] = {"model": "unused", "nodes": [location], "group_size": 2, "max_groups": 12,
                            "prompts_per_wave": 8, "version_poll_s": 0.0, "group_id_prefix": "u-",
                            "lookahead_poll_s": 0.01}
    base.update(kw)
    return RolloutConfig(**base)


def test_lookahead_counts_running_groups(store_nodes) -> None:  # type: ignore[no-untyped-def]
    import threading

    from connectors.fake_engine import FakeEngine
    from connectors.rollout import RolloutWorker
    from flight_store.client import StoreClient

    (server,) = store_nodes(1)
    with StoreClient(server.location) as client:
        engine = FakeEngine(max_steps=3)
        cfg = _rollout_config(server.location, max_unreleased_groups=3, lookahead_counts_running=True)
        worker = RolloutWorker(cfg, client=client, engine=engine)
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
        assert done.is_set() and len(released) == 12
        # running + stored-unreleased never exceeded the limit, although prompts_per_wave allows 8 at once
        assert engine.max_running <= 3


def test_rollout_waits_for_and_loads_the_initial_weights(store_nodes) -> None:  # type: ignore[no-untyped-def]
    import threading

    import pyarrow as pa

    from connectors.fake_engine import FakeEngine
    from connectors.rollout import RolloutWorker
    from connectors.weights import WEIGHTS_SCHEMA
    from flight_store.client import StoreClient

    (server,) = store_nodes(1)
    table = pa.table({"name": ["w"], "shape": [[1]], "dtype": ["float32"], "data": [b"\0\0\0\0"]},
                     schema=WEIGHTS_SCHEMA)
    with StoreClient(server.location) as client:
        engine = FakeEngine(max_steps=2)
        cfg = _rollout_config(server.location, max_groups=2, weight_sync=True, wait_initial_weights_s=20.0)
        timer = threading.Timer(0.5, lambda: client.put_weights(table, 0))  # the trainer publishes v0 later
        timer.start()
        t0 = time.monotonic()
        report = RolloutWorker(cfg, client=client, engine=engine).run()
        timer.join()
        assert time.monotonic() - t0 >= 0.5  # it waited for the weights before generating
        assert len(engine.loaded) == 1 and engine.loaded[0].column("name").to_pylist() == ["w"]
        assert report.groups == 2 and report.policy_versions == [0]
        cfg = _rollout_config(server.location, max_groups=1, weight_sync=True, wait_initial_weights_s=0.3,
                              initial_version=5)
        with pytest.raises(TimeoutError, match="version 5"):
            RolloutWorker(cfg, client=client, engine=FakeEngine()).run()
