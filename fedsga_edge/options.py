"""One declaration per run option: its type, default, help, allowed range or choices and CLI spelling.

A config dataclass declares each field with ``opt(...)`` (the type is the field's annotation); a
strategy lists ``Opt("name", type, default, help, ...)`` in its ``options``. Everything else is
derived from these declarations: the command-line options of ``simulate`` and the field commands
(and so their environment and TOML keys), the range and choice checks with messages that name the
flag, the config's defaults and the benchmark's overrides. Plain data: no torch, no CLI library.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Opt", "opt", "declared", "problems", "check", "class_options", "resolve_args", "to_config", "override"]


class _Unset:
    """Marks "not given" where None is a real value (a default of None)."""

    def __repr__(self) -> str:
        return "<unset>"


_MISSING: Any = _Unset()


@dataclass(frozen=True)
class Opt:
    """One option. ``name`` is the config key, ``flag`` its command-line spelling (default
    ``--name`` with dashes); ``key`` is the dotted path in the config (``train.lr``), filled in by
    ``declared``. A value ``v`` is allowed when ``ge <= v``, ``gt < v``, ``v <= le``, ``v < lt``,
    it is finite (``finite``) and one of ``choices``, each only where given."""

    name: str
    type: Any = None  # int | float | str | bool | dict | list; a field's annotation, else the default's type
    default: Any = None
    help: str = ""
    flag: str = ""  # "--mu", "--no-adapt" (negated), "--augment/--no-augment"
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = False
    choices: tuple[str, ...] = ()
    dashed: bool = False  # spelt with '-' on the command line, stored with '_' (round-robin -> round_robin)
    negated: bool = False  # the flag switches the value off: --no-adapt -> adapt = False
    path: bool = False  # a file or folder: a Path on the command line, a str (or None) in the config
    nullable: bool = False  # None is allowed (and means "auto" or "unset", as the help says)
    cli: bool = True  # False: set by code, not a flag (the devices' proximal weight comes from the strategy)
    note: str = ""  # appended to the range message: "0 = all"
    message: str = ""  # the whole range message, where one rule covers several options
    when: Callable[[Any], bool] | None = None  # check the range only when this holds for the owning config
    parse: Callable[[Any], Any] | None = None  # command-line value -> config value (KEY=VALUE list -> dict)
    cli_type: Any = None  # the command-line type where it differs (list[str] for a KEY=VALUE list)
    cli_default: Any = _MISSING  # the command-line default where it differs from ``default``
    factory: Callable[[], Any] | None = None  # for mutable defaults (dict, list)
    key: str = ""

    @property
    def flags(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def first_flag(self) -> str:
        return self.flags.split("/")[0]

    @property
    def param(self) -> str:
        """The command-line parameter's name: its TOML key and ``FEDSGA_EDGE_<PARAM>`` variable."""
        return self.first_flag.lstrip("-").replace("-", "_")

    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default

    def command_line_default(self) -> Any:
        if self.cli_default is not _MISSING:
            return self.cli_default
        if self.negated:
            return not self.default
        if self.dashed and isinstance(self.default, str):
            return self.default.replace("_", "-")
        return self.default_value()


def opt(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None, **kw: Any) -> Any:
    """A dataclass field that carries its option declaration (name and type come from the field)."""
    decl = Opt(name="", default=None if default is dataclasses.MISSING else default, help=help, factory=factory, **kw)
    meta = {"opt": decl}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@functools.lru_cache(maxsize=None)
def declared(cls: type, prefix: str = "") -> tuple[Opt, ...]:
    """Every option of a config dataclass, nested dataclass fields expanded (``train.lr``), in field order."""
    hints = typing.get_type_hints(cls)
    out: list[Opt] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out += declared(kind, f"{prefix}{f.name}.")
            continue
        decl = f.metadata.get("opt")
        if decl is None:
            continue
        base, nullable = _unwrap_optional(kind)
        out.append(dataclasses.replace(decl, name=f.name, key=prefix + f.name, type=base,
                                       nullable=decl.nullable or nullable))
    return tuple(out)


