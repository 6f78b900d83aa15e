"""Rollout-engine connectors: engine output -> trajectory record batches -> store nodes.

* ``connectors.vllm``: vLLM ``RequestOutput`` -> one trajectory record batch per prompt group;
* ``connectors.rollout``: the rollout worker (``RolloutWorker``, ``RolloutReport``, CLI ``main``);
* ``connectors.config``: ``RolloutConfig`` and lookahead limit hooks;
* ``connectors.engine``: the ``Engine`` protocol and ``VllmEngine`` (vLLM's step loop, in process);
* ``connectors.tasks``: built-in verifiable tasks and the ``RewardFn`` hook;
* ``connectors.weights``: weight sync into a running vLLM engine;
* ``connectors.tiny_model``: a tiny random Llama built offline (tests, demos);
* ``connectors.fake_engine``: a scripted engine for tests without a model.

Importing this package imports neither vLLM nor torch.
"""
