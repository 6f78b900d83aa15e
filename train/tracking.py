"""Experiment tracking: a run's figures in the tools RL users watch their runs in.

:class:`TrackingConfig` names the trackers (``--logger console,tensorboard,wandb,mlflow``) and where they write;
:class:`Tracking` sends each ``log(data, step)`` to every one of them, the shape of verl's ``Tracking``. The
trackers themselves (``train.trackers``) import TensorBoard, W&B and MLflow only when asked for, from the
``track`` extra (``pip install knittrans[track]``).

A tracker that fails, when it starts or at a step, logs one warning naming it and the error and is dropped:
the run goes on with the others, and tracking never fails a run.

Example:
    >>> import tempfile
    >>> with Tracking(TrackingConfig(logger=["console"]), folder=tempfile.mkdtemp()) as tracking:
    ...     tracking.log({"loss": 0.5}, step=1)
    >>> tracking.active
    []
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.trackers import EXTRA, Backend, open_backend

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("console", "tensorboard", "wandb", "mlflow")
"""The trackers ``--logger`` takes."""

_MODULES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The package each tracker imports."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackingConfig:
    """Where a run's per-step figures go (``knit run`` and ``knit train`` take it as ``--logger`` and its kin).

    Example:
        >>> TrackingConfig(logger=["console", "tensorboard"]).logger
        ['console', 'tensorboard']
        >>> TrackingConfig(logger=["neptune"])
        Traceback (most recent call last):
        ...
        ValueError: TrackingConfig.logger: 'neptune' is not a tracker; choose among console, tensorboard, wandb, mlflow
    """

    logger: list[str] = field(default_factory=lambda: ["console"])
    """The trackers each step's figures go to, any of console, tensorboard, wandb, mlflow (all but console need
    the ``track`` extra); empty: none."""
    project: str = "knittrans"
    """The W&B project and the MLflow experiment the run is logged under."""
    run_name: str | None = None
    """The run's name in the trackers (none: the name of its folder)."""
    tracking_dir: str | None = None
    """Folder of the TensorBoard event files (``tensorboard/``), the W&B run (``wandb/``) and the MLflow file store
    (``mlruns/``) (none: the run folder; for ``knit train`` the folder of ``progress_path``, else ``tracking``)."""
    tracking_uri: str | None = None
    """MLflow's tracking URI, a server or a store (none: a file store, ``mlruns/`` in the tracking folder)."""

    def __post_init__(self) -> None:
        for name in self.logger:
            if name not in BACKENDS:
                msg = f"TrackingConfig.logger: {name!r} is not a tracker; choose among {', '.join(BACKENDS)}"
                raise ValueError(msg)
        if not self.project.strip():
            msg = f"TrackingConfig.project={self.project!r} must name a project"
            raise ValueError(msg)


def missing_packages(config: TrackingConfig) -> list[str]:
    """The trackers of ``config`` whose package is not installed (checked without importing it)."""
    return [name for name in dict.fromkeys(config.logger)
            if name in _MODULES and importlib.util.find_spec(_MODULES[name]) is None]


def check_installed(config: TrackingConfig) -> None:
    """Raise ``ImportError`` naming the ``track`` extra when a tracker of ``config`` is not installed (a command
    checks this before it starts a run: the run itself only warns)."""
    missing = missing_packages(config)
    if missing:
        msg = f"--logger {','.join(missing)} needs the {EXTRA!r} extra: pip install knittrans[{EXTRA}]"
        raise ImportError(msg)


class ConsoleBackend:
    """``console``: one log line per step, its figures sorted by name."""

    def log(self, data: Mapping[str, float], step: int) -> None:
        log.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in sorted(data.items())))

    def close(self) -> None:
        return None


class Tracking:
    """The trackers of one run: :meth:`log` sends each step's figures to every tracker still working.

    ``folder``: where the file-writing trackers write (``TrackingConfig.tracking_dir`` overrides it); ``params``:
    the run's config, recorded once (W&B config, MLflow params); ``name``: the run's name (default: the
    config's ``run_name``, else the folder's name). Values that are not finite numbers are left out of a step.
    """

    def __init__(self, config: TrackingConfig, *, folder: str | Path, params: Mapping[str, Any] | None = None,
                 name: str | None = None) -> None:
        self.folder = Path(config.tracking_dir or folder)
        self.name = config.run_name or name or self.folder.resolve().name
        self._backends: dict[str, Backend] = {}
        for kind in dict.fromkeys(config.logger):
            try:
                self._backends[kind] = (ConsoleBackend() if kind == "console" else
                                        open_backend(kind, folder=self.folder, name=self.name, project=config.project,
                                                     tracking_uri=config.tracking_uri, params=dict(params or {})))
            except Exception as exc:  # a tracker never fails the run
                self._warn(kind, "could not start", exc)

    @property
    def active(self) -> list[str]:
        """The trackers still logging."""
        return list(self._backends)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Send the finite numbers of ``data`` to every tracker; one that fails warns once and is dropped."""
        clean = {k: float(v) for k, v in data.items()
                 if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        if not clean:
            return
        for kind, backend in list(self._backends.items()):
            try:
                backend.log(clean, step)
            except Exception as exc:
                self._backends.pop(kind, None)
                self._warn(kind, f"failed at step {step}", exc)
                _close_quietly(backend)

    def close(self) -> None:
        """Close every tracker (safe to call twice); a close that fails warns."""
        backends, self._backends = self._backends, {}
        for kind, backend in backends.items():
            try:
                backend.close()
            except Exception as exc:
                self._warn(kind, "failed to close", exc)

    def _warn(self, kind: str, what: str, exc: BaseException) -> None:
        log.warning("tracker %s %s (%s: %s); it logs nothing more, the run goes on", kind, what,
                    type(exc).__name__, exc)

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_quietly(backend: Backend) -> None:
    try:
        backend.close()
    except Exception as exc:
        log.debug("closing a failed tracker: %s", exc)
