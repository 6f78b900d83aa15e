"""Prompts and rewards: the built-in verifiable arithmetic task, the built-in rewards, and user rewards.

Built-in data sources (integer arithmetic, exact-match reward):

* ``add_small``: ``a + b`` with ``a, b`` in ``[0, 9]`` (easy);
* ``mul_large``: ``a * b`` with ``a, b`` in ``[100, 999]`` (hard);
* ``calculator``: ``a * b + c`` with a calculator tool (:class:`ToolTask`): the model may write
  ``<calc>12*34</calc>`` and the environment (``connectors.calculator``) appends ``<result>408</result>``; the
  rollout runs its samples as multi-turn trajectories (``connectors.agent``) and the environment scores the final
  turn by exact match;
* ``squares``: an image of 1-4 coloured squares and the question how many (:class:`SquaresTask`), for a
  vision-language model.

A prompt asks for the number; the reward is 1.0 when the decoded response contains the exact answer as
a whole number (``12`` does not match inside ``123`` or ``-12``), else 0.0.

Rewards follow :class:`RewardFn`: ``fn(prompt, response, sample) -> float``, where ``sample`` is the
prompt's dict (``answer``, ``data_source`` and any field of a JSONL prompt file). A config names its
reward by a string (``RolloutConfig.reward``): a built-in of :data:`REWARDS` (``"exact"``,
``"digits"``), or ``"package.module:function"`` for a user's own. :func:`load_reward_fn` is the one
place such a string is resolved to code.

Example:
    >>> p = ARITHMETIC_TASKS["add_small"].make(random.Random(0))
    >>> exact_match_reward(p.text, f"The answer is {p.sample['answer']}.", p.sample)
    1.0
"""

from __future__ import annotations

import importlib
import json
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class RewardFn(Protocol):
    """A reward function: ``(prompt text, decoded response, the prompt's sample dict) -> float``."""

    def __call__(self, prompt: str, response: str, sample: dict[str, Any]) -> float: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a data source, with what the reward function needs to score it."""

    data_source: str
    """Dataset/task name, written to the ``data_source`` column."""
    text: str
    """The prompt text given to the engine."""
    sample: dict[str, Any] = field(default_factory=dict)
    """Ground truth and extra fields (``answer`` for the built-in tasks); passed to the reward function."""
    images: tuple[np.ndarray, ...] = ()
    """Images of a multimodal prompt (stored once per distinct image, referenced by every row)."""


@dataclass(frozen=True, slots=True)
class ArithmeticTask:
    """Integer arithmetic ``a OP b`` with operands drawn uniformly from ``[low, high]``."""

    name: str
    """Data source name."""
    op: str
    """"+" or "*"."""
    low: int
    """Smallest operand."""
    high: int
    """Largest operand."""

    def __post_init__(self) -> None:
        if self.op not in ("+", "*"):
            msg = f"task {self.name!r}: op {self.op!r} is not '+' or '*'"
            raise ValueError(msg)
        if self.high < self.low:
            msg = f"task {self.name!r}: high={self.high} < low={self.low}"
            raise ValueError(msg)

    def make(self, rng: random.Random) -> Prompt:
        """Draw one prompt."""
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        answer = a + b if self.op == "+" else a * b
        text = f"What is {a} {self.op} {b}? Give only the final number. Answer:"
        return Prompt(data_source=self.name, text=text, sample={"answer": str(answer), "data_source": self.name})


ARITHMETIC_TASKS: dict[str, ArithmeticTask] = {
    "add_small": ArithmeticTask(name="add_small", op="+", low=0, high=9),
    "add_large": ArithmeticTask(name="add_large", op="+", low=10, high=99),
    "mul_large": ArithmeticTask(name="mul_large", op="*", low=100, high=999),
}
"""The built-in single-turn data sources, by name."""

CALC_OPEN, CALC_CLOSE = "<calc>", "</calc>"
"""The tags of a calculator call in a model turn (a turn stops at ``CALC_CLOSE``)."""

_CALCULATOR_SHOTS = (
    "You can use a calculator. Write <calc>EXPRESSION</calc> (integers, + - * / and parentheses) and you get "
    "<result>VALUE</result> back. Then give the final answer as 'Answer: NUMBER'.\n\n"
    "Question: What is 23 * 47 + 5?\n<calc>23*47+5</calc><result>1086</result>\nAnswer: 1086\n\n"
    "Question: What is 61 * 19 + 40?\n<calc>61*19+40</calc><result>1199</result>\nAnswer: 1199\n\n"
)
"""The few-shot preamble of a calculator prompt: the tool's syntax and two calls with their results."""


