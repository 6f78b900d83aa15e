"""A scripted stand-in for vLLM, for tests and demos of the rollout path without a model.

Every fake of the connectors lives here (the real engine runs in the slow tests):

* ``FakeFlatLogprobs``: the fields of vLLM's ``FlatLogprobs`` the adapter reads (``start_indices``,
  ``end_indices``, ``token_ids``, ``logprobs``), sampled token first at each position;
* ``FakeLogprob``: vLLM's ``Logprob`` (the ``logprob`` the adapter reads) for the dict-per-position list form;
* ``FakeCompletion`` / ``FakeRequestOutput``: ``CompletionOutput`` / ``RequestOutput``;
* ``FakeEngine``: the ``connectors.engine.RolloutEngine`` protocol. Each prompt finishes after a seeded random
  number of steps, so groups finish out of order like on a real engine; "tokens" are bytes of
  a fixed answer text, logprobs are seeded random values.
* ``FakeTurnEngine``: a ``FakeEngine`` that also serves ``connectors.agent.TurnEngine``: token ids are bytes of
  the text, and each agent turn is the next of a script of model turns, cut after a stop string or at its token
  limit like vLLM's; every request it was given is kept (``turn_requests``) so a test sees the exact context.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from connectors.tasks import Prompt


@dataclass(slots=True)
class FakeLogprob:
    """vLLM ``Logprob``."""

    logprob: float


@dataclass(slots=True)
class FakeFlatLogprobs:
    """vLLM ``FlatLogprobs`` (flat per-(position, rank) lists)."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @classmethod
    def from_positions(cls, positions: Sequence[Sequence[tuple[int, float]]]) -> FakeFlatLogprobs:
        """One list of ``(token_id, logprob)`` per position (sampled first)."""
        out = cls()
        for entries in positions:
            out.start_indices.append(len(out.logprobs))
            for tid, lp in entries:
                out.token_ids.append(tid)
                out.logprobs.append(lp)
            out.end_indices.append(len(out.logprobs))
        return out


@dataclass(slots=True)
class FakeCompletion:
    """vLLM ``CompletionOutput``."""

    index: int
    token_ids: list[int]
    logprobs: Any
    finish_reason: str | None = "length"
    text: str = ""


