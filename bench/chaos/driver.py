"""The launcher of a chaos run, in a process of its own so that the run can SIGKILL it: ``knit run``'s
``run_policy`` with the run's placement on namespace hosts.

``python -m bench.chaos.driver SPEC.json [--resume]``: ``SPEC.json`` holds the run folder and the placement's
sites (:func:`write_spec`); the run's config is the run folder's ``run_config.json``. ``--resume`` takes the run
up from its checkpoint, its stores' spill logs and its event logs (``launcher.resume``), as ``knit run --resume``
does. Exit 0: the run ended; 130: stopped by SIGTERM or SIGINT; 1: it failed (the traceback on stderr).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType

from launcher.placement import Placement, Site


def write_spec(path: Path, out: Path, placement: Placement) -> None:
    """Write the driver's spec: the run folder and every site of ``placement``."""
    doc = {"out": str(out), "stores": [asdict(s) for s in placement.stores], "rollout": asdict(placement.rollout),
           "trainer": [asdict(s) for s in placement.trainer], "probe_s": placement.probe_s}
    path.write_text(json.dumps(doc))


def read_spec(path: Path) -> tuple[Path, Placement]:
    """The run folder and the placement :func:`write_spec` wrote."""
    doc = json.loads(path.read_text())
    return Path(doc["out"]), Placement(stores=[Site(**s) for s in doc["stores"]], rollout=Site(**doc["rollout"]),
                                       trainer=[Site(**s) for s in doc["trainer"]], probe_s=doc["probe_s"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or ``--resume``) the chaos run the spec names; see the module docstring for the exit codes."""
    from launcher import resume
    from launcher.model import prepare_model
    from launcher.run import Interrupted, run_policy
    from launcher.run_config import RunConfig
    from schemas import run_folder

    args = list(sys.argv[1:] if argv is None else argv)
    out, placement = read_spec(Path(args[0]))
    cfg = run_folder.read_run_config(RunConfig, out / run_folder.RUN_CONFIG)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    model = prepare_model(cfg.model_path, seed=cfg.seed, model=cfg.model)
    try:
        run_policy(cfg, model, stop=stop, placement=placement,
                   resumed=resume.begin(out) if "--resume" in args else None)
    except Interrupted:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
