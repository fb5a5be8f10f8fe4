"""A device's measured latency per split: read from `fedsga-edge profile --json`, summarised for its hello.

One reader serves both sides: the coordinator's ``--profile`` (one measured device, the median one, for
``--strategy resource``) and a device's own ``--latency-profile``, which the device sends, summarised and
bounded, in its ``hello`` (docs/protocol.md). The coordinator checks what arrives (``hello_profile_problem``)
as it checks every other field a device sends. json and math only: a torch-free device reads it too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["MAX_SAMPLE_S", "MAX_TEXT", "ProfileError", "check_model", "hello_profile", "hello_profile_problem",
           "profile_latency", "read_profile", "reported_latency", "split_latency"]

MAX_TEXT = 120  # characters of the hello's runtime and cpu strings
MAX_SAMPLE_S = 3600.0  # seconds per sample: more is no device a run could wait for, so no measurement either
_FIELDS = ("model", "runtime", "cpu", "sample_s")


class ProfileError(ValueError):
    """A profile that cannot be used: the message names the file (or the field) and what is wrong."""


def read_profile(path: str | Path) -> Any:
    """The parsed JSON of a profile file; ProfileError for a missing, unreadable or non-JSON file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"profile {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profile {p} cannot be read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {p} is not JSON ({exc}): give the file `fedsga-edge profile --json` wrote") from None


def profile_latency(path: str | Path, K: int) -> dict[int, float]:
    """``split_latency`` of the profile file at ``path``."""
    return split_latency(read_profile(path), K, f"profile {path}")


def split_latency(report: Any, K: int, where: str = "profile") -> dict[int, float]:
    """Per-sample p50 seconds for splits 1..K: the fp32 train step where it was measured (what a training
    device pays), else the forward; at the largest batch profiled. ProfileError names a malformed row."""
    rows = report.get("results") if isinstance(report, dict) else report
    if not isinstance(rows, list):
        raise ProfileError(f"{where} has no 'results' list (is it the JSON of `fedsga-edge profile --json`?)")
    best: dict[int, tuple[int, float]] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or row.get("variant", "fp32") != "fp32":
            continue
        stats = row.get("train_step_ms") or row.get("latency_ms")
        if not stats:
            continue
        k, batch = row.get("split"), row.get("batch", 1)
        p50 = stats.get("p50") if isinstance(stats, dict) else None
        if not (_is_int(k) and _is_int(batch) and batch >= 1 and _is_number(p50)):
            raise ProfileError(f"{where}: results[{i}] needs an integer split and batch and a numeric p50")
        seconds = p50 / 1e3 / batch
        if not 0 < seconds <= MAX_SAMPLE_S:
            raise ProfileError(f"{where}: results[{i}] has {seconds:g} s per sample (not in (0, {MAX_SAMPLE_S:g}])")
        if 1 <= k <= K and (k not in best or batch > best[k][0]):
            best[k] = (batch, seconds)
    missing = [k for k in range(1, K + 1) if k not in best]
    if missing:
        raise ProfileError(f"{where} has no fp32 latency for split(s) {missing}")
    return {k: s for k, (_, s) in sorted(best.items())}


def hello_profile(report: Any, model: str, K: int, *, width: float | None = None,
                  where: str = "profile") -> dict[str, Any]:
    """What a device's hello says of its profile: the model, the runtime and CPU it was measured on, and
    the seconds per sample at each split 1..K (``sample_s``, keyed "1".."K"): K numbers, whatever the
    file's size. ProfileError when the profile is of another model (or width) or lacks a split."""
    check_model(report, model, width=width, where=where)
    out: dict[str, Any] = {"model": model,
                           "sample_s": {str(k): s for k, s in split_latency(report, K, where).items()}}
    device = report.get("device")
    for key in ("runtime", "cpu"):
        value = device.get(key) if isinstance(device, dict) else None
        if isinstance(value, str) and value:
            out[key] = value[:MAX_TEXT]
    return out


def check_model(report: Any, model: str, *, width: float | None = None, where: str = "profile") -> None:
    """ProfileError unless the profile measured ``model`` (and ``width``, where both are given)."""
    info = report.get("model") if isinstance(report, dict) else None
    arch = info.get("arch") if isinstance(info, dict) else None
    if not isinstance(arch, str):
        raise ProfileError(f"{where} does not name its model (model.arch): is it the JSON of `fedsga-edge profile "
                           "--json`?")
    if arch != model:
        raise ProfileError(f"{where} measured model {arch!r:.80}, but this run trains {model!r}")
    measured = info.get("width")
    if width is not None and _is_number(measured) and not math.isclose(measured, width):
        raise ProfileError(f"{where} measured {model} at width {measured:g}, but this run's --width is {width:g}")


def hello_profile_problem(value: Any, model: str, K: int) -> str | None:
    """Why a hello's ``profile`` field is refused (None: it is not): a map of the known fields, this run's
    model, short strings, and exactly the splits "1".."K" with finite seconds in (0, MAX_SAMPLE_S]."""
    if not isinstance(value, dict):
        return "profile must be a map"
    unknown = [str(k)[:40] for k in value if k not in _FIELDS]
    if unknown:
        return f"profile has unknown field(s) {sorted(unknown)[:5]} (known: {', '.join(_FIELDS)})"
    if value.get("model") != model:
        return f"profile is of model {value.get('model')!r:.80}, but this run trains {model!r}"
    for key in ("runtime", "cpu"):
        if key in value and not (isinstance(value[key], str) and len(value[key]) <= MAX_TEXT):
            return f"profile.{key} must be a string of at most {MAX_TEXT} characters"
    seconds = value.get("sample_s")
    if not isinstance(seconds, dict):
        return "profile.sample_s must be a map of split -> seconds per sample"
    if len(seconds) != K or set(seconds) != {str(k) for k in range(1, K + 1)}:
        return f"profile.sample_s must have the keys \"1\"..\"{K}\" (every split of {model}), exactly"
    for k, s in seconds.items():
        if not (_is_number(s) and 0 < s <= MAX_SAMPLE_S):
            return f"profile.sample_s[{k}] must be a finite number of seconds in (0, {MAX_SAMPLE_S:g}]"
    return None


def reported_latency(value: dict[str, Any]) -> dict[int, float]:
    """A checked hello ``profile``'s seconds per sample by split index."""
    return {int(k): float(s) for k, s in value["sample_s"].items()}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
