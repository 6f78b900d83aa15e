"""The agent loop: each sample of a tool data source runs as model turns and environment turns, token in, token out.

A sample's context is its prompt's token ids, then every model turn and every observation in the order they
came. A model turn is the exact token ids the engine sampled (never decoded and encoded again); an observation
is tokenized once, on its own, and appended as tokens. So nothing is re-tokenized and the trained tokens are
the sampled ones. The response written (``response_ids``) is everything after the prompt, with ``loss_mask`` 1 at
the model's tokens and 0 at the observation's, the logprobs of the sampled tokens (0.0 at observation tokens),
``num_turns`` and the environment's reward.

* :class:`Environment`: ``reset(prompt)`` gives the first observation (the prompt's text), ``step(turn text)``
  gives the next observation, the reward and whether the episode is done; ``stop`` says where a model turn ends.
* :class:`TurnEngine`: what the loop needs of an engine: one request per model turn, given as token ids, with a
  token limit and stop strings, answered with the sampled ids and their logprobs. ``connectors.engine.VllmEngine``
  serves it in process (vLLM's token prompt); an engine behind a server can serve the same calls.
* :class:`AgentEngine`: a ``connectors.engine.RolloutEngine`` over a turn engine. A prompt of a tool source
  (``Prompt.sample["environment"]``) becomes ``n`` episodes; the group comes back, once its last episode ends, as
  one :class:`AgentGroupOutput` (the rows' rewards are the environment's). Other prompts go to the engine as they
  are, so a mix of tool and single-turn sources runs through one engine.

Limits (:class:`AgentLimits`): an episode ends ``length`` after ``max_turns`` model turns, or when the next
observation or model turn would not fit ``max_total_tokens`` response tokens; such an episode's reward is 0.0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from connectors.calculator import CalculatorEnv, EnvStep
from connectors.config import RolloutConfig
from connectors.partial import SampledLogprobs
from connectors.tasks import TOOL_TASKS, Prompt
from connectors.vllm import COMPLETED_FINISH_REASONS, FinishedRequest, sampled_logprobs

logger = logging.getLogger(__name__)


class Environment(Protocol):
    """One episode of a tool task."""

    stop: tuple[str, ...]
    """Strings a model turn stops at (included in the turn), besides the model's end of sequence."""

    def reset(self, prompt: Prompt) -> str:
        """Start the episode of ``prompt``; returns the first observation (what the model is prompted with)."""

    def step(self, turn: str) -> EnvStep:
        """The model's turn, decoded; returns the observation to append, the reward, and whether it is done."""


ENVIRONMENTS: dict[str, Callable[[], Environment]] = {"calculator": CalculatorEnv}
"""Each environment a tool source can name (``connectors.tasks.ToolTask.environment``), by name."""


