"""Where a field command's options come from: flag, then ``FEDSGA_EDGE_<NAME>``, then a TOML file, then the default.

The layering is click's own (an option's ``envvar``, then ``ctx.default_map``); this module gives every
option its variable, reads and checks the ``--config-file`` TOML into the defaults, and says where an
option that was set came from (``explicit``), so a conflict names its source.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

__all__ = ["CONFIG_FILE_ENV", "ENV_PREFIX", "explicit", "layered"]

ENV_PREFIX = "FEDSGA_EDGE_"
CONFIG_FILE_ENV = "FEDSGA_EDGE_CONFIG"  # the TOML file; so --config (a run config JSON) reads another variable
_ENVVAR_OF = {"config": "FEDSGA_EDGE_RUN_CONFIG"}
_SOURCES = {"COMMANDLINE": "command line", "ENVIRONMENT": "environment", "DEFAULT_MAP": "config file"}


def layered(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every option of ``fn`` can also come from ``FEDSGA_EDGE_<NAME>`` and from a TOML file.

    No precedence code of our own: click takes a value from the command line, then the option's
    ``envvar``, then ``ctx.default_map``, then the default. The eager ``--config-file`` (or
    ``$FEDSGA_EDGE_CONFIG``) callback fills ``default_map`` from the file before any other option
    is read. Apply after ``with_run_options`` so the run options get the same layers.
    """
    params = []
    for p in inspect.signature(fn).parameters.values():
        info = p.default
        if isinstance(info, typer.models.OptionInfo) and not info.envvar:
            info = copy.copy(info)  # never change a shared OptionInfo in place
            info.envvar = _ENVVAR_OF.get(p.name, ENV_PREFIX + p.name.upper())
            p = p.replace(default=info)
        params.append(p)
    params.append(inspect.Parameter("config_file", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[Path],
                                    default=typer.Option(
        None, "--config-file", envvar=CONFIG_FILE_ENV, is_eager=True, expose_value=False, callback=_read_config_file,
        help="A TOML file of defaults: keys are the option names with underscores (state_dir = \"...\"). "
             "Command-line flags, then FEDSGA_EDGE_<NAME> variables, override it.")))
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return fn


def _read_config_file(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    """``--config-file``: the file's keys become the command's defaults (``ctx.default_map``)."""
    if value is not None:
        ctx.default_map = {**(ctx.default_map or {}), **_toml_defaults(ctx, Path(value))}
        ctx.meta["fedsga_config_file"] = str(value)
    return value


def _toml_defaults(ctx: typer.Context, path: Path) -> dict[str, Any]:
    """The file's values, each checked against its option: an unknown key or a wrong type names the
    key and the file (a typo must not silently leave an option at its default)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10 (pyproject installs tomli there)
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise typer.BadParameter(f"{path} is not valid TOML: {exc}") from None
    options = {p.name: p for p in ctx.command.params if p.expose_value and p.name}
    for key, value in data.items():
        opt = options.get(key)
        if opt is None:
            near = difflib.get_close_matches(key.replace("-", "_"), list(options), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise typer.BadParameter(f"{path}: unknown key {key!r}{hint}; the keys are this command's option "
                                     "names with underscores (see --help)")
        kind, many = _toml_kind(opt)
        bad = _toml_mismatch(value, kind, many)
        if bad:
            raise typer.BadParameter(f"{path}: key {key!r} must be {bad}, not {_toml_type(value)} {value!r:.80}")
    return data


def _toml_kind(opt: Any) -> tuple[str, bool]:
    """(the TOML type an option takes, whether it takes a list of them), from its annotation."""
    many = bool(getattr(opt, "multiple", False))
    if not hasattr(opt, "type_descriptor"):  # typer before 0.2x: a click parameter type
        name = getattr(getattr(opt, "type", None), "name", "")
        kind = "boolean" if getattr(opt, "is_flag", False) or name == "boolean" else \
            "integer" if name.startswith("integer") else "number" if name.startswith("float") else "string"
        return kind, many
    annotation = opt.type_descriptor.annotation
    if many and typing.get_args(annotation):
        annotation = typing.get_args(annotation)[0]
    if getattr(opt, "is_flag", False) or annotation is bool:
        return "boolean", many
    kinds = {int: "integer", float: "number"}
    return kinds.get(annotation, "string"), many


def _toml_mismatch(value: Any, kind: str, many: bool) -> str | None:
    """What ``value`` should have been, or None when it fits (bool is no number here, unlike Python)."""
    if many:
        if not isinstance(value, list) or any(_toml_mismatch(v, kind, False) for v in value):
            return f"an array of {kind}s"
        return None
    ok = {"boolean": isinstance(value, bool),
          "integer": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "string": isinstance(value, str)}[kind]
    return None if ok else f"an {kind}" if kind == "integer" else f"a {kind}"


def _toml_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


def explicit(ctx: typer.Context | None, names: typing.Iterable[str]) -> list[str]:
    """Which of ``names`` were set on purpose, and where (command line, environment, config file)."""
    if ctx is None:
        return []
    given = []
    for name in names:
        source = ctx.get_parameter_source(name)
        where = _SOURCES.get(getattr(source, "name", ""))
        if where == "environment":
            given.append(f"{ENV_PREFIX}{name.upper()} (environment)")
        elif where == "config file":
            given.append(f"{name} (config file {ctx.meta.get('fedsga_config_file')})")
        elif where:
            given.append(f"--{name.replace('_', '-')} (command line)")
    return given
