"""Rollout-engine connectors: engine output -> trajectory record batches -> store nodes.

* ``connectors.rollout``: the rollout loop (``RolloutWorker``: dispatch -> step -> score -> write) and
  ``run_rollout(config)``, one run as a process does it (``python -m connectors --config FILE``);
* ``connectors.dispatch``: the dispatch order (``DispatchQueue``: which committed prompt goes out next);
* ``connectors.config``: ``RolloutConfig``, pure data (travels as a JSON document);
* ``connectors.report``: ``RolloutReport``, what a run wrote, with throughput;
* ``connectors.writer``: ``GroupWriter``, the ordered background DoPuts of images and groups;
* ``connectors.lookahead``: ``LookaheadLimit``, when dispatch pauses for the trainer to catch up;
* ``connectors.weight_sync``: ``WeightSync``, follows the published version, loads its weights;
* ``connectors.engine``: the ``RolloutEngine`` protocol, ``VllmEngine`` (vLLM's step loop, in process) and
  ``start_engine`` (the engine ``RolloutConfig.engine`` names);
* ``connectors.served``: ``ServedEngine``, a vLLM server driven token in, token out over HTTP, its weights pulled
  through vLLM's weight-transfer API;
* ``connectors.vllm_plugin`` / ``connectors.vllm_transfer``: knittrans' vLLM weight-transfer engine (a
  ``vllm.general_plugins`` entry point) that reads a published version from the store nodes inside the server;
* ``connectors.vllm``: vLLM ``RequestOutput`` -> one trajectory record batch per prompt group;
* ``connectors.tasks``: built-in verifiable tasks, the built-in rewards (``REWARDS``), user rewards;
* ``connectors.engine_weights``: weight sync into a running vLLM engine;
* ``connectors.hf_generate``: an engine of your own in a page: transformers ``generate()`` -> ``StoreWriter``;
* ``connectors.tiny_model``: a tiny random Llama built offline (tests, demos);
* ``connectors.fake_engine``: a scripted engine for tests without a model.

Importing this package imports neither vLLM nor torch (``connectors.vllm_transfer`` imports vLLM: only vLLM's
workers import it).
"""
