"""SplitFed: every device at one split, the same every round."""

from __future__ import annotations

from fedsga_edge.config import RunConfig
from fedsga_edge.method.policy import reference_index

from ..strategy import Method, Strategy, check_split, register_strategy, split_suffix


@register_strategy
class Static(Strategy):
    name = "static"
    help = "SplitFed: every device at --split"
    label = "Static at p_ref (SplitFed)"

    @classmethod
    def check_config(cls, cfg: RunConfig, num_splits: int) -> None:
        check_split(cfg, num_splits)

    @classmethod
    def methods(cls) -> dict[str, Method]:
        return {"static-p1": Method("Static at p_1 (shallowest)", split="1", default=False),
                "static": Method(cls.label, split="ref"),
                # SplitFed at MU-SplitFed's server work (tau 2): a method's gain compared at equal server steps
                "static-steps2": Method("Static at p_ref, 2 server steps per activation (SplitFed at MU-SplitFed's "
                                        "server work)", split="ref", overrides={"server_steps": 2}, default=False),
                "static-pK": Method("Static at p_K (deepest)", split="K", default=False)}

    @classmethod
    def method_name(cls, cfg: RunConfig, num_splits: int) -> str:
        if not num_splits or cfg.split == reference_index(num_splits):
            name = "static"
        else:
            name = f"static-{split_suffix(cfg.split, num_splits)}"
        return name if cfg.server_steps == 1 else f"{name}-steps{cfg.server_steps}"

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: self.cfg.split for c in clients}
