"""Experiment tracking (``train.tracking``, ``train.trackers``, ``train.step_tracking``): each tracker read back.

TensorBoard's event files are read with its event accumulator, MLflow's file store with ``MlflowClient``, the W&B
offline run from its ``.wandb`` file (a LevelDB-style log of protobuf records, read here with W&B's own record
type). A tracker that fails warns once and the others go on. The slow test runs ``knit run --quick --logger
tensorboard,mlflow,wandb --engine vllm-server`` (the rollout on the run's own vLLM server) and reads all three back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from train.tracking import BACKENDS, Tracking, TrackingConfig

ROOT = Path(__file__).resolve().parents[1]


# ---- reading each tracker back -----------------------------------------------------------------------------------


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value)]`` of every event file under ``folder`` (TensorBoard's event accumulator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    out: dict[str, list[tuple[int, float]]] = {}
    for logdir in sorted({p.parent for p in folder.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            out.setdefault(tag, []).extend((e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                                           for e in acc.Tensors(tag))
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def mlflow_metrics(store: Path, experiment: str = "knittrans") -> dict[str, list[tuple[int, float]]]:
    """``name -> [(step, value)]`` of the one run of ``experiment`` in the file store ``store`` (``MlflowClient``)."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when allowed
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r} in {store}"
    (run,) = client.search_runs([found.experiment_id])
    return {name: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
            for name in run.data.metrics}