@dataclass(frozen=True, slots=True)
class ToolTask:
    """``a * b + c`` (operands drawn from ``[low, high]``), to be solved with a tool across several model turns.

    Its prompts carry ``sample["environment"]``, the environment (``connectors.agent.ENVIRONMENTS``) that runs
    their samples.
    """

    name: str
    """Data source name."""
    environment: str
    """Name of the environment that answers the model's tool calls and scores the final turn."""
    low: int
    """Smallest operand."""
    high: int
    """Largest operand."""

    def make(self, rng: random.Random) -> Prompt:
        """Draw one prompt: the few-shot preamble, then the question."""
        a, b, c = (rng.randint(self.low, self.high) for _ in range(3))
        text = f"{_CALCULATOR_SHOTS}Question: What is {a} * {b} + {c}?"
        return Prompt(data_source=self.name, text=text, sample={"answer": str(a * b + c), "data_source": self.name,
                                                                "environment": self.environment})


TOOL_TASKS: dict[str, ToolTask] = {"calculator": ToolTask(name="calculator", environment="calculator", low=12, high=99)}
"""The built-in multi-turn data sources, by name."""


@dataclass(frozen=True, slots=True)
class SquaresTask:
    """An image of ``k`` coloured squares (``k`` in ``[low, high]``) and the question how many there are.

    The image is ``side`` pixels a side, on a black background, cut into a 2x2 grid of cells; each square sits in
    a cell of its own, at a random place and size, in a random bright colour. Exact-match reward on ``k``. Drawn
    from the seed alone, so it needs no data set.
    """

    name: str
    """Data source name."""
    low: int = 1
    """Fewest squares."""
    high: int = 4
    """Most squares (at most the 4 cells)."""
    side: int = 56
    """Image side, pixels."""

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high <= 4 or self.side < 32:
            msg = f"task {self.name!r}: needs 1 <= low <= high <= 4 squares (one a cell) and side >= 32, got " \
                  f"low={self.low}, high={self.high}, side={self.side}"
            raise ValueError(msg)

    def make(self, rng: random.Random) -> Prompt:
        """Draw one prompt: the image and the question."""
        k = rng.randint(self.low, self.high)
        cell = self.side // 2
        image = np.zeros((self.side, self.side, 3), dtype=np.uint8)
        for c in rng.sample(range(4), k):
            size = rng.randint(cell // 3, cell - 4)
            y, x = (c // 2) * cell + rng.randint(2, cell - size - 2), (c % 2) * cell + rng.randint(2, cell - size - 2)
            image[y:y + size, x:x + size] = [rng.randint(96, 255) for _ in range(3)]
        return Prompt(data_source=self.name, text="<image>How many squares are there? Answer:",
                      sample={"answer": str(k), "data_source": self.name}, images=(image,))


IMAGE_TASKS: dict[str, SquaresTask] = {"squares": SquaresTask(name="squares")}
"""The built-in image data sources, by name (for a vision-language model: ``knit run --model tiny-vl``)."""

DATA_SOURCES: dict[str, ArithmeticTask | ToolTask | SquaresTask] = {**ARITHMETIC_TASKS, **TOOL_TASKS, **IMAGE_TASKS}
"""Every built-in data source (``RolloutConfig.data_sources`` keys), by name."""


def exact_match_reward(prompt: str, response: str, sample: dict[str, Any]) -> float:
    """1.0 if ``response`` contains ``sample["answer"]`` as a whole integer, else 0.0.

    The answer must not be glued to other digits or to a minus sign (so "12" is not found in "123",
    "512" or "-12"); surrounding text and punctuation are fine ("= 12.", "12,", "(12)").
    """
    del prompt
    answer = str(sample.get("answer", "")).strip()
    if not re.fullmatch(r"-?\d+", answer):
        msg = f"exact_match_reward needs an integer 'answer', got {answer!r}"
        raise ValueError(msg)
    pattern = rf"(?<![\d\-]){re.escape(answer)}(?!\d)"
    return 1.0 if re.search(pattern, response) else 0.0


def digit_reward(prompt: str, response: str, sample: dict[str, Any]) -> float:
    """Share of the response's non-space characters that are digits (partial credit, in [0, 1]).

    The built-in arithmetic tasks are out of reach of a tiny random model (exact match is ~always 0,
    so every GRPO advantage would be 0 and the weights would never change); this shaped reward
    varies within a group, so the loop really learns: the reward per train batch rises.
    """
    del prompt, sample
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


REWARDS: dict[str, RewardFn] = {"exact": exact_match_reward, "digits": digit_reward}
"""The built-in rewards, by the name a config gives (``RolloutConfig.reward``)."""


def is_reward_spec(spec: str) -> bool:
    """Whether ``spec`` names a reward: a key of :data:`REWARDS` or a ``"module:function"`` string."""
    module_name, colon, attr = spec.partition(":")
    return spec in REWARDS or bool(colon and module_name and attr and ":" not in attr)


def load_reward_fn(spec: str) -> RewardFn:
    """The reward named ``spec``: a built-in of :data:`REWARDS`, or a user's ``"module:function"``."""
    if spec in REWARDS:
        return REWARDS[spec]
    if not is_reward_spec(spec):
        msg = f"reward {spec!r} is neither a built-in ({', '.join(sorted(REWARDS))}) nor a 'module:function' string"
        raise ValueError(msg)
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        msg = f"reward function {spec!r}: cannot import module {module_name!r} ({exc})"
        raise ValueError(msg) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        msg = f"reward function {spec!r}: {module_name!r} has no callable {attr!r}"
        raise ValueError(msg)
    return fn  # type: ignore[no-any-return]


def mixed_prompts(mix: Mapping[str, float], *, seed: int = 0, chunk: int = 0) -> Iterator[Prompt]:
    """Endless prompts of the built-in tasks, each drawn from a data source with probability ∝ ``mix``; with
    ``chunk``, in chunks of that many prompts holding the mix exactly, shuffled inside the chunk (a loader that
    hands every train batch of ``chunk`` groups its quota)."""
    unknown = sorted(set(mix) - set(DATA_SOURCES))
    if unknown:
        msg = f"unknown data sources {unknown}; built-in: {sorted(DATA_SOURCES)}"
        raise ValueError(msg)
    names = [n for n, w in mix.items() if w > 0]
    if not names:
        msg = f"data source mix {dict(mix)} has no positive weight"
        raise ValueError(msg)
    weights = [float(mix[n]) for n in names]
    rng = random.Random(seed)
    if not chunk:
        while True:
            name = rng.choices(names, weights=weights)[0]
            yield DATA_SOURCES[name].make(rng)
    counts = [w / sum(weights) * chunk for w in weights]
    if any(abs(c - round(c)) > 1e-6 for c in counts):
        msg = f"data source mix {dict(mix)} does not split a chunk of {chunk} prompts into whole counts"
        raise ValueError(msg)
    order = [n for n, c in zip(names, counts, strict=True) for _ in range(round(c))]
    while True:
        rng.shuffle(order)
        for name in order:
            yield DATA_SOURCES[name].make(rng)


def jsonl_prompts(path: str | Path, *, default_source: str = "default") -> Iterator[Prompt]:
    """Prompts from a JSONL file: one object per line with ``prompt`` and optional ``data_source``.

    Every other field (e.g. ``answer``) goes to ``Prompt.sample`` for the reward function.
    """
    with Path(path).open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                msg = f"{path}:{lineno}: not valid JSON ({exc})"
                raise ValueError(msg) from None
            if not isinstance(doc, dict) or not isinstance(doc.get("prompt"), str):
                msg = f"{path}:{lineno}: expected an object with a string 'prompt'"
                raise ValueError(msg)
            source = str(doc.get("data_source", default_source))
            sample = {k: v for k, v in doc.items() if k != "prompt"}
            sample.setdefault("data_source", source)
            yield Prompt(data_source=source, text=doc["prompt"], sample=sample)


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids of ``text`` as one user turn of ``tokenizer``'s chat template, the assistant's turn opened.

    The template is rendered to text and tokenized without adding special tokens again (the template writes
    them), as vLLM's own chat entry point does.
    """
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return [int(t) for t in tokenizer(rendered, add_special_tokens=False)["input_ids"]]
