"""The transfer benchmark: per train step, verl's single-controller DataProto path vs on-demand Flight fetch.

``python -m bench.transfer [--quick] --out F.json`` (text) and ``python -m bench.transfer
--multimodal [--quick] --out F.json`` (images by reference). The files to read:

* ``__main__.py``: the command line, one :class:`Workload` from its flags;
* ``text.py``, ``multimodal.py``: the two benchmarks: what they measure, their keys and targets;
* ``workload.py``: the workload's shape, its synthetic groups, verl's DataProto shards;
* ``driver.py``: the driver's side: verl's baseline step, counting the driver's payload bytes;
* ``ranks.py``: the trainer ranks (Ray actors) on both paths;
* ``models.py``: the tiny encoder and backbone of the multimodal train phase;
* ``cluster.py``: store processes, Ray, the rank actors and the planner, which both benchmarks share.
"""

from __future__ import annotations

from bench.transfer.workload import IMAGE_FORMATS, Workload, dataproto_shards, group_advantages, make_group, serialize

__all__ = ["IMAGE_FORMATS", "Workload", "dataproto_shards", "group_advantages", "make_group", "serialize"]