def _unwrap_optional(kind: Any) -> tuple[Any, bool]:
    """``float | None`` -> (float, True); ``dict[str, Any]`` -> (dict, False)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (typing.get_origin(rest[0]) or rest[0]), True
    return (typing.get_origin(kind) or kind), False


def to_config(o: Opt, value: Any) -> Any:
    """The config value a command-line value stands for."""
    if o.parse is not None:
        return o.parse(value)
    if o.negated:
        return not value
    if o.path:
        return str(value) if value else None
    if o.dashed and isinstance(value, str):
        return value.replace("-", "_")
    return value


def override(obj: Any, values: Mapping[str, Any]) -> Any:
    """A copy of config dataclass ``obj`` with dotted keys replaced (``{"fedsga.adapt": False}``); a dict
    field takes its keys merged in (``{"strategy_args.branches": 2}``)."""
    if isinstance(obj, dict):
        return {**obj, **values}
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for head, inner in nested.items():
        top[head] = override(getattr(obj, head), inner)
    return dataclasses.replace(obj, **top)


# -- checks ------------------------------------------------------------------------------------------

def check(o: Opt, value: Any) -> str | None:
    """What is wrong with ``value`` for option ``o``, naming its flag; None when it is allowed."""
    if value is None and o.nullable:
        return None
    flag = o.first_flag
    if o.choices:
        shown = [c.replace("_", "-") for c in o.choices] if o.dashed else list(o.choices)
        if value not in o.choices:
            return f"{flag} must be one of {', '.join(shown)} (got {value!r})"
        return None
    if not _has_range(o):
        return None
    if not _is_type(o.type, value):
        return o.message or f"{flag} must {_requirement(o, typed=True)} (got {value!r})"
    ok = (o.ge is None or value >= o.ge) and (o.gt is None or value > o.gt) and \
        (o.le is None or value <= o.le) and (o.lt is None or value < o.lt) and \
        (not o.finite or math.isfinite(value))
    if ok:
        return None
    note = f" ({o.note})" if o.note else ""
    return o.message or f"{flag} must {_requirement(o, typed=False)}{note}"


def problems(obj: Any, opts: Iterable[Opt] | None = None) -> list[str]:
    """Every declared option of the config object ``obj`` that is out of range (nested ones too)."""
    out: list[str] = []
    for o in declared(type(obj)) if opts is None else opts:
        owner = obj
        for part in o.key.split(".")[:-1]:
            owner = getattr(owner, part)
        if o.when is not None and not o.when(owner):
            continue
        bad = check(o, getattr(owner, o.name))
        if bad and bad not in out:  # one message may cover several options (--tau-a and --tau-m)
            out.append(bad)
    return out


def class_options(cls: type) -> tuple[Opt, ...]:
    """The options a class lists in ``options`` (a strategy's), inherited ones included. Each is
    flagged ``--<name of the class that lists it>-<option>`` unless its declaration spells a flag,
    so two strategies never claim one flag and a subclass shares its parent's."""
    out = []
    for o in getattr(cls, "options", ()):
        owner = next((c for c in cls.__mro__ if o in vars(c).get("options", ())), cls)
        prefix = getattr(owner, "name", "") or getattr(cls, "name", "")
        out.append(dataclasses.replace(o, flag=o.flag or f"--{prefix}-{o.name}".replace("_", "-"),
                                       type=o.type or type(o.default), key=f"strategy_args.{o.name}"))
    return tuple(out)


def resolve_args(opts: Sequence[Opt], given: Mapping[str, Any]) -> dict[str, Any]:
    """A strategy's arguments: ``given`` (``cfg.strategy_args``) over the declared defaults, checked.

    Raises ValueError naming the flag of every unknown or out-of-range argument."""
    known = {o.name: o for o in opts}
    bad = [f"unknown strategy argument {k!r} (known: {', '.join(known) or 'none'})" for k in given if k not in known]
    args = {o.name: given.get(o.name, o.default_value()) for o in opts}
    bad += [m for o in opts if (m := check(o, args[o.name]))]
    if bad:
        raise ValueError("; ".join(bad))
    return args


def _has_range(o: Opt) -> bool:
    return any(b is not None for b in (o.ge, o.gt, o.le, o.lt)) or o.finite


def _requirement(o: Opt, typed: bool) -> str:
    """"be a finite number > 0", "lie in [0, 1)", "be an integer >= 0" (typed: the value's type was wrong)."""
    bounds = _bounds(o)
    noun = "a finite number" if o.finite else \
        {int: "an integer", float: "a number"}.get(o.type, f"a {getattr(o.type, '__name__', o.type)}") if typed else ""
    if _two_sided(o):
        return f"be {noun} in {bounds}" if noun else f"lie in {bounds}"
    return " ".join(w for w in ("be", noun, bounds) if w)


def _two_sided(o: Opt) -> bool:
    return (o.ge is not None or o.gt is not None) and (o.le is not None or o.lt is not None)


def _bounds(o: Opt) -> str:
    if _two_sided(o):
        low = f"[{_num(o.ge)}" if o.ge is not None else f"({_num(o.gt)}"
        high = f"{_num(o.le)}]" if o.le is not None else f"{_num(o.lt)})"
        return f"{low}, {high}"
    for sign, bound in ((">=", o.ge), (">", o.gt), ("<=", o.le), ("<", o.lt)):
        if bound is not None:
            return f"{sign} {_num(bound)}"
    return ""


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _is_type(kind: Any, value: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return kind is None or isinstance(value, kind)
