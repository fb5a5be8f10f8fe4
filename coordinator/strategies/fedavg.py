"""FedAvg: the whole model on every device, weights averaged by data size."""

from __future__ import annotations

from ..strategy import Strategy, register_strategy


@register_strategy
class FedAvg(Strategy):
    name = "fedavg"
    help = "the whole model on every device, weights averaged"
    label = "FedAvg (whole model on the client)"
    ignores_options = ("server_copies", "server_bn", "server_lr", "server_bn_context", "server_steps")  # no server side

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: 0 for c in clients}
