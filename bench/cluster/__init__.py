"""The cluster benchmark: the network-bound regime, every process on a host of its own with a capped link.

``python -m bench.cluster [--quick] --out F.json``. Hosts are network namespaces on a bridge
(:class:`launcher.hosts.Hosts`), each link capped with a token bucket on both ends of its veth. N
rollout/store hosts, D trainer-rank hosts and the driver host (verl's single controller, the Ray head,
TransferQueue's controller) form one Ray cluster (token auth). The same train batches, planned by the
admission planner step by step, reach the ranks four ways:

* **verl** 0.9.1 (``verl_dp``-style, the package itself): each rollout host returns its rows as a
  ``DataProto`` padded to the rollout's ``response_length`` (verl/experimental/agent_loop/agent_loop.py
  pads ``responses``/``input_ids`` to it), the driver gathers them through Ray, reorders them per rank,
  adds the advantages and calls a ``RayWorkerGroup`` method registered ``Dispatch.DP_COMPUTE_PROTO``,
  as verl's trainer calls ``update_actor`` (verl/trainer/ppo/ray_trainer.py; dispatch in
  verl/single_controller/base/decorator.py). DataProto pickled in verl's faster mode
  (``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``, verl/protocol.py ``__getstate__``). Images travel in
  every row (processed, replicated per response, as DataProto rows carry them).
* **TransferQueue** 0.1.11 (the package): its SimpleStorage units one per store host
  (``required_node_resource``), each rollout host ``kv_batch_put``\\ s its groups; per step the driver
  resolves the step's keys once (``kv_retrieve_meta``, as verl's ``kv_batch_meta2batch_meta`` in
  verl/utils/transferqueue_utils.py does before dispatch) and hands each rank a ``BatchMeta`` per
  micro-batch (``select_samples``); the rank calls ``get_data`` (transfer_queue/client.py) per micro-batch,
  the next one prefetched. Images per row, as verl's rollout writes each sample.
* **knittrans**, twice on the same groups: a store node per rollout/store host, each rank DoGets exactly its
  slices (:class:`bench.peers.knit.KnitRank`), the next micro-batch prefetched, images stored raw once per
  group and run through the same Qwen2-VL processor by the rank inside its clock. ``knittrans`` is the
  coordinated transfer: each group written to the store on the host that made it (local placement, a home
  group id) and the ranks assigned by the planner's link model (``assignment="links"``); ``knittrans_hash``
  writes the same groups under plain ids, placed by the hash, and assigns ranks by tokens alone. Its
  metadata scan and planning run inside its step's clock, as TransferQueue's key lookup does in its.

Images travel as each system carries them: verl's and TransferQueue's rows each carry their prompt's
``pixel_values`` and ``image_grid_thw`` as transformers' ``Qwen2VLImageProcessor`` makes them (float32
patches, about 8x the raw bytes); knittrans carries the raw bytes (:mod:`bench.cluster.processor`).

Every link is a token bucket of at most 16 KB, so every read is shaped. Per step, the bytes each link carried
(the veth counters) give each path's **link bound**, the busiest link's bytes over its rate; the whole
machine's CPU busy fraction (``/proc/stat``) is recorded, since every host shares it. Compute comes from
``--compute-ms-per-ktok`` or a named ``--deployment`` (:mod:`bench.cluster.deployment`), time-dilated so its
compute-to-link ratio holds. :mod:`bench.cluster.model` predicts every measured point from the bytes per
link and the costs the bench calibrates (:mod:`bench.cluster.calibrate`), and extrapolates to real clusters.

Modules: ``__main__`` (the command line), ``topology`` (hosts, links, Ray, store nodes, the sampler),
``driver`` (the driver program in the driver host), ``actors`` (rollouts, ranks, verl's worker),
``calibrate`` (per-call and controller costs), ``processor`` (the image processor), ``deployment`` (named
deployments, time dilation), ``model`` (the cluster model), ``report`` (medians, link bounds, the model's
predictions, the plot), ``workload`` (the train batches and their plans).
"""
