"""MergeSFL (ICDE 2024, "MergeSFL: Split Federated Learning with Feature Merging and Batch Size
Regulation"): SplitFed whose server merges the activations of every device of one step into one batch.

The server concatenates the step's activations, takes ONE step of its copy on the merged batch and sends
each device its slice of the input gradient (scaled to its own mean loss, as the reference code does);
the device prefixes are averaged at the round's end as in SplitFed. The merged step is
``MergedServer`` (coordinator/server_side.py), which holds each activation until the step's last
training device has sent.

A held activation is answered when its step is taken: the gradients of the step come out of the
coordinator call that completed it (the last activation, or a device leaving the step), each the reply
to its device's open request. Over MQTT the device's request simply waits on its reply topic; in
``simulate`` the loopback request returns a pending reply, the device's scheduler gives it no turn until
the reply is there (``--fleet``: its virtual time waits), and a round that closes refuses whatever is
still held. Every device reports the merged loss. The paper's control module (each device's batch size
regulated to its speed, devices selected so the merged labels are balanced) is not here, and the row's label
says so (docs/method.md, "Baselines beyond the paper's own").
"""

from __future__ import annotations

from typing import Any

from fedsga_edge.config import RunConfig

from ..strategy import Method, Strategy, check_split, register_strategy

__all__ = ["MergeSFL"]


@register_strategy
class MergeSFL(Strategy):
    name = "mergesfl"
    help = "MergeSFL: every device at --split; the server merges each step's activations into one batch"
    # the paper's control module (batch-size regulation, label-balanced selection) is not implemented
    label = "MergeSFL, feature merging only"

    @classmethod
    def check_config(cls, cfg: RunConfig, num_splits: int) -> None:
        check_split(cfg, num_splits)
        if cfg.server_copies != "shared" or cfg.server_bn_context:
            raise ValueError("MergeSFL merges into the one shared server copy: it needs --server-copies shared "
                             "and no --server-bn-context")

    @classmethod
    def methods(cls) -> dict[str, Method]:
        # one server model by definition: the benchmark's SplitFed-v1 presets (per-client copies) run it on
        # the shared copy, at the preset's server rate (a merged step is one step on a mixed batch)
        return {cls.name: Method(cls.label, split="ref", overrides={"server_copies": "shared"})}

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: self.cfg.split for c in clients}

    def server_side(self, model: Any, head: Any, cfg: RunConfig, weight: Any) -> Any:
        from ..server_side import MergedServer

        return MergedServer(model, head, cfg, weight)
