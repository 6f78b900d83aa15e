"""Partial rollouts: responses that go on under new weights, each token tagged with the version that sampled it.

With ``RolloutConfig.partial_rollouts`` the engine (``connectors.engine.VllmEngine``) runs every sample of a
prompt group as a request of its own (``n = 1``, ``RequestOutputKind.DELTA``), so it holds each sample's tokens
and logprobs as they are sampled (:class:`PartialGroups`). When new weights are published while samples run,
``load_weights`` aborts the running ones, loads the weights, and resubmits each as a continuation: prompt ++ the
tokens sampled so far as the new prompt, the tokens left of ``max_tokens`` as its budget. The continuation's
prefill recomputes the prefix's KV cache under the new weights (verl's and AReaL's partial rollouts interrupt and
resume the same way), and the tokens it samples are tagged with the new version. A group comes back once all its
samples finished, as a :class:`ResumedOutput` (what ``connectors.vllm.group_to_batch`` reads, plus
``token_versions``).

Without the option the engine loads new weights in place while requests run: a response then spans versions
too, but with the old weights' KV cache for its prefix, and its tokens are all written with the version of its
last one (``policy_version``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from connectors.vllm import sampled_logprobs


@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    """One logprob per sampled token, in the flat form ``connectors.vllm.sampled_logprobs`` reads."""

    token_ids: list[int]
    logprobs: list[float]

    @property
    def start_indices(self) -> list[int]:
        return list(range(len(self.token_ids)))

    @property
    def end_indices(self) -> list[int]:
        return list(range(1, len(self.token_ids) + 1))


@dataclass(frozen=True, slots=True)
class ResumedCompletion:
    """One sample of a group run as partial rollouts: all its tokens, across its continuations."""

    index: int
    token_ids: list[int]
    logprobs: SampledLogprobs
    finish_reason: str | None
    text: str
    """The detokenized response (the rewards read it)."""


@dataclass(frozen=True, slots=True)
class ResumedOutput:
    """A finished group of partial rollouts (a ``connectors.vllm.FinishedRequest``), with each sample's token
    versions (``token_versions[i]``: int32 ``[len(outputs[i].token_ids)]``, in sample order)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[ResumedCompletion]
    token_versions: list[np.ndarray]


@dataclass(slots=True)
class _Sample:
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish: str | None = None
    request: str = ""
    """The engine request running it now ("" once finished)."""
    parts: int = 0
    """Continuations submitted so far."""


@dataclass(slots=True)
class _Group:
    prompt_ids: list[int]
    samples: list[_Sample]


class PartialGroups:
    """The samples of every running group: which engine request runs each, what each sampled under which version.

    The engine calls :meth:`requests` to submit, :meth:`take` with each step's outputs, :meth:`running` before it
    loads new weights (and aborts them), then :meth:`continuations` to resubmit them; :meth:`drop` when the
    worker aborts groups.
    """

    def __init__(self, max_tokens: int, version: int) -> None:
        self.max_tokens = max_tokens
        self.version = version
        """The version of the weights the engine runs: what a token sampled now is tagged with."""
        self._groups: dict[str, _Group] = {}
        self._owner: dict[str, tuple[str, int]] = {}  # engine request -> (group, sample index)
        self._ready: list[str] = []  # groups finished outside a step (a continuation with no budget left)
        self._issued: set[str] = set()  # every engine request this object named (its outputs are its own)

    def requests(self, group_id: str, prompt_ids: Sequence[int], n: int) -> list[tuple[str, list[int], int]]:
        """A new group of ``n`` samples: ``(request id, prompt ids, max tokens)`` of each to submit."""
        if group_id in self._groups:
            msg = f"group {group_id!r} is already running"
            raise ValueError(msg)
        self._groups[group_id] = _Group(prompt_ids=list(prompt_ids), samples=[_Sample() for _ in range(n)])
        return [self._next(group_id, i) for i in range(n)]

    def _next(self, group_id: str, i: int) -> tuple[str, list[int], int]:
        group = self._groups[group_id]
        s = group.samples[i]
        s.request = f"{group_id}#{i}.{s.parts}"
        s.parts += 1
        self._owner[s.request] = (group_id, i)
        self._issued.add(s.request)
        return s.request, group.prompt_ids + s.ids, self.max_tokens - len(s.ids)

    def take(self, outputs: Sequence[Any]) -> list[ResumedOutput]:
        """Add each output's new tokens (``RequestOutputKind.DELTA``) to its sample; the groups now finished."""
        done, self._ready = self._ready, []
        for out in outputs:
            owner = self._owner.get(str(out.request_id))
            if owner is None:
                continue  # a request aborted for a continuation: its last delta is dropped with it
            c = out.outputs[0]
            s = self._groups[owner[0]].samples[owner[1]]
            s.ids.extend(int(t) for t in c.token_ids)
            s.lps.extend(float(x) for x in sampled_logprobs(c.logprobs, c.token_ids))
            s.versions.extend([self.version] * len(c.token_ids))
            s.text.append(c.text or "")
            if out.finished:
                s.finish, s.request = c.finish_reason, ""
                del self._owner[str(out.request_id)]
                self._issued.discard(str(out.request_id))
                if all(not x.request for x in self._groups[owner[0]].samples):
                    done.append(owner[0])
        return [self._finished(g) for g in done]

    def _finished(self, group_id: str) -> ResumedOutput:
        group = self._groups.pop(group_id)
        outs = [ResumedCompletion(index=i, token_ids=s.ids, logprobs=SampledLogprobs(s.ids, s.lps),
                                  finish_reason=s.finish, text="".join(s.text)) for i, s in enumerate(group.samples)]
        return ResumedOutput(request_id=group_id, prompt_token_ids=group.prompt_ids, outputs=outs,
                             token_versions=[np.asarray(s.versions, dtype=np.int32) for s in group.samples])

    def running(self) -> list[str]:
        """The engine requests running now (to abort before new weights are loaded)."""
        return list(self._owner)

    def continuations(self, aborted: Sequence[str], version: int) -> list[tuple[str, list[int], int]]:
        """After ``aborted`` were aborted and the weights of ``version`` loaded: the continuation of each to submit
        (a sample whose budget is spent finishes with ``length``)."""
        self.version = version
        out = []
        for request in aborted:
            owner = self._owner.pop(request, None)
            if owner is None:
                continue
            s = self._groups[owner[0]].samples[owner[1]]
            self._issued.discard(request)
            if len(s.ids) >= self.max_tokens:
                s.finish, s.request = "length", ""
                if all(not x.request for x in self._groups[owner[0]].samples):
                    self._ready.append(owner[0])  # returned by the next take
                continue
            out.append(self._next(*owner))
        return out

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` is a sample request of this object (running, or aborted and not yet closed)."""
        return request_id in self._issued

    def drop(self, group_ids: Sequence[str]) -> list[str]:
        """Forget the groups ``group_ids`` (aborted by the worker); their engine requests still running."""
        requests = []
        for g in group_ids:
            group = self._groups.pop(g, None)
            for s in group.samples if group is not None else ():
                if s.request:
                    requests.append(s.request)
                    self._owner.pop(s.request, None)
                    self._issued.discard(s.request)
        return requests
