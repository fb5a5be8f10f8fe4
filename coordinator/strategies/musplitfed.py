"""MU-SplitFed (NeurIPS 2025, "Towards Straggler-Resilient Split Federated Learning: An Unbalanced
Update Approach"): SplitFed whose server takes tau updates on every activation a device sends.

The server's progress per device round is tau times SplitFed's, so fewer device rounds (the part a
straggler slows) reach the same server progress. The tau steps are the server side's ``steps``
(coordinator/server_side.py), on the shared copy or on each device's own (``--server-copies per-client``,
the ``cifar-v1`` preset's SplitFed-v1 server); the device side is SplitFed's first-order step, not the paper's
zeroth-order one, and the row's label says so (docs/method.md, "Baselines beyond the paper's own").
"""

from __future__ import annotations

from fedsga_edge.config import RunConfig
from fedsga_edge.options import Opt

from ..strategy import Method, Strategy, check_split, register_strategy


@register_strategy
class MUSplitFed(Strategy):
    name = "musplitfed"
    help = "MU-SplitFed: every device at --split, the server takes --musplitfed-tau steps per activation"
    # the paper's devices train by zeroth-order estimates; ours backpropagate (docs/method.md says why)
    label = "MU-SplitFed, first-order devices (tau server updates)"
    options = (Opt("tau", int, 2, "Server optimizer steps per device activation (MU-SplitFed's unbalanced "
                   "update; 1 = SplitFed).", ge=1, le=64),)

    @classmethod
    def check_config(cls, cfg: RunConfig, num_splits: int) -> None:
        check_split(cfg, num_splits)

    @classmethod
    def methods(cls) -> dict[str, Method]:
        return {cls.name: Method(cls.label, split="ref")}

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: self.cfg.split for c in clients}

    def server_steps(self) -> int:
        return int(self.args["tau"])

    def info(self) -> dict[str, int]:
        return {"server_steps_per_activation": self.server_steps()}
