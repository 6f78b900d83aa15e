"""The staleness benchmark: train-batch vs mini-batch admission at matched throughput, simulated.

``python -m bench.staleness [--quick] [--math-sigma 0.9] --out F.json``. A discrete-event simulation
that calls the production planner (``admission.Planner``). The files to read:

* ``__main__.py``: the command line, its variant flags, the result file;
* ``sim.py``: the model (loader, rollout, lookahead, planner, trainer) and :func:`simulate`;
* ``workload.py``: :class:`SimParams`, the loader's prompts and their dispatch order;
* ``search.py``: a policy over seeds, the trainer's calibration, the matched-throughput lookahead search;
* ``plan_time.py``: one admission decision's time over 100k trajectories, and at cluster scale.
"""

from __future__ import annotations

from bench.staleness.sim import simulate
from bench.staleness.workload import SimParams

__all__ = ["SimParams", "simulate"]
