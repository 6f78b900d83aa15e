"""The cluster benchmark: the network-bound regime, every process on a host of its own with a capped link.

``python -m bench.cluster [--quick] --out F.json``. Hosts are network namespaces on a bridge
(:class:`launcher.hosts.Hosts`), each link capped with a token bucket on both ends of its veth. N
rollout/store hosts, D trainer-rank hosts and the driver host (verl's single controller, the Ray head,
TransferQueue's controller) form one Ray cluster (token auth). The same train batches, planned once by the
admission planner (the same rows to the same rank in the same micro-batches), reach the ranks three ways:

* **verl** 0.9.1 (``verl_dp``-style, the package itself): each rollout host returns its rows as a
  ``DataProto`` padded to the rollout's ``response_length`` (verl/experimental/agent_loop/agent_loop.py
  pads ``responses``/``input_ids`` to it), the driver gathers them through Ray, reorders them per rank,
  adds the advantages and calls a ``RayWorkerGroup`` method registered ``Dispatch.DP_COMPUTE_PROTO``,
  as verl's trainer calls ``update_actor`` (verl/trainer/ppo/ray_trainer.py; dispatch in
  verl/single_controller/base/decorator.py). DataProto pickled in verl's faster mode
  (``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``, verl/protocol.py ``__getstate__``). Images travel in
  every row (``pixel_values`` replicated per response, as DataProto rows carry them).
* **TransferQueue** 0.1.11 (the package): its SimpleStorage units one per store host
  (``required_node_resource``), each rollout host ``kv_batch_put``\\ s its groups; per step the driver
  resolves the step's keys once (``kv_retrieve_meta``, as verl's ``kv_batch_meta2batch_meta`` in
  verl/utils/transferqueue_utils.py does before dispatch) and hands each rank a ``BatchMeta`` per
  micro-batch (``select_samples``); the rank calls ``get_data`` (transfer_queue/client.py) per micro-batch,
  the next one prefetched. Images per row, as verl's rollout writes each sample.
* **knittrans**: a store node per rollout/store host (its rollout DoPuts there); each rank DoGets exactly its
  slices with the plan (:class:`bench.peers.knit.KnitRank`), the next micro-batch prefetched; images stored
  once per group and read once per mini-batch by each rank.

What the link arithmetic predicts (R the link rate, per train step; :mod:`bench.cluster.report`): verl's
batch crosses the driver's link twice, in then out, one after the other: ``(B_gather + B_dispatch) / R``,
and ``B`` is the padded batch (every response padded to ``response_length``, images per row); TransferQueue
and knittrans cross a rank's link once with that rank's rows (``max(rank bytes, all / N) / R``), in
parallel over the D ranks. So verl's transfer is about ``2 D x padding`` times knittrans' on text, and
``x G`` more on images; TransferQueue's differs from knittrans' by its bytes (images per row, nested
tensors). The JSON's ``predicted`` block holds each prediction beside the measured ratio.

Modules: ``__main__`` (the command line), ``topology`` (hosts, links, Ray, store nodes, the sampler),
``driver`` (the driver program in the driver host), ``actors`` (rollouts, ranks, verl's worker),
``report`` (medians, predictions, the plot), ``workload`` (the train batches and their plans).
"""