class TurnEngine(Protocol):
    """Token-in/token-out generation of one model turn per request."""

    logprobs_mode: str

    def submit_tokens(self, request_id: str, token_ids: Sequence[int], max_tokens: int, stop: Sequence[str]) -> None:
        """Queue one turn: continue ``token_ids`` for at most ``max_tokens`` tokens, stopping after any of ``stop``
        or the end of sequence; raises ValueError if the engine refuses it (e.g. over its context)."""

    def step(self) -> Sequence[FinishedRequest]:
        """One engine step; a finished turn comes back as an output of one completion (its ``token_ids``,
        ``logprobs`` of the sampled tokens, ``finish_reason`` and ``text``)."""

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop queued or running requests."""

    def prompt_ids(self, text: str) -> list[int]:
        """The token ids of a first observation as the model is prompted with it (its chat template's user turn)."""

    def encode(self, text: str) -> list[int]:
        """The token ids of an observation on its own (no special tokens added)."""


@dataclass(frozen=True, slots=True)
class AgentLimits:
    """When an episode stops, besides its environment ending it."""

    max_turns: int = 4
    """Most model turns."""
    max_total_tokens: int = 192
    """Most response tokens (model and observation tokens together)."""
    max_turn_tokens: int = 64
    """Most tokens of one model turn."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_turn_tokens"):
            if getattr(self, name) < 1:
                msg = f"AgentLimits.{name}={getattr(self, name)} must be >= 1"
                raise ValueError(msg)


@dataclass(slots=True)
class AgentCompletion:
    """One episode as ``connectors.vllm.group_to_batch`` reads a completion, with its mask and turn count."""

    index: int
    token_ids: list[int]
    logprobs: SampledLogprobs
    finish_reason: str
    text: str
    loss_mask: list[int]
    num_turns: int
    tool_calls: int = 0
    """Observations appended (the environment answered that many turns)."""


@dataclass(slots=True)
class AgentGroupOutput:
    """A finished group of episodes, as the rollout writes it (``FinishedRequest``), with their rewards."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[AgentCompletion]
    rewards: list[float]
    """The environment's reward of each episode, in ``sample_idx`` order."""
    finished: bool = True


@dataclass(slots=True)
class _Episode:
    index: int
    env: Environment
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    reward: float = 0.0
    finish: str | None = None

    def completion(self) -> AgentCompletion:
        return AgentCompletion(index=self.index, token_ids=list(self.ids),
                               logprobs=SampledLogprobs(list(self.ids), list(self.logprobs)),
                               finish_reason=self.finish or "abort", text="".join(self.texts),
                               loss_mask=list(self.mask), num_turns=max(self.turns, 1), tool_calls=self.calls)


@dataclass(slots=True)
class _Episodes:
    episodes: list[_Episode]
    running: dict[str, _Episode] = field(default_factory=dict)
    """The request id of each episode's turn in the engine."""


class AgentEngine:
    """A ``RolloutEngine`` that runs the prompts of tool sources as episodes over ``engine``'s turns.

    Args:
        engine: the engine; it serves single-turn prompts (``submit``) and turns (``submit_tokens``).
        limits: when an episode stops.
    """

    def __init__(self, engine: Any, limits: AgentLimits) -> None:
        self.engine = engine
        self.limits = limits
        self.logprobs_mode: str = engine.logprobs_mode
        self._groups: dict[str, _Episodes] = {}
        self._turns: dict[str, tuple[str, _Episode]] = {}  # turn request id -> (group id, episode)

    def submit(self, request_id: str, prompt: Prompt, n: int) -> None:
        name = prompt.sample.get("environment")
        if name is None:
            self.engine.submit(request_id, prompt, n)
            return
        if name not in ENVIRONMENTS:
            msg = f"prompt of {request_id} names environment {name!r}; known: {sorted(ENVIRONMENTS)}"
            raise ValueError(msg)
        episodes = []
        for i in range(n):
            env = ENVIRONMENTS[str(name)]()
            episodes.append(_Episode(index=i, env=env, prompt=self.engine.prompt_ids(env.reset(prompt))))
        group = _Episodes(episodes)
        self._groups[request_id] = group
        for ep in episodes:
            self._next_turn(request_id, group, ep)

    def step(self) -> list[Any]:
        done: list[Any] = []
        for out in self.engine.step():
            rid = str(out.request_id)
            owner = self._turns.pop(rid, None)
            if owner is None:
                done.append(out)  # a single-turn group
                continue
            group_id, ep = owner
            group = self._groups.get(group_id)
            if group is None:
                continue
            group.running.pop(rid, None)
            self._turn_done(group_id, group, ep, out.outputs[0] if out.outputs else None)
            if all(e.finish is not None for e in group.episodes):
                del self._groups[group_id]
                done.append(AgentGroupOutput(
                    request_id=group_id, prompt_token_ids=list(group.episodes[0].prompt),
                    outputs=[e.completion() for e in group.episodes], rewards=[e.reward for e in group.episodes]))
        return done

    def abort(self, request_ids: Sequence[str]) -> None:
        turns: list[str] = []
        others: list[str] = []
        for rid in request_ids:
            group = self._groups.pop(rid, None)
            if group is None:
                others.append(rid)
                continue
            for turn_id in group.running:
                self._turns.pop(turn_id, None)
            turns.extend(group.running)
        if turns or others:
            self.engine.abort([*turns, *others])

    def load_weights(self, table: Any, version: int | None = None) -> None:
        self.engine.load_weights(table, version)

    # ---- one episode -----------------------------------------------------------------------------

    def _next_turn(self, group_id: str, group: _Episodes, ep: _Episode) -> None:
        """Send the episode's next model turn, or end it when the limits leave no room."""
        room = self.limits.max_total_tokens - len(ep.ids)
        if ep.turns >= self.limits.max_turns or room < 1:
            ep.finish = "length"
            return
        turn_id = f"{group_id}#{ep.index}.{ep.turns}"
        try:
            self.engine.submit_tokens(turn_id, [*ep.prompt, *ep.ids], min(room, self.limits.max_turn_tokens),
                                      ep.env.stop)
        except ValueError as exc:  # over the engine's context: the episode ends where it is
            logger.info("turn %s refused by the engine: %s", turn_id, exc)
            ep.finish = "length"
            return
        self._turns[turn_id] = (group_id, ep)
        group.running[turn_id] = ep

    def _turn_done(self, group_id: str, group: _Episodes, ep: _Episode, c: Any) -> None:
        """Append a finished model turn, ask the environment, and append its observation or end the episode."""
        if c is None or c.finish_reason not in COMPLETED_FINISH_REASONS:
            ep.finish = "abort"
            return
        ids = [int(t) for t in c.token_ids]
        ep.ids.extend(ids)
        ep.logprobs.extend(float(x) for x in sampled_logprobs(c.logprobs, ids))
        ep.mask.extend([1] * len(ids))
        ep.texts.append(str(c.text))
        ep.turns += 1
        step = ep.env.step(str(c.text))
        if step.done:
            ep.reward, ep.finish = float(step.reward), str(c.finish_reason)
            return
        obs = [int(t) for t in self.engine.encode(step.observation)]
        if len(ep.ids) + len(obs) >= self.limits.max_total_tokens or ep.turns >= self.limits.max_turns:
            ep.finish = "length"  # no room for the observation and a turn after it
            return
        ep.ids.extend(obs)
        ep.logprobs.extend([0.0] * len(obs))
        ep.mask.extend([0] * len(obs))
        ep.texts.append(step.observation)
        ep.calls += 1
        self._next_turn(group_id, group, ep)



def with_agents(engine: Any, config: RolloutConfig) -> Any:
    """``engine`` wrapped in an :class:`AgentEngine` when ``config`` draws from a tool source, else ``engine``."""
    if config.prompts_file is not None or not set(config.data_sources) & set(TOOL_TASKS):
        return engine
    return AgentEngine(engine, AgentLimits(max_turns=config.agent_max_turns, max_total_tokens=config.agent_max_tokens,
                                           max_turn_tokens=config.max_tokens))
