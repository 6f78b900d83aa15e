"""The trackers that write files: TensorBoard, Weights & Biases and MLflow, each behind ``log(data, step)``.

Each imports its package when opened (the ``track`` extra) and reaches no network unless told to:

* ``tensorboard``: event files in ``<folder>/tensorboard`` (``tensorboard --logdir`` the run folder, or the
  folder above several runs to see them side by side);
* ``wandb``: a run in ``<folder>/wandb``, offline unless an API key is set (``WANDB_API_KEY``; ``WANDB_MODE``
  decides when set), then ``wandb sync`` uploads it; W&B's system-metrics sampling and console capture off;
* ``mlflow``: a run in the file store ``<folder>/mlruns`` (``mlflow ui --backend-store-uri``), or at
  ``tracking_uri`` when given; MLflow's usage telemetry off.

The run's config goes in once: W&B's config, MLflow's params (flattened, ``a.b`` names).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

EXTRA = "track"
"""The optional dependencies of these trackers (``pip install knittrans[track]``)."""


class Backend(Protocol):
    """One tracker: opened (:func:`open_backend`), then figures per step, then closed."""

    def log(self, data: Mapping[str, float], step: int) -> None:
        """Record ``data`` (name -> value) at ``step``."""
        ...

    def close(self) -> None:
        """Write what is buffered and end the run in the tracker."""
        ...


def open_backend(kind: str, *, folder: Path, name: str, project: str, tracking_uri: str | None,
                 params: dict[str, Any]) -> Backend:
    """The tracker ``kind`` (tensorboard, wandb or mlflow) of a run called ``name`` writing under ``folder``, in
    ``project`` (W&B project, MLflow experiment); MLflow at ``tracking_uri`` (none: the file store in ``folder``).

    Raises:
        ImportError: its package is not installed (naming the ``track`` extra).
        ValueError: ``kind`` is not one of these trackers.
    """
    if kind == "tensorboard":
        return TensorBoardBackend(folder / "tensorboard")
    if kind == "wandb":
        return WandbBackend(folder, project=project, name=name, params=params)
    if kind == "mlflow":
        uri = tracking_uri or (folder / "mlruns").resolve().as_uri()
        return MlflowBackend(uri, experiment=project, name=name, params=params)
    msg = f"open_backend: {kind!r} is not a tracker that writes files (tensorboard, wandb, mlflow)"
    raise ValueError(msg)


def _needs(package: str, kind: str) -> ImportError:
    return ImportError(f"the {kind} tracker needs {package}: pip install knittrans[{EXTRA}]")


def flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and other leaves kept as they are)."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoardBackend:
    """Scalars in TensorBoard event files (``tensorboard.summary.Writer``), flushed at every step."""

    def __init__(self, logdir: Path) -> None:
        try:
            from tensorboard.summary import Writer
        except ImportError as exc:
            raise _needs("tensorboard", "tensorboard") from exc
        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self._writer = Writer(str(logdir))

    def log(self, data: Mapping[str, float], step: int) -> None:
        for key, value in data.items():
            self._writer.add_scalar(key, value, step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    """A W&B run under ``<folder>/wandb``: offline unless ``WANDB_API_KEY`` is set (``WANDB_MODE`` wins when set)."""

    def __init__(self, folder: Path, *, project: str, name: str, params: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _needs("wandb", "wandb") from exc
        mode: Any = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False,
                                  silent=True)
        self._run = wandb.init(project=project, name=name, dir=str(folder), config=params, mode=mode,
                               settings=settings)

    def log(self, data: Mapping[str, float], step: int) -> None:
        self._run.log(dict(data), step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        wandb.teardown()  # the W&B service writes the run file to its end only when it stops


_MLFLOW_NAME = re.compile(r"[^\w\-. /]")
"""Characters MLflow refuses in a metric or parameter name (replaced by ``_``)."""
_MLFLOW_PARAM = re.compile(r"[^\w\-. ]")
"""... and ``/`` in a parameter name too: a config key may be a location (``grpc://h:1``), whose ``//`` MLflow's
file store refuses."""


class MlflowBackend:
    """An MLflow run (``MlflowClient``) in experiment ``experiment`` at ``uri``; metrics of a step in one batch."""

    def __init__(self, uri: str, *, experiment: str, name: str, params: dict[str, Any]) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        if uri.startswith("file:"):  # the file store: MLflow asks for this opt-in to keep using it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _needs("mlflow-skinny", "mlflow") from exc
        self._metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id: str = self.client.create_run(experiment_id, run_name=name).info.run_id
        flat = [Param(_MLFLOW_PARAM.sub("_", k)[:250], str(v)[:500]) for k, v in flatten(params).items()]
        for i in range(0, len(flat), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=flat[i:i + 100])

    def log(self, data: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(_MLFLOW_NAME.sub("_", k), v, now, step) for k, v in data.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
