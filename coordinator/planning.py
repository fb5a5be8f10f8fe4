"""How long a device's round takes at each split, before the round: what the round carries at split k (its
FLOPs, its bytes each way and its round trips, from the cost table) over the device's rates (its fleet class,
or what its last round measured). Shared by the ``planner`` strategy and FedSGA's ``--deadline-aware``
(docs/fleet.md, "Planning splits"), so both predict a round the same way; torch-free.

A device's measured rates come from the round's ``timing`` (the virtual clock's in ``simulate --fleet``, the
devices' own in a field run; fedsga_edge/runfiles.py ``device_timing``): its compute speed is the FLOPs of the
split it trained over its compute seconds (a first round's warm-up taken out), its link rate the bytes both
ways over its wire seconds (the round trips' delays folded in).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from fedsga_edge.method.policy import reference_index

__all__ = ["MeasuredRate", "FleetRates", "SplitLoad", "measured_rate", "predicted_split_s", "split_loads"]

# Bytes one activation or gradient value takes on the wire per --wire-format (docs/protocol.md, "Messages"): int4
# packs two values a byte plus a float32 scale per 256 values. Weights, labels and probes are counted as fp32/int64.
VALUE_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 256}
# A message's envelope, keys and small fields, each way, and a margin on the whole: the prediction should err long,
# not short (against the virtual clock it was within 0.5 % either way without the margin: benchmarks/RESULTS.md).
MESSAGE_BYTES = 256
MARGIN = 1.01


def _batches(n: int, batch_size: int, max_batches: int) -> int:
    """Batches a device with ``n`` samples cuts per local epoch (a last batch under 2 samples joins the one before:
    coordinator/server.py ``samples_per_epoch``), capped at ``max_batches``."""
    count = max(1, -(-n // batch_size))
    if count > 1 and n - batch_size * (count - 1) < 2:
        count -= 1
    return min(count, max_batches) if max_batches else count


def _probe_slice(n: int, fraction: float) -> int:
    """Samples a device holds out for its probe (device/role.py ``hold_out_probe``; all of them without a slice)."""
    if fraction <= 0 or n < 4:
        return n
    return min(max(2, int(round(fraction * n))), n - 2)


@dataclass(frozen=True)
class SplitLoad:
    """What one device's round carries at one split: FLOPs on the device, bytes up and down, round trips."""

    flops: float
    up: float
    down: float
    trips: float


