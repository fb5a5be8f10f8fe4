"""Cuts in phases over rounds: every device at the same cut in a round, the cut changing by round.

The time counterpart of ``mix`` (coordinator/strategies/mix.py), which fixes a cut per device. With one shared
server copy, FedSGA under Dirichlet(0.1) settles into phases, not a per-device map: every device at p_ref
until the estimator's first refit (round ``cal_every``), then nearly every device at p_K. Its gains and losses
against the static frontier may come from those phases alone; ``ref:5,K`` runs it with no estimator, no
harmonizer and no probe, so the pair tells the phases' share from the method's (docs/method.md, "The static
frontier").
"""

from __future__ import annotations

from fedsga_edge.config import RunConfig
from fedsga_edge.options import Opt, class_options, resolve_args

from ..strategy import Method, Strategy, parse_cut, register_strategy

__all__ = ["Phased", "parse_phases"]

_FLAG = "--phased-cuts"


def parse_phases(spec: str, num_splits: int) -> list[tuple[int, int | None]]:
    """``"ref:5,K"`` -> [(p_ref, 5), (K, None)]: each entry a cut (1..K, ref or K) held for its rounds, the last
    one, with no count, to the run's end."""
    entries: list[tuple[int, int | None]] = []
    parts = [p.strip() for p in str(spec).split(",")]
    for i, part in enumerate(parts):
        cut, sep, count = part.partition(":")
        k = parse_cut(cut, num_splits, _FLAG)
        if i == len(parts) - 1:
            if sep:
                raise ValueError(f"{_FLAG}: the last entry holds to the run's end; {part!r} gives it a round count")
            entries.append((k, None))
            continue
        try:
            rounds = int(count)
        except ValueError:
            raise ValueError(f"{_FLAG}: {part!r} needs a round count (cut:rounds) before the next entry") from None
        if rounds < 1:
            raise ValueError(f"{_FLAG}: {part!r} holds its cut for {rounds} rounds; give it 1 or more")
        entries.append((k, rounds))
    if len(entries) < 2:
        raise ValueError(f"{_FLAG} needs two or more entries (one cut all run is --strategy static), got {spec!r}")
    return entries


@register_strategy
class Phased(Strategy):
    name = "phased"
    help = "cuts in fixed phases over rounds, every device at the phase's cut (--phased-cuts ref:5,K)"
    label = "Cuts in fixed phases"
    adaptive = True  # the cut changes between rounds: the frontier tables give it a distance like any adaptive row
    options = (
        Opt("cuts", str, "ref:5,K", "The phases, comma-separated cut:rounds entries (cut 1..K, ref or K), the "
            "last with no count held to the run's end: ref:5,K is p_ref for rounds 1-5, then p_K."),
    )

    @classmethod
    def check_config(cls, cfg: RunConfig, num_splits: int) -> None:
        parse_phases(resolve_args(class_options(cls), cfg.strategy_args)["cuts"], num_splits)

    @classmethod
    def methods(cls) -> dict[str, Method]:
        return {
            "phased-pref-pK": Method("Phased: p_ref for 5 rounds, then p_K (FedSGA's under Dir(0.1))",
                                     group="extension", overrides={"strategy_args.cuts": "ref:5,K"}, default=False),
            # over 14 rounds (the cifar preset's) the same device-rounds at each cut as ref:5,K, in the other order
            "phased-pK-pref": Method("Phased: p_K for 9 rounds, then p_ref (the other order, over 14 rounds)",
                                     group="extension", overrides={"strategy_args.cuts": "K:9,ref"}, default=False),
        }

    @classmethod
    def method_name(cls, cfg: RunConfig, num_splits: int) -> str:
        spec = resolve_args(class_options(cls), cfg.strategy_args)["cuts"]
        entries = parse_phases(spec, num_splits)
        for name, method in cls.methods().items():
            if parse_phases(method.overrides["strategy_args.cuts"], num_splits) == entries:
                return name
        return "phased-" + "-".join(f"{k}x{n}" if n else str(k) for k, n in entries)

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        self.entries = parse_phases(self.args["cuts"], num_splits)

    def cut_at(self, t: int) -> int:
        """The cut of round ``t`` (1-based)."""
        end = 0
        for k, rounds in self.entries:
            if rounds is None:
                return k
            end += rounds
            if t <= end:
                return k
        return self.entries[-1][0]

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return dict.fromkeys(clients, self.cut_at(t))
