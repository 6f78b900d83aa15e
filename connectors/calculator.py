"""The calculator tool: a safe integer-arithmetic evaluator and the environment of the ``calculator`` data source.

:func:`evaluate` parses ``+ - * /``, parentheses, unary minus and non-negative integer literals by recursive descent
(no ``eval``, no names, no other operator) into exact fractions; a whole result is written as an integer, another
as a decimal of at most six places. Anything else (a stray character, a division by zero, a number over
:data:`MAX_DIGITS` digits, nesting over :data:`MAX_DEPTH`) raises :class:`CalcError` naming what is wrong.

:class:`CalculatorEnv` (``connectors.agent.Environment``): a model turn holding ``<calc>EXPR</calc>`` is a tool
call, answered with ``<result>VALUE</result>`` (``<result>error: ...</result>`` for an expression the evaluator
refuses) and the episode goes on; a turn without one is the final answer, scored by exact match
(``connectors.tasks.exact_match_reward``) and the episode ends.

Example:
    >>> evaluate("12*34")
    '408'
    >>> CalculatorEnv().step("<calc>(7+5)/4</calc>").observation
    '<result>3</result>'
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

from connectors.tasks import CALC_CLOSE, CALC_OPEN, Prompt, exact_match_reward

MAX_EXPRESSION_CHARS = 200
"""Longest expression the evaluator reads."""
MAX_DIGITS = 30
"""Most digits of a literal, and of an intermediate or final value's numerator or denominator."""
MAX_DEPTH = 32
"""Deepest nesting of parentheses and unary minus."""

_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
_CALL = re.compile(re.escape(CALC_OPEN) + r"(.*?)" + re.escape(CALC_CLOSE), re.DOTALL)


class CalcError(ValueError):
    """An expression the calculator refuses; the message says why (it is shown to the model)."""


def _tokens(expression: str) -> list[str]:
    if len(expression) > MAX_EXPRESSION_CHARS:
        msg = f"expression of {len(expression)} characters, over {MAX_EXPRESSION_CHARS}"
        raise CalcError(msg)
    out: list[str] = []
    at = 0
    text = expression.rstrip()
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m is None:
            msg = f"unexpected {text[at:].lstrip()[:1]!r} at position {at}"
            raise CalcError(msg)
        out.append(m.group(1) or m.group(2))
        at = m.end()
    if not out:
        msg = "empty expression"
        raise CalcError(msg)
    return out


class _Parser:
    """expr := term (('+'|'-') term)*; term := unary (('*'|'/') unary)*; unary := '-' unary | atom;
    atom := INT | '(' expr ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.at = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            msg = "the expression ends too early"
            raise CalcError(msg)
        self.at += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = _checked(value + self.term() if self.take() == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            if self.take() == "*":
                value = _checked(value * self.unary())
                continue
            divisor = self.unary()
            if divisor == 0:
                msg = "division by zero"
                raise CalcError(msg)
            value = _checked(value / divisor)
        return value

    def unary(self) -> Fraction:
        if self.peek() != "-":
            return self.atom()
        self.take()
        self._enter()
        value = -self.unary()
        self.depth -= 1
        return value

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            self._enter()
            value = self.expr()
            if self.peek() != ")":
                msg = "a '(' without its ')'"
                raise CalcError(msg)
            self.take()
            self.depth -= 1
            return value
        if not token.isdigit():
            msg = f"expected a number or '(', got {token!r}"
            raise CalcError(msg)
        if len(token) > MAX_DIGITS:
            msg = f"a number of {len(token)} digits, over {MAX_DIGITS}"
            raise CalcError(msg)
        return Fraction(int(token))

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            msg = f"nested deeper than {MAX_DEPTH}"
            raise CalcError(msg)


def _checked(value: Fraction) -> Fraction:
    if max(abs(value.numerator), value.denominator) >= 10**MAX_DIGITS:
        msg = f"a value of more than {MAX_DIGITS} digits"
        raise CalcError(msg)
    return value


def evaluate(expression: str) -> str:
    """The value of ``expression`` as text: an integer when whole, else a decimal of at most six places.

    Raises:
        CalcError: the expression is not integer arithmetic of ``+ - * /`` and parentheses, or divides by zero.
    """
    parser = _Parser(_tokens(expression))
    value = parser.expr()
    if parser.peek() is not None:
        msg = f"unexpected {parser.peek()!r} after a complete expression"
        raise CalcError(msg)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0")


class EnvStep(NamedTuple):
    """What an environment answers to one model turn."""

    observation: str
    """Text appended to the context after the turn (tokenized on its own); empty when ``done``."""
    reward: float
    """The reward of the whole response; meaningful when ``done``."""
    done: bool
    """Whether the episode ended (the turn was the final answer)."""


class CalculatorEnv:
    """One sample of the ``calculator`` data source (``connectors.agent.Environment``).

    Args:
        stop: the string a model turn stops at (the close of a tool call).
    """

    stop: tuple[str, ...] = (CALC_CLOSE,)
    """Where a model turn stops: after a tool call's close tag (or at the model's end of sequence)."""

    def __init__(self) -> None:
        self.sample: dict[str, object] = {}
        self.calls = 0
        """Tool calls answered so far."""

    def reset(self, prompt: Prompt) -> str:
        """The first observation: the prompt's text (few-shot preamble and question)."""
        self.sample = dict(prompt.sample)
        self.calls = 0
        return prompt.text

    def step(self, turn: str) -> EnvStep:
        """Answer the turn's last ``<calc>`` call, or score the turn as the final answer when it makes none."""
        calls = _CALL.findall(turn)
        if not calls:
            return EnvStep("", exact_match_reward("", turn, self.sample) if "answer" in self.sample else 0.0, True)
        self.calls += 1
        try:
            value = evaluate(calls[-1])
        except CalcError as exc:
            value = f"error: {exc}"
        return EnvStep(f"<result>{value}</result>", 0.0, False)
