"""The run options as typer parameters, built from their declarations (``fedsga_edge.options``).

``with_run_options(fn)`` gives a command every run option (the config's and every registered
strategy's) by rewriting its signature, which is what typer reads; the command takes them as
``**flags`` and turns them into a RunConfig with ``run_config``. Nothing here is per option.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from fedsga_edge.config import RunConfig, run_options
from fedsga_edge.options import Opt, class_options

if TYPE_CHECKING:
    from fedsga_edge.coordinator.strategy import Strategy

__all__ = ["with_run_options", "run_config", "config_from_flags", "run_flags", "strategy_options", "strategy_help",
           "option_help"]

_PANELS = {"train.": "Local training", "fedsga.": "FedSGA"}


def _strategies() -> dict[str, type["Strategy"]]:
    from fedsga_edge.coordinator.strategy import get_strategy, list_strategies  # torch-free

    return {name: get_strategy(name) for name in list_strategies()}


def strategy_help() -> str:
    """``--strategy``'s help: every registered strategy with its one-line help."""
    return " | ".join(f"{name}: {cls.help}" if cls.help else name for name, cls in _strategies().items())


def _models_help() -> str:
    from fedsga_edge.models import models_help  # torch-free: read from the backbone modules' source

    return models_help()


# Options whose values are a registry's names: the help lists them as the registry is now.
_LISTED: dict[str, Callable[[], str]] = {"strategy": strategy_help, "model": _models_help}


def strategy_options() -> dict[str, tuple[Opt, list[str]]]:
    """Every registered strategy's own options: parameter name -> (declaration, the strategies that take it).
    Flags as ``class_options`` spells them (``--<strategy>-<name>``)."""
    out: dict[str, tuple[Opt, list[str]]] = {}
    for name, cls in _strategies().items():
        for decl in class_options(cls):
            if decl.param in out and out[decl.param][0] != decl:
                raise ValueError(f"strategy {name!r} declares {decl.first_flag} unlike {out[decl.param][1]}")
            if any(r.param == decl.param for r in run_options() if r.cli):
                raise ValueError(f"strategy {name!r} declares {decl.first_flag}, a run option already")
            out.setdefault(decl.param, (decl, []))[1].append(name)
    return out


def run_flags() -> tuple[str, ...]:
    """The parameter names of every run option (the config's, then the strategies')."""
    return tuple(o.param for o in run_options() if o.cli) + tuple(strategy_options())


def run_config(**flags: Any) -> RunConfig:
    """The RunConfig that the run flags describe (absent ones at their defaults); a bad value is the user's."""
    try:
        return config_from_flags(flags)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def config_from_flags(flags: dict[str, Any], strict: bool = True) -> RunConfig:
    """``run_config`` raising ValueError. A strategy's option lands in ``strategy_args`` when that
    strategy runs; set to another value than its default for another strategy, it is refused
    (``strict``) or left out (the benchmark, which runs several strategies with one set of flags)."""
    own = strategy_options()
    strategy = flags.get("strategy", RunConfig.strategy)
    chosen = [o for o, users in own.values() if strategy in users]
    for param, (o, users) in own.items():
        if strict and strategy not in users and param in flags and flags[param] != o.command_line_default():
            raise ValueError(f"{o.first_flag} applies to --strategy {' or '.join(users)} only")
    if strict:  # run options only some strategies read (FedSGA's --rho ..., FedProx's --mu): the same rule
        owners: dict[str, list[str]] = {}
        for name, cls in _strategies().items():
            for key in cls.owns_options:
                owners.setdefault(key, []).append(name)
        for o in run_options():
            # the key itself ("prox_mu") or its group ("fedsga" for "fedsga.rho"), each owner once
            users = list(dict.fromkeys(owners.get(o.key, []) + owners.get(o.key.split(".")[0], [])))
            if users and strategy not in users and o.cli and o.param in flags \
                    and flags[o.param] != o.command_line_default():
                raise ValueError(f"{o.first_flag} applies to --strategy {' or '.join(users)} only")
    return RunConfig.from_flags({k: v for k, v in flags.items() if k not in own or own[k][0] in chosen}, chosen)


def option_help(o: Opt) -> str:
    """The declared help, with the registry's names where the values are a registry's (--strategy, --model)."""
    listed = _LISTED.get(o.key)
    return f"{o.help}: {listed()}" if listed else o.help


def typer_parameter(o: Opt, panel: str | None = None) -> inspect.Parameter:
    """One declaration as the parameter typer reads."""
    info = typer.Option(o.command_line_default(), o.flags, help=option_help(o), rich_help_panel=panel)
    return inspect.Parameter(o.param, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info, annotation=_annotation(o))


def _annotation(o: Opt) -> Any:
    kind = o.cli_type or (bool if o.negated else Path if o.path else o.type)
    return Optional[kind] if o.nullable and not o.negated else kind


def run_parameters() -> list[inspect.Parameter]:
    params = [typer_parameter(o, next((p for k, p in _PANELS.items() if o.key.startswith(k)), None))
              for o in run_options() if o.cli]
    for o, users in strategy_options().values():
        params.append(typer_parameter(o, f"Strategy {' / '.join(users)}"))
    return params


def with_run_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``fn`` (which takes ``**flags``) every run option; typer reads the signature. Applying it
    again rebuilds them from the registry as it is now (a strategy registered since shows up)."""
    own = getattr(fn, "_own_parameters", None)
    if own is None:
        hints = typing.get_type_hints(fn)  # real types: typer resolves string annotations in the wrong module
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
        fn._own_parameters = own  # type: ignore[attr-defined]
    names = {p.name for p in own}

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    # a new function each time: an app built earlier keeps the options it was built with (a strategy
    # registered and removed by a test must not leave its option on every later app)
    command.__signature__ = inspect.Signature(own + [p for p in run_parameters() if p.name not in names])  # type: ignore[attr-defined]
    return command