def wandb_history(folder: Path) -> list[dict[str, float]]:
    """The ``history`` records (one per logged step) of the W&B offline run under ``folder``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.rglob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B run file"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            pos += block - pos % block if pos % block else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # full / first, then middle / last
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


# ---- the config --------------------------------------------------------------------------------------------------


def test_an_unknown_tracker_is_refused_naming_it_and_the_ones_there_are() -> None:
    with pytest.raises(ValueError, match=r"'neptune' is not a tracker; choose among console, tensorboard"):
        TrackingConfig(logger=["console", "neptune"])
    assert TrackingConfig().logger == ["console"]


def test_knit_run_and_knit_train_take_logger_as_a_flag(tmp_path: Path) -> None:
    from launcher.main_job import parse
    from launcher.run_config import train_config
    from train.config import ModelConfig

    (cfg,), _ = parse(["--out", str(tmp_path / "run"), "--logger", "tensorboard,wandb", "--project", "p"])
    assert cfg.tracking.logger == ["tensorboard", "wandb"] and cfg.tracking.project == "p"
    train = train_config(cfg, ModelConfig(), ["grpc://127.0.0.1:1"])
    assert train.tracking.logger == ["tensorboard", "wandb"]
    assert train.tracking.tracking_dir == str(cfg.out)  # the run folder
    with pytest.raises(SystemExit):
        parse(["--out", str(tmp_path / "run"), "--logger", "console,neptune"])

    from launcher.cli import _parse_config
    from train.config import TrainConfig

    argv = ["--stores", "grpc://127.0.0.1:1", "--train-batch-groups", "2", "--group-size", "2", "--logger", "mlflow",
            "--tracking-uri", "x:"]
    config, _ = _parse_config("knit train", "", TrainConfig, argv)
    assert config.tracking.logger == ["mlflow"] and config.tracking.tracking_uri == "x:"


# ---- each tracker, written and read back -------------------------------------------------------------------------


def _log_three_steps(config: TrackingConfig, folder: Path) -> None:
    with Tracking(config, folder=folder, params={"admission": {"train_batch_groups": 8}}, name="t") as tracking:
        assert tracking.active == config.logger
        for step in range(3):
            tracking.log({"loss": 1.0 / (step + 1), "reward_mean/math": 0.1 * step, "skipped": float("nan"),
                          "also_skipped": None}, step)


def test_tensorboard_events_are_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _log_three_steps(TrackingConfig(logger=["tensorboard"]), tmp_path)
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"loss", "reward_mean/math"}
    assert scalars["loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert [s for s, _ in scalars["reward_mean/math"]] == [0, 1, 2]


def test_mlflow_file_store_is_read_back_with_its_client(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    _log_three_steps(TrackingConfig(logger=["mlflow"]), tmp_path)
    metrics = mlflow_metrics(tmp_path / "mlruns")
    assert set(metrics) == {"loss", "reward_mean/math"}
    assert metrics["loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("knittrans").experiment_id])
    assert run.data.params["admission.train_batch_groups"] == "8" and run.info.run_name == "t"
    assert run.info.status == "FINISHED"


def test_wandb_runs_offline_without_a_key_and_its_run_file_is_read_back(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _log_three_steps(TrackingConfig(logger=["wandb"]), tmp_path)
    history = wandb_history(tmp_path / "wandb")
    assert [h["_step"] for h in history] == [0, 1, 2]
    assert [h["loss"] for h in history] == [1.0, 0.5, pytest.approx(1 / 3)]
    assert all("skipped" not in h for h in history)


def test_a_tracker_that_cannot_start_warns_and_the_others_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("tensorboard")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    caplog.set_level(logging.WARNING, logger="train.tracking")
    with Tracking(TrackingConfig(logger=["console", "tensorboard"]), folder=blocker) as tracking:
        assert tracking.active == ["console"]
        tracking.log({"loss": 1.0}, 0)
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "tracker tensorboard could not start" in warning.getMessage()


def test_a_tracker_that_fails_mid_run_warns_once_and_the_run_goes_on(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    caplog.set_level(logging.WARNING, logger="train.tracking")
    with Tracking(TrackingConfig(logger=["mlflow", "tensorboard"]), folder=tmp_path) as tracking:
        tracking.log({"loss": 1.0}, 0)
        mlflow = tracking._backends["mlflow"]
        mlflow.client.delete_run(mlflow.run_id)  # type: ignore[attr-defined]  # a deleted run takes no metric
        for step in (1, 2, 3):
            tracking.log({"loss": 1.0 / (step + 1)}, step)
        assert tracking.active == ["tensorboard"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tracker mlflow failed at step 1" in warnings[0], warnings
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard")["loss"]] == [0, 1, 2, 3]


def test_every_backend_name_is_one_a_run_can_open() -> None:
    from train.trackers import open_backend

    with pytest.raises(ValueError, match="'console' is not a tracker that writes files"):
        open_backend("console", folder=Path("."), name="x", project="p", tracking_uri=None, params={})
    assert BACKENDS == ("console", "tensorboard", "wandb", "mlflow")


# ---- what a step logs ----------------------------------------------------------------------------------------------


def _consumed(step: int) -> pl.DataFrame:
    return pl.DataFrame({"step": [step] * 4, "train_batch": [0] * 4, "group_id": ["a", "a", "b", "b"],
                         "data_source": ["math", "math", "code", "code"], "reward": [1.0, 0.0, 0.5, 0.5],
                         "response_len": [10, 20, 30, 40], "arch_staleness": [0, 0, 2, 2],
                         "signed_staleness": [0, 0, 2, 2], "generation_span": [1, 1, 0, 0],
                         "total_staleness": [1, 1, 2, 2]})


def test_a_step_logs_its_figures_under_the_summary_names(tmp_path: Path, store_nodes) -> None:  # type: ignore[no-untyped-def]
    from flight_store.reading import StoreReader
    from train.step_tracking import StepTracker

    (node,) = store_nodes(1)
    reader = StoreReader([node.location])
    stats = reader.stats()
    tracker = StepTracker(Tracking(TrackingConfig(logger=[]), folder=tmp_path), stats=reader.stats,
                          planner_s=lambda: 0.25, admitted=lambda: 2)
    tracker.on_close = reader.close
    tracker.observe(_consumed(0))
    record = {"step": 0, "loss": 0.5, "rows": 4, "version": 1, "plan_wait_s": 3.0, "t_end": 100.0,
              "step_time_s": 2.0, "exposed_wait_s": [0.5, 0.25], "fetch_s": [0.01, 0.03], "publish_s": 0.1,
              "is_weight_mean": 1.01, "token_staleness_mean": 0.5, "token_staleness_max": None}
    first = tracker.figures(record, planner_s=0.25, admitted=2)
    assert first["reward_mean_by_source/math"] == 0.5 and first["reward_mean_by_source/code"] == 0.5
    assert first["reward_std_by_source/math"] == pytest.approx(0.7071, abs=1e-4)
    assert first["reward_std_by_source/code"] == 0.0
    assert first["arch_staleness_mean"] == 1.0 and first["arch_staleness_max"] == 2
    assert first["generation_span_mean"] == 0.5 and first["offpolicy/token_staleness_mean"] == 0.5
    assert "offpolicy/token_staleness_max" not in first and first["offpolicy/is_weight_mean"] == 1.01
    assert first["step_s/step"] == 2.0 and first["step_s/compute"] == 1.25 and first["exposed_wait_s/0"] == 0.75
    assert first["step_s/publish_blocking"] == 0.1 and first["transfer_latency_ms/mean"] == pytest.approx(20.0)
    assert "trainer_idle_s" not in first  # the first step waits for start-up
    assert first["throughput/trajectories_per_s"] == 2.0 and first["throughput/tokens_per_s"] == 50.0
    assert first["planner_s"] == 0.25 and first["admitted_groups"] == 2 and first["loss"] == 0.5
    (node_stats,) = stats.values()
    name = node_stats.node  # the node's own name
    assert first[f"store/{name}/memory_used"] == node_stats.memory_used
    second = tracker.figures(record | {"step": 1, "t_end": 102.0}, planner_s=0.5)
    assert second["trainer_idle_s"] == 3.0 and second["planner_s"] == 0.25
    assert "reward_mean" not in second  # no consumed rows were seen for step 1
    assert second["throughput/trajectories_per_s"] == 1.0  # 4 trajectories over the 4 s window
    assert second[f"store/{name}/rows_stored_per_s"] == 0.0  # nothing was stored
    tracker.close()


# ---- knit run, end to end ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.vllm
def test_knit_run_quick_on_a_vllm_server_writes_tensorboard_mlflow_and_wandb(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``knit run --engine vllm-server --logger ...``: the run's own vLLM server takes every version through vLLM's
    weight-transfer API (the first step's logprobs are the trainer's), and each step reaches every tracker."""
    for module in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(module)
    from launcher.children import child_env
    from launcher.model import prepare_model

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model_dir = tmp_path / "tiny-llama"
    prepare_model(model_dir)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "launcher", "run", "--model", "tiny", "--quick", "--plain", "--out", str(out),
           "--model-dir", str(model_dir), "--train-batch-groups", "4", "--group-size", "4", "--mini-batches", "2",
           "--train-batches", "2", "--max-tokens", "24", "--timeout-s", "300",
           "--logger", "console,tensorboard,mlflow,wandb", "--engine", "vllm-server"]
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=400, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())["policies"]["mini_batch"]
    steps = summary["steps"]
    assert summary["abs_logp_diff_first_step"] < 1e-4  # the server runs the trainer's version 0, loaded via its API
    rollout = json.loads((out / "rollout.json").read_text())
    assert rollout["engine"] == "vllm-server" and rollout["weight_load_failures"] == 0
    assert rollout["weight_loads"] >= 1 and rollout["weight_loaded_at"][0][0] == 0
    assert rollout["groups"] == 8 and rollout["aborted_groups"] == 0
    children = json.loads((out / "logs" / "children.json").read_text())
    assert "engine" in [c["name"] for c in children]  # the run's own server, a process of the run ...
    for c in children:  # ... stopped with the rest
        with contextlib.suppress(OSError):
            assert Path(f"/proc/{c['pid']}/stat").read_text().split()[2] == "Z", f"{c['name']} still runs"
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "tracker" not in trainer_log, trainer_log[-3000:]  # no tracker warned

    names = ("reward_mean", "arch_staleness_mean", "offpolicy/token_staleness_mean", "throughput/trajectories_per_s",
             "step_s/step", "exposed_wait_s/0", "planner_s", "store/node0/memory_used", "store/node1/bytes_in_per_s")
    scalars = tensorboard_scalars(out / "tensorboard")
    metrics = mlflow_metrics(out / "mlruns")
    history = wandb_history(out / "wandb")
    for name in names:
        assert len(scalars[name]) == steps, (name, sorted(scalars))
        assert len(metrics[name]) == steps, (name, sorted(metrics))
        assert sum(name in h for h in history) == steps, name
    assert any(k.startswith("reward_mean_by_source/") for k in scalars)  # per data source
    assert [s for s, _ in scalars["loss"]] == list(range(steps)) == [h["_step"] for h in history]
    assert "step 0: " in trainer_log  # the console tracker's line
    assert f"tensorboard, mlflow, wandb: each step's figures in {out}" in res.stdout
