"""Declared knobs: a dataclass field's help, choices and range, written once and read everywhere.

``EngineConfig`` (config.py) and ``SamplingParams`` (sampling/params.py) declare their fields with
``knob``. From that one declaration come:
- validation (``problems``): the dataclass checks itself against its specs;
- the command line (``add_arguments``, ``values``): ``radixserve serve`` and ``generate`` flags, their
  help, their choices, and a parse-time check that names the flag;
- the HTTP types (``server/http/protocol.py`` builds its ``msgspec.Meta`` constraints with ``range_meta``),
  so the 400 a client gets and the engine's own refusal are the same rule.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class Spec:
    """What a value of one field may be. ``each``: the range applies to every value of a dict."""

    help: str
    choices: tuple[str, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    each: bool = False
    integer: bool = False
    cli: bool = True  # offered as a command-line flag

    def describe(self) -> str:
        """The rule in words, e.g. ``an integer in [1, 64]`` or ``> 0``."""
        lo = (
            f"[{_num(self.ge)}"
            if self.ge is not None
            else f"({_num(self.gt)}"
            if self.gt is not None
            else None
        )
        hi = f"{_num(self.le)}]" if self.le is not None else None
        if lo is not None and hi is not None:
            rule = f"in {lo}, {hi}"
        elif lo is not None:
            rule = f"{'>=' if self.ge is not None else '>'} {lo[1:]}"
        elif hi is not None:
            rule = f"<= {hi[:-1]}"
        else:
            rule = ""
        return f"an integer {rule}".strip() if self.integer else rule

    def problem(self, value: Any) -> str | None:
        """Why ``value`` breaks the rule (e.g. ``must be in [0, 100], got 101``), or None if it keeps it."""
        if value is None:
            return None
        if self.choices is not None:
            return (
                None if value in self.choices else f"must be one of {', '.join(self.choices)}, got {value!r}"
            )
        if self.ge is None and self.gt is None and self.le is None and not self.integer:
            return None
        values = value.values() if self.each and isinstance(value, Mapping) else [value]
        for v in values:
            if not _within(v, self.ge, self.gt, self.le, self.integer):
                return f"must be {self.describe()}, got {v!r}"
        return None


def knob(default: Any = None, help: str = "", *, factory: Any = None, **rule: Any) -> Any:
    """A dataclass field with a ``Spec`` (``rule``: choices, ge, gt, le, each, integer, cli)."""
    metadata = {"spec": Spec(help, **rule)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def spec(cls: Any, name: str) -> Spec:
    return next(f.metadata["spec"] for f in dataclasses.fields(cls) if f.name == name)


def problems(obj: Any) -> Iterator[tuple[str, str]]:
    """(field, what is wrong) for each field of ``obj`` that breaks its spec, in declaration order."""
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("spec")
        if rule is not None and (why := rule.problem(getattr(obj, f.name))) is not None:
            yield f.name, why


def range_meta(cls: Any, name: str, upper: float | None = None) -> dict[str, Any]:
    """The keyword arguments of ``msgspec.Meta`` for field ``name``'s range (``upper`` caps ``le``)."""
    rule = spec(cls, name)
    le = rule.le if upper is None else upper if rule.le is None else min(rule.le, upper)
    bounds = {"ge": rule.ge, "gt": rule.gt, "le": le}
    kind = int if rule.integer else float  # msgspec wants an int type's bounds as ints
    return {k: kind(v) for k, v in bounds.items() if v is not None}


# -- the command line ---------------------------------------------------------------------------------
def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(
    parser: argparse.ArgumentParser | Any,
    cls: Any,
    only: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One flag per field of ``cls`` that has ``cli`` set (or per name in ``only``), named after it
    (``max_model_len`` -> ``--max-model-len``; a bool that defaults to True -> ``--no-NAME``). The value
    is checked at parse time against the field's spec, so the error names the flag."""
    wanted = None if only is None else set(only)
    overrides = dict(defaults or {})
    for f in dataclasses.fields(cls):
        rule = f.metadata.get("spec")
        if rule is None or (wanted is None and not rule.cli) or (wanted is not None and f.name not in wanted):
            continue
        default = overrides.get(f.name, f.default)
        if default is True:
            parser.add_argument(flag("no_" + f.name), dest=f.name, action="store_false", help=rule.help)
        elif default is False:
            parser.add_argument(flag(f.name), dest=f.name, action="store_true", help=rule.help)
        else:
            kind = _TYPES[str(f.type).split(" | ")[0]]
            text = (
                rule.help
                if default is None or "default" in rule.help
                else f"{rule.help} (default: {default})"
            )
            parser.add_argument(
                flag(f.name),
                dest=f.name,
                default=default,
                type=_checked(kind, rule),
                choices=rule.choices,
                help=text,
            )


def values(cls: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` that ``args`` holds, as keyword arguments for ``cls``."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def _checked(kind: type, rule: Spec) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind.__name__} expected, got {text!r}") from None
        why = None if rule.choices is not None else rule.problem(value)  # argparse checks choices itself
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _within(v: Any, ge: float | None, gt: float | None, le: float | None, integer: bool) -> bool:
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        return False
    # Written so that NaN fails every bound.
    return (ge is None or v >= ge) and (gt is None or v > gt) and (le is None or v <= le)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