@dataclass(slots=True)
class FakeRequestOutput:
    """vLLM ``RequestOutput``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]
    finished: bool = True
    """Whether this is the request's last output (a ``DELTA`` stream's outputs before it are not)."""


class FakeEngine:
    """Finishes each prompt after 1..``max_steps`` steps; responses are ``answer_text`` as byte tokens.

    Args:
        answer_text: decoded response of every sample (``{answer}`` is replaced by ``sample["answer"]``
            for even sample indices, so exactly half the samples earn an exact-match reward).
        max_steps: most steps a prompt takes.
        refuse: prompts whose text contains this substring are refused at submit (ValueError).
        abort_every: every ``abort_every``-th request submitted comes back with all its samples aborted
            (as when the engine loses a request mid-run); ``None`` never.
        seed: seeds logprob values and step counts.
    """

    logprobs_mode = "raw_logprobs"

    def __init__(
        self, *, answer_text: str = "it is {answer}", max_steps: int = 4, refuse: str | None = None, seed: int = 0,
        abort_every: int | None = None,
    ) -> None:
        self.answer_text = answer_text
        self.max_steps = max_steps
        self.refuse = refuse
        self.rng = random.Random(seed)
        self.running: dict[str, tuple[int, Prompt, int]] = {}
        self.steps = 0
        self.aborted: list[str] = []
        self.loaded: list[pa.Table] = []
        self.max_running = 0
        self.abort_every = abort_every
        self.submitted = 0
        self._order: dict[str, int] = {}  # request -> its ordinal among submissions (1-based)
        self.killed: list[str] = []
        """Requests that came back aborted (``abort_every``)."""

    def submit(self, request_id: str, prompt: Prompt, n: int) -> None:
        if self.refuse is not None and self.refuse in prompt.text:
            msg = f"prompt of {request_id} refused"
            raise ValueError(msg)
        self.running[request_id] = (self.steps + self.rng.randint(1, self.max_steps), prompt, n)
        self.submitted += 1
        self._order[request_id] = self.submitted
        self.max_running = max(self.max_running, len(self.running))

    def step(self) -> list[FakeRequestOutput]:
        self.steps += 1
        done = [rid for rid, (t, _, _) in self.running.items() if t <= self.steps]
        outs = []
        for rid in done:
            _, prompt, n = self.running.pop(rid)
            if self.abort_every and self._order.pop(rid) % self.abort_every == 0:
                self.killed.append(rid)
                outs.append(FakeRequestOutput(request_id=rid, prompt_token_ids=list(prompt.text.encode()),
                                              outputs=[FakeCompletion(index=i, token_ids=[], logprobs=None,
                                                                      finish_reason="abort") for i in range(n)]))
                continue
            samples = []
            for i in range(n):
                text = self.answer_text.format(answer=prompt.sample.get("answer", "?") if i % 2 == 0 else "x")
                ids = list(text.encode())
                lps = [-self.rng.random() * 5 for _ in ids]
                flat = FakeFlatLogprobs.from_positions([[(t, lp)] for t, lp in zip(ids, lps, strict=True)])
                samples.append(FakeCompletion(index=i, token_ids=ids, logprobs=flat, finish_reason="stop", text=text))
            outs.append(FakeRequestOutput(request_id=rid, prompt_token_ids=list(prompt.text.encode()), outputs=samples))
        return outs

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if self.running.pop(rid, None) is not None:
                self.aborted.append(rid)

    def load_weights(self, table: pa.Table, version: int | None = None) -> None:
        self.loaded.append(table)


class FakeTurnEngine(FakeEngine):
    """Scripted agent turns: turn ``k`` of every episode is ``script[k]`` (the last one repeated); tokens are its
    bytes, a prompt goes in as ``[BOS, *bytes]``, and a request id's suffix ``.k`` names the turn.

    Args:
        script: the model turns of an episode, in order.
        stop_at_stop_strings: cut a turn after the first stop string it holds (as vLLM does).
    """

    BOS = 1
    """The token the fake's prompts start with (the bytes of text never include it as a first token)."""

    def __init__(self, script: Sequence[str], *, seed: int = 0, stop_at_stop_strings: bool = True) -> None:
        super().__init__(seed=seed)
        self.script = list(script)
        self.stop_at_stop_strings = stop_at_stop_strings
        self.turn_requests: list[tuple[str, list[int], int, tuple[str, ...]]] = []
        """Every turn submitted: request id, its token ids, its token limit and stop strings."""
        self._turns: dict[str, tuple[list[int], int, tuple[str, ...]]] = {}

    def prompt_ids(self, text: str) -> list[int]:
        return [self.BOS, *text.encode()]

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def submit_tokens(self, request_id: str, token_ids: Sequence[int], max_tokens: int, stop: Sequence[str]) -> None:
        if self.refuse is not None and self.refuse in bytes(t for t in token_ids if t != self.BOS).decode():
            msg = f"turn {request_id} refused"
            raise ValueError(msg)
        ids = list(token_ids)
        self.turn_requests.append((request_id, ids, max_tokens, tuple(stop)))
        self._turns[request_id] = (ids, max_tokens, tuple(stop))

    def step(self) -> list[FakeRequestOutput]:
        outs = super().step()
        for rid, (ids, max_tokens, stop) in list(self._turns.items()):
            del self._turns[rid]
            turn = int(rid.rsplit(".", 1)[1])
            text = self.script[min(turn, len(self.script) - 1)]
            cut = min((text.index(s) + len(s) for s in stop if s in text), default=None)
            if self.stop_at_stop_strings and cut is not None:
                text = text[:cut]
            tokens = list(text.encode())
            reason = "stop"
            if len(tokens) > max_tokens:
                tokens, reason = tokens[:max_tokens], "length"
                text = bytes(tokens).decode(errors="replace")
            lps = [-self.rng.random() * 5 for _ in tokens]
            flat = FakeFlatLogprobs.from_positions([[(t, lp)] for t, lp in zip(tokens, lps, strict=True)])
            outs.append(FakeRequestOutput(request_id=rid, prompt_token_ids=ids, outputs=[
                FakeCompletion(index=0, token_ids=tokens, logprobs=flat, finish_reason=reason, text=text)]))
        return outs

    def abort(self, request_ids: Sequence[str]) -> None:
        super().abort(request_ids)
        for rid in request_ids:
            if self._turns.pop(rid, None) is not None:
                self.aborted.append(rid)
