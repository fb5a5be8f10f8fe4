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

__all__ = ["MAX_SAMPLE_S", "MAX_TEXT", "ProfileError", "check_model", "fitting_splits", "hello_profile",
           "hello_profile_problem", "profile_latency", "read_profile", "reported_latency", "split_latency",
           "split_peak_mb"]

MAX_TEXT = 120  # characters of the hello's runtime and cpu strings
MAX_SAMPLE_S = 3600.0  # seconds per sample: more is no device a run could wait for, so no measurement either
MAX_MB = 1e7  # megabytes of a peak or a budget: more is no device's memory
_FIELDS = ("model", "runtime", "cpu", "sample_s", "peak_mb", "memory_mb")


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


def split_peak_mb(report: Any, K: int) -> dict[int, float]:
    """Per split 1..K, the largest resident memory (MB) the profile measured running it (``rss_peak_mb`` of
    its rows, any variant or batch): what the device needs to train there. Empty when the profile has none."""
    rows = report.get("results") if isinstance(report, dict) else report
    out: dict[int, float] = {}
    for row in rows if isinstance(rows, list) else []:
        k, mb = (row.get("split"), row.get("rss_peak_mb")) if isinstance(row, dict) else (None, None)
        if _is_int(k) and 1 <= k <= K and _is_number(mb) and 0 < mb <= MAX_MB:
            out[k] = max(out.get(k, 0.0), float(mb))
    return dict(sorted(out.items()))


def hello_profile(report: Any, model: str, K: int, *, width: float | None = None,
                  where: str = "profile", memory_mb: float | None = None) -> dict[str, Any]:
    """What a device's hello says of its profile: the model, the runtime and CPU it was measured on, the
    seconds per sample at each split 1..K (``sample_s``, keyed "1".."K"): K numbers, whatever the
    file's size; the peak memory per split where the profile measured it (``peak_mb``) and the device's
    memory budget (``memory_mb``, its ``--memory-mb``). ProfileError when the profile is of another model
    (or width) or lacks a split, or when a budget is given and the profile measured no peak or no split fits."""
    check_model(report, model, width=width, where=where)
    out: dict[str, Any] = {"model": model,
                           "sample_s": {str(k): s for k, s in split_latency(report, K, where).items()}}
    peaks = split_peak_mb(report, K)
    if len(peaks) == K:
        out["peak_mb"] = {str(k): mb for k, mb in peaks.items()}
    if memory_mb is not None:
        if not (_is_number(memory_mb) and 0 < memory_mb <= MAX_MB):
            raise ProfileError(f"--memory-mb must be a number of megabytes in (0, {MAX_MB:g}] (got {memory_mb!r})")
        if len(peaks) != K:
            raise ProfileError(f"--memory-mb needs the peak memory of every split, and {where} has rss_peak_mb for "
                               f"split(s) {sorted(peaks) or 'none'} of 1..{K} (profile it with `fedsga-edge profile`)")
        if min(peaks.values()) > memory_mb:
            raise ProfileError(f"--memory-mb {memory_mb:g}: no split fits; {where} measured at least "
                               f"{min(peaks.values()):.0f} MB (split {min(peaks, key=peaks.__getitem__)})")
        out["memory_mb"] = float(memory_mb)
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
    peaks, budget = value.get("peak_mb"), value.get("memory_mb")
    if peaks is not None and not (isinstance(peaks, dict) and set(peaks) == {str(k) for k in range(1, K + 1)}
                                  and all(_is_number(mb) and 0 < mb <= MAX_MB for mb in peaks.values())):
        return f"profile.peak_mb must map \"1\"..\"{K}\" to megabytes in (0, {MAX_MB:g}]"
    if budget is not None and not (peaks is not None and _is_number(budget) and 0 < budget <= MAX_MB):
        return f"profile.memory_mb must be megabytes in (0, {MAX_MB:g}], beside profile.peak_mb"
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


def fitting_splits(value: dict[str, Any]) -> set[int] | None:
    """The splits whose measured peak fits a checked hello ``profile``'s memory budget; None: no budget given."""
    if value.get("memory_mb") is None or value.get("peak_mb") is None:
        return None
    return {int(k) for k, mb in value["peak_mb"].items() if float(mb) <= float(value["memory_mb"])}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
