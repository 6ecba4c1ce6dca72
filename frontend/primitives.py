"""The expressions a program appends to its state: text, role segments, ``gen`` and ``select``.

Expressions are immutable values; nothing runs until one is appended to a state (``s += expr``).
``a + b`` concatenates (strings are promoted to ``Text``), and ``ops()`` flattens an expression into
the ordered operations the interpreter executes, one program step each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

ROLES = ("system", "user", "assistant")
SelectMethod = Literal["normalized", "total"]


class Expr:
    """Base of every expression."""

    def __add__(self, other: Expr | str) -> Concat:
        return Concat(_parts(self) + _parts(as_expr(other)))

    def __radd__(self, other: Expr | str) -> Concat:
        return Concat(_parts(as_expr(other)) + _parts(self))

    def ops(self) -> list[Op]:
        raise NotImplementedError


@dataclass(frozen=True)
class Text(Expr):
    text: str

    def ops(self) -> list[Op]:
        return [Op("text", "text", self)] if self.text else []


@dataclass(frozen=True)
class Concat(Expr):
    parts: tuple[Expr, ...]

    def ops(self) -> list[Op]:
        return [op for part in self.parts for op in part.ops()]


@dataclass(frozen=True)
class Role(Expr):
    """A whole chat message: its content is ``body`` (text, gen, select or a concatenation of them)."""

    role: str
    body: Expr

    def ops(self) -> list[Op]:
        return [Op("open", self.role, self), *self.body.ops(), Op("close", f"end of {self.role}", self)]


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text; with ``name`` the result is stored as a variable of the state."""

    name: str | None = None
    max_tokens: int = 128
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    choices: tuple[str, ...] | None = None
    grammar: str | None = None

    def ops(self) -> list[Op]:
        return [Op("gen", f"gen {self.name!r}" if self.name else "gen", self)]

    def sampling_params(self) -> dict[str, Any]:
        """The ``sampling_params`` of POST /generate (unset fields left to the server's defaults)."""
        sp: dict[str, Any] = {"max_new_tokens": self.max_tokens}
        for key in ("stop", "temperature", "top_p", "seed", "regex", "grammar"):
            value = getattr(self, key)
            if value is not None:
                sp[key] = value
        if self.json_schema is not None:
            sp["json_schema"] = (
                self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
            )
        if self.choices is not None:
            sp["choices"] = list(self.choices)
        return sp


@dataclass(frozen=True)
class Select(Expr):
    """Append the choice the model scores highest (prompt logprobs; no sampling)."""

    name: str | None
    choices: tuple[str, ...]
    method: SelectMethod = "normalized"

    def ops(self) -> list[Op]:
        return [Op("select", f"select {self.name!r}" if self.name else "select", self)]


@dataclass(frozen=True)
class Op:
    kind: Literal["text", "open", "close", "gen", "select"]
    description: str
    expr: Any


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(
        f"cannot append a {type(value).__name__} to a program state (use a str or an rf expression)"
    )


def _parts(expr: Expr) -> tuple[Expr, ...]:
    return expr.parts if isinstance(expr, Concat) else (expr,)


# -- constructors (the public names) ---------------------------------------------------------------
def system(content: Expr | str) -> Role:
    return Role("system", as_expr(content))


def user(content: Expr | str) -> Role:
    return Role("user", as_expr(content))


def assistant(content: Expr | str) -> Role:
    return Role("assistant", as_expr(content))


def gen(
    name: str | None = None,
    max_tokens: int = 128,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    choices: Sequence[str] | None = None,
    grammar: str | None = None,
) -> Gen:
    """Generate up to ``max_tokens``; ``regex``/``json_schema``/``choices``/``grammar`` constrain the output
    on the server (at most one). ``temperature=None`` uses the server's default."""
    if sum(x is not None for x in (regex, json_schema, choices, grammar)) > 1:
        raise ValueError("gen takes at most one of regex, json_schema, choices and grammar")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    return Gen(
        name,
        max_tokens,
        stop,
        temperature,
        top_p,
        seed,
        regex,
        json_schema,
        None if choices is None else tuple(choices),
        grammar,
    )


def select(
    name: str | None = None, choices: Sequence[str] = (), method: SelectMethod = "normalized"
) -> Select:
    """Pick one of ``choices`` by its logprob after the current text: the sum over its tokens
    (``"total"``) or the mean (``"normalized"``, which does not favour short choices)."""
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise ValueError("select needs a non-empty list of non-empty strings")
    if method not in ("normalized", "total"):
        raise ValueError(f"method must be 'normalized' or 'total', got {method!r}")
    return Select(name, tuple(choices), method)
