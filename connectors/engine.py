"""Generation engines the rollout worker drives: the ``RolloutEngine`` protocol, ``VllmEngine`` and ``start_engine``.

``start_engine`` starts the engine ``RolloutConfig.engine`` names: ``VllmEngine`` here, or
``connectors.served.ServedEngine``, a client of a vLLM server.

``VllmEngine`` runs vLLM's ``LLMEngine`` step by step in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set): every prompt is one request with ``n = G``,
``RequestOutputKind.FINAL_ONLY`` so a prompt comes back once, with all its samples, when the last one
finishes, and ``logprobs=0, flat_logprobs=True`` so only the sampled tokens' logprobs travel, as flat
lists. A text prompt is wrapped in the model's chat template (``connectors.tasks.chat_prompt_ids``: one user
turn, the assistant's turn opened) when its tokenizer has one and ``RolloutConfig.chat_template`` is on (an
instruct model such as SmolLM2-Instruct answers in that format; the tiny test tokenizer has none, so its prompts
go in as they are). vLLM is imported when an engine is built, never at module import.

With ``RolloutConfig.partial_rollouts`` every sample is a request of its own, streamed (``DELTA``), and new
weights interrupt the running samples, which resume from their generated prefix under the new weights
(``connectors.partial``); a finished group then comes back as a ``connectors.partial.ResumedOutput``, with the
version of each token.

``VllmEngine`` also serves ``connectors.agent.TurnEngine``: one model turn of an agent episode is one request whose
prompt is token ids (vLLM's token prompt), ``n = 1``, stopping at the environment's stop strings (kept in the
output) or the end of sequence.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, cast

import pyarrow as pa

from connectors.config import RolloutConfig
from connectors.partial import PartialGroups
from connectors.tasks import Prompt, chat_prompt_ids
from connectors.vllm import FinishedRequest, require_vllm

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # the engine core in this process: no spawned engine process, weights loadable in place
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


class RolloutEngine(Protocol):
    """What the worker needs of a generation engine (``VllmEngine`` wraps vLLM's ``LLMEngine``)."""

    logprobs_mode: str

    def submit(self, request_id: str, prompt: Prompt, n: int) -> None:
        """Queue one prompt for n samples; raises ValueError if the engine refuses it."""

    def step(self) -> Sequence[FinishedRequest]:
        """One engine step; returns the ``RequestOutput`` of every prompt whose n samples all finished."""

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop queued or running prompts."""

    def load_weights(self, table: pa.Table, version: int | None = None) -> None:
        """Load a weights table (``connectors.engine_weights`` format) of policy ``version`` into the running
        engine."""


def start_engine(config: RolloutConfig) -> RolloutEngine:
    """The engine ``config.engine`` names, started: vLLM in this process, or a client of the vLLM server at
    ``config.engine_url`` (``connectors.served.ServedEngine``, once the server answers)."""
    if config.engine == "vllm-server":
        from connectors.served import ServedEngine

        assert config.engine_url is not None  # RolloutConfig checks it
        return ServedEngine(config, config.engine_url, start_timeout_s=config.engine_start_timeout_s)
    return VllmEngine(config)


class VllmEngine:
    """vLLM's ``LLMEngine`` driven step by step, in this process.

    Args:
        config: the rollout config (model, dtype, sampling settings).
        llm: an existing ``vllm.LLM`` to reuse (its settings win over ``config``'s engine fields).
    """

    def __init__(self, config: RolloutConfig, *, llm: Any = None) -> None:
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        require_vllm()
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from connectors.engine_weights import WORKER_EXTENSION

        if llm is None:
            llm = LLM(
                model=config.model,
                dtype=cast(Any, config.dtype),
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                seed=config.seed,
                enforce_eager=config.enforce_eager,
                logprobs_mode=config.logprobs_mode,
                tensor_parallel_size=config.tensor_parallel_size,
                distributed_executor_backend="uni" if config.tensor_parallel_size == 1 else None,
                worker_extension_cls=WORKER_EXTENSION,
            )
        self.llm = llm
        self.engine = llm.llm_engine
        tokenizer = llm.get_tokenizer()
        self._chat_tokenizer = tokenizer if config.chat_template and getattr(tokenizer, "chat_template", None) else None
        """The tokenizer whose chat template wraps text prompts (None: prompts go in as they are)."""
        self.logprobs_mode: str = str(self.engine.model_config.logprobs_mode)
        self._params = SamplingParams(
            n=1,
            temperature=config.temperature,
            top_p=config.top_p,
            max_tokens=config.max_tokens,
            logprobs=0,  # the sampled token's logprob only
            flat_logprobs=True,
            ignore_eos=config.ignore_eos,
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per prompt, with all n samples
        )
        self.partial: PartialGroups | None = None
        """The samples of the running groups, with ``partial_rollouts`` (each a request, streamed)."""
        if config.partial_rollouts:
            self.partial = PartialGroups(config.max_tokens, config.initial_version)
            self._sample_params = self._params.clone()
            self._sample_params.output_kind = RequestOutputKind.DELTA

    def submit(self, request_id: str, prompt: Prompt, n: int) -> None:
        if self.partial is not None and not prompt.images:
            ids = (chat_prompt_ids(self._chat_tokenizer, prompt.text) if self._chat_tokenizer is not None
                   else list(self.llm.get_tokenizer().encode(prompt.text)))
            self._submit_samples(self.partial.requests(request_id, ids, n))
            return
        params = self._params.clone()
        params.n = n
        inputs: Any = prompt.text
        if prompt.images:
            inputs = {"prompt": prompt.text, "multi_modal_data": {"image": list(prompt.images)}}
        elif self._chat_tokenizer is not None:
            inputs = {"prompt_token_ids": chat_prompt_ids(self._chat_tokenizer, prompt.text)}
        self.engine.add_request(request_id, inputs, params)

    def submit_tokens(self, request_id: str, token_ids: Sequence[int], max_tokens: int, stop: Sequence[str]) -> None:
        """One agent turn: continue ``token_ids`` (``connectors.agent.TurnEngine``)."""
        from vllm import SamplingParams

        params = SamplingParams(n=1, temperature=self._params.temperature, top_p=self._params.top_p,
                                max_tokens=max_tokens, logprobs=0, flat_logprobs=True,
                                ignore_eos=self._params.ignore_eos, stop=list(stop), include_stop_str_in_output=True,
                                output_kind=self._params.output_kind)
        self.engine.add_request(request_id, {"prompt_token_ids": list(token_ids)}, params)

    def prompt_ids(self, text: str) -> list[int]:
        """The token ids a text prompt goes in as (in the chat template when ``submit`` would use it)."""
        if self._chat_tokenizer is not None:
            return chat_prompt_ids(self._chat_tokenizer, text)
        return [int(t) for t in self.llm.get_tokenizer().encode(text)]

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` on its own, no special tokens added (an agent's observation)."""
        return [int(t) for t in self.llm.get_tokenizer().encode(text, add_special_tokens=False)]

    def _submit_samples(self, requests: Sequence[tuple[str, list[int], int]]) -> None:
        for request_id, ids, max_tokens in requests:
            params = self._sample_params.clone()
            params.max_tokens = max_tokens
            self.engine.add_request(request_id, {"prompt_token_ids": ids}, params)

    def step(self) -> list[FinishedRequest]:
        outs = self.engine.step()
        if self.partial is None:
            return [o for o in outs if o.finished]
        whole = [o for o in outs if o.finished and not self.partial.owns(str(o.request_id))]  # groups with images
        return [*self.partial.take(outs), *whole]

    def abort(self, request_ids: Sequence[str]) -> None:
        if self.partial is not None:
            request_ids = [*request_ids, *self.partial.drop(request_ids)]
        self.engine.abort_request(list(request_ids))

    def load_weights(self, table: pa.Table, version: int | None = None) -> None:
        """Load ``table`` into the running engine; with partial rollouts, interrupt the running samples first and
        resume them under the new weights (their tokens from here tagged ``version``)."""
        from connectors.engine_weights import load_weights_into_llm

        running = self.partial.running() if self.partial is not None and version is not None else []
        if running:
            self.engine.abort_request(running)
        load_weights_into_llm(self.llm, table)
        if self.partial is not None and version is not None:
            self._submit_samples(self.partial.continuations(running, version))