def split_loads(costs: Any, num_samples: int, cfg: Any, *, calibrate: bool = False, probe_holdout: float | None = None,
                h1_dim: int = 0, weight_bytes: dict[int, float] | None = None, extra_down: float = 0.0,
                eval_samples: int = 0, wire_format: str | None = None) -> dict[int, SplitLoad]:
    """Each split k = 1..K's ``SplitLoad`` for a device holding ``num_samples`` (|D_i| as it registered).

    Compute: the samples trained (less the slice ``probe_holdout`` holds out for FedSGA's probe; None: no probe;
    x local epochs, batches as the device cuts them) x the prefix's training FLOPs at k, plus the probe's forward
    to p_ref on a calibration round
    and the forward of ``eval_samples`` held-out samples in an evaluation round (docs/protocol.md, "Federated
    evaluation"). Up: per sample its activation at k in the wire format, its label and its pooled p_1 features
    (``h1_dim`` floats; FedSGA's), the held-out samples' activations, then the update's weights up to p_k
    (``weight_bytes[k]``, default 4 bytes a parameter). Down: the gradients, the weights up to p_k (round start
    plus fetch) and ``extra_down`` (the round start's method state). Each message ``MESSAGE_BYTES`` more each
    way; a round trip per request and half of one for the round start."""
    from fedsga_edge.coordinator.server import samples_per_epoch

    tc = cfg.train
    held = _probe_slice(num_samples, probe_holdout) if probe_holdout is not None else num_samples
    n = num_samples - held if held < num_samples else num_samples
    seen = tc.local_epochs * samples_per_epoch(n, tc.batch_size, tc.max_batches, tc.batching)
    requests = tc.local_epochs * _batches(n, tc.batch_size, tc.max_batches)
    evals = -(-eval_samples // tc.batch_size) if eval_samples > 0 else 0
    value = VALUE_BYTES[wire_format or cfg.wire_format]
    K = len(costs.prefix)
    ref = reference_index(K)
    probe = min(tc.batch_size, held) if calibrate and probe_holdout is not None else 0
    out = {}
    for k in range(1, K + 1):
        elems = costs.prefix[k].activation_elems
        weights = float(weight_bytes[k]) if weight_bytes is not None else 4.0 * costs.params[k]
        flops = seen * costs.train(k) + probe * costs.prefix_fwd(ref) + eval_samples * costs.prefix_fwd(k)
        messages = requests + evals + 1 + (1 if k > 1 else 0) + (1 if probe else 0)  # batches, evals, update, fetch
        up = seen * (elems * value + 8 + 4 * h1_dim) + weights + messages * MESSAGE_BYTES
        up += probe * (4 * (costs.prefix[1].activation_elems + costs.prefix[ref].activation_elems) + 8)
        up += eval_samples * (elems * value + 8)
        down = seen * elems * value + weights + extra_down + (messages + 1) * MESSAGE_BYTES  # + the round start
        out[k] = SplitLoad(float(flops), float(up), float(down), 0.5 + messages)
    return out


def predicted_split_s(cls: Any, costs: Any, num_samples: int, cfg: Any, calibrate: bool, h1_dim: int = 0,
                      weight_bytes: dict[int, float] | None = None, extra_down: float = 0.0,
                      eval_samples: int = 0) -> list[float]:
    """Predicted seconds of one FedSGA device's round at each split k = 1..K at the rates ``cls`` (a fleet class,
    fedsga_edge/fleet.py ``DeviceClass.round_s``, or a ``MeasuredRate``): ``split_loads`` with FedSGA's probe slice
    held out while the estimator calibrates, then 1 % more (``MARGIN``). Not counted (as on the virtual clock): the
    observation forward, waiting for the server; a device's first round adds its class's ``warmup_s`` (the caller).
    Against the virtual clock it is long by under 1.5 % (tests/test_fleet_bench.py)."""
    holdout = cfg.fedsga.probe_holdout if cfg.fedsga.estimator else None
    loads = split_loads(costs, num_samples, cfg, calibrate=calibrate, probe_holdout=holdout, h1_dim=h1_dim,
                        weight_bytes=weight_bytes, extra_down=extra_down, eval_samples=eval_samples)
    return [MARGIN * float(cls.round_s(x.flops, x.up, x.down, x.trips)) for _, x in sorted(loads.items())]


@dataclass(frozen=True)
class MeasuredRate:
    """A device's rates as its last round measured them; predicts a round as ``DeviceClass.round_s`` does (its
    link's one rate both ways, the round trips' delays already in it)."""

    gflops: float
    link_mbps: float
    warmup_s: float = 0.0

    def round_s(self, flops: float, bytes_up: float, bytes_down: float, round_trips: float) -> float:
        return flops / (self.gflops * 1e9) + (bytes_up + bytes_down) * 8 / (self.link_mbps * 1e6)


def measured_rate(timing: dict[str, Any], load: SplitLoad, warmup_s: float = 0.0) -> MeasuredRate | None:
    """The rates one device's round ``timing`` shows, ``load`` being what its round carried at the split it
    trained; ``warmup_s`` is taken off its compute (its first round). None when the round measured nothing
    usable (it missed the round, sent no update, or moved no bytes)."""
    compute = _finite(timing.get("compute_s"))
    link = _finite(timing.get("link_mbps"))
    if compute is None or link is None or link <= 0 or timing.get("missed") or load.flops <= 0:
        return None
    compute = max(compute - warmup_s, 1e-3 * compute, 1e-9)
    return MeasuredRate(gflops=load.flops / compute / 1e9, link_mbps=link)


class FleetRates:
    """Each device's latest rates: its fleet class (``classes``; none outside a fleet) until a round measured
    it, then what its latest round measured (``observe``)."""

    def __init__(self, classes: dict[str, Any] | None = None) -> None:
        self.classes = dict(classes or {})
        self.measured: dict[str, MeasuredRate] = {}
        self._pending: tuple[dict[str, Any], int] | None = None

    def keep(self, record: dict[str, Any], t: int) -> None:
        """Round ``t``'s record, from a strategy's ``end_round``: the driver adds the round's ``timing`` to it
        after that hook, so it is read at the next ``latest``."""
        self._pending = (record, t)

    def latest(self, cid: str, load_of: Callable[[int, str, int], SplitLoad | None]) -> Any:
        """``rate(cid)`` once the kept record is taken in (``observe``; ``load_of(t, cid, split)``: what that
        device's round t carried)."""
        if self._pending is not None:
            record, t = self._pending
            self._pending = None
            self.observe(record.get("timing") or {}, lambda c, k: load_of(t, c, k))
        return self.rate(cid)

    def rate(self, cid: str) -> Any:
        """What ``cid``'s next round is predicted with: measured, else its class, else None (nothing known)."""
        return self.measured.get(cid, self.classes.get(cid))

    def observe(self, timing: dict[str, Any], load_of: Callable[[str, int], SplitLoad | None]) -> list[str]:
        """Take a round's per-device ``timing``; ``load_of(cid, split)`` is what that device's round carried.
        A device's first measured round has its class's warm-up taken out. Returns the devices measured."""
        seen = []
        for cid, tm in timing.items():
            split = tm.get("split") if isinstance(tm, dict) else None
            if not isinstance(split, int) or isinstance(split, bool) or split < 1:
                continue
            load = load_of(cid, split)
            cls = self.classes.get(cid)
            warm = float(getattr(cls, "warmup_s", 0.0) or 0.0) if cid not in self.measured else 0.0
            rate = measured_rate(tm, load, warm) if load is not None else None
            if rate is not None:
                self.measured[cid] = rate
                seen.append(cid)
        return seen


def _finite(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)
