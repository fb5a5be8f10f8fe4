"""A fixed mix of cuts: each device keeps one cut for the whole run, the cuts dealt over the fleet.

The static frontier (fedsga_edge/report/frontier.py) assumes that a fleet mixing two fixed cuts reaches the
straight line between their points. With per-device server copies that holds by construction (every cut trains
the same SGD); with one shared server copy it is a claim about training, and this strategy measures it: the
cuts of ``--mix-cuts`` are dealt to the devices in fleet order (device i gets cut i mod n), or in an order
shuffled by the run's seed (``--mix-order shuffled``). Under the mixed partition (even devices IID, odd ones
skewed) the fleet order ``1,K`` puts every IID device at p_1 and every skewed one at p_K: the per-device map a
sufficiency estimator would aim for, held fixed from round 1 (docs/method.md, "The static frontier").
"""

from __future__ import annotations

import numpy as np

from fedsga_edge.config import RunConfig
from fedsga_edge.options import Opt, class_options, resolve_args

from ..strategy import Method, Strategy, parse_cut, register_strategy

__all__ = ["Mix", "parse_cuts"]


def parse_cuts(spec: str, num_splits: int) -> list[int]:
    """``"1,K"`` -> [1, K]: a comma-separated list of cuts, each ``1``..``K``, ``ref`` (p_ref) or ``K`` (p_K)."""
    cuts = [parse_cut(part, num_splits, "--mix-cuts") for part in str(spec).split(",")]
    if len(cuts) < 2:
        raise ValueError(f"--mix-cuts needs two or more cuts to mix, got {spec!r}")
    return cuts


@register_strategy
class Mix(Strategy):
    name = "mix"
    help = "a fixed mix of cuts: device i keeps cut i mod n of --mix-cuts all run (fleet order, or --mix-order shuffled)"
    label = "Fixed mix of cuts"
    adaptive = True  # splits differ between devices: the frontier tables give it a distance like any adaptive row
    options = (
        Opt("cuts", str, "1,K", "The cuts dealt over the fleet, comma-separated: 1..K, ref or K (device i in the "
            "dealing order keeps cut i mod n all run)."),
        Opt("order", str, "fleet", "The dealing order: the fleet's (under --partition mixed, even devices are the "
            "IID ones) or shuffled by --seed.", choices=("fleet", "shuffled")),
    )

    @classmethod
    def check_config(cls, cfg: RunConfig, num_splits: int) -> None:
        parse_cuts(resolve_args(class_options(cls), cfg.strategy_args)["cuts"], num_splits)

    @classmethod
    def methods(cls) -> dict[str, Method]:
        return {
            "mix-p1-pK": Method("Fixed mix: even devices at p_1, odd at p_K (mixed partition: IID at p_1)",
                                group="extension", overrides={"strategy_args.cuts": "1,K"}, default=False),
            "mix-pK-p1": Method("Fixed mix: even devices at p_K, odd at p_1 (mixed partition: IID at p_K)",
                                group="extension", overrides={"strategy_args.cuts": "K,1"}, default=False),
            "mix-shuffled": Method("Fixed mix: half the devices at p_1, half at p_K, drawn by seed",
                                   group="extension", overrides={"strategy_args.cuts": "1,K",
                                                                    "strategy_args.order": "shuffled"},
                                   default=False),
        }

    @classmethod
    def method_name(cls, cfg: RunConfig, num_splits: int) -> str:
        args = resolve_args(class_options(cls), cfg.strategy_args)
        cuts = parse_cuts(args["cuts"], num_splits)
        if sorted(cuts) == [1, num_splits]:
            if args["order"] == "shuffled":
                return "mix-shuffled"
            return "mix-p1-pK" if cuts[0] == 1 else "mix-pK-p1"
        return f"mix-{'-'.join(map(str, cuts))}" + ("-shuffled" if args["order"] == "shuffled" else "")

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        self.cuts = parse_cuts(self.args["cuts"], num_splits)
        order = list(self.clients)
        if self.args["order"] == "shuffled":
            order = [order[i] for i in np.random.default_rng([cfg.seed, 11]).permutation(len(order))]
        self.cut_of = {c: self.cuts[i % len(self.cuts)] for i, c in enumerate(order)}

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        for c in clients:  # a device the fleet did not list at the start takes the next cut in turn
            self.cut_of.setdefault(c, self.cuts[len(self.cut_of) % len(self.cuts)])
        return {c: self.cut_of[c] for c in clients}

    def info(self) -> dict[str, object]:
        return {"cut_of": dict(self.cut_of)}
