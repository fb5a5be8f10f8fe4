"""MultiSFL (AAAI 2025, "MultiSFL: Towards Accurate Split Federated Learning via Multi-Model Aggregation
and Knowledge Replay"): several branch models, each a device part and a server part, trained side by
side; an aggregated master model shares their knowledge; each branch's server part replays activations
of helper devices whose labels the branch lacks.

As its reference code (github.com/CodeFree-xzk/MultiSFL) runs it: one branch per device of the round
(``--multisfl-branches 0``); round t deals device j (partition order) to branch (j + t) mod B, so every
branch meets other data over the rounds. A device receives its branch's prefix and trains it at --split
against its branch's server copy (``BranchServer``, coordinator/server_side.py), whose batches also take
about ``--multisfl-replay`` (1 %) of the device's data per local epoch in helper devices' rows of the
classes the branch lacks. At the round's end each branch that trained becomes W_b' = (the data-weighted
average of its devices' prefixes, its trained server part); the master is the data-weighted average of
the W_b' (the coordinator's global model, which is evaluated); each branch then starts the next round
from (1 - mix) W_b' + mix * master, mix 1/(B + 1) by default. docs/method.md, "Baselines beyond the
paper's own", says what follows the reference and what is ours; ``multisfl-2branch`` is the setting
this project ran before (2 branches, mix 0.5, half a device's data replayed).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from fedsga_edge.config import RunConfig
from fedsga_edge.options import Opt

from ..strategy import Method, Strategy, check_split, register_strategy

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["MultiSFL", "weighted_state"]


def weighted_state(states: list[dict[str, "Tensor"]], weights: list[float],
                   like: dict[str, "Tensor"]) -> dict[str, "Tensor"]:
    """sum_i w_i states_i / sum_i w_i per tensor, in float64, cast back to ``like``'s dtypes (integer
    counters rounded)."""
    total = float(sum(weights))
    out: dict[str, Tensor] = {}
    for n, ref in like.items():
        m = sum(w * s[n].double() for s, w in zip(states, weights)) / total
        out[n] = m.to(ref.dtype) if ref.is_floating_point() else m.round().to(ref.dtype)
    return out


@register_strategy
class MultiSFL(Strategy):
    name = "multisfl"
    help = ("MultiSFL: --multisfl-branches branch models (device + server part) at --split, an aggregated "
            "master model, knowledge replay from helper devices")
    label = "MultiSFL (a branch per device, master, replay)"
    options = (
        Opt("branches", int, 0, "Branch models B (each a device part and a server part); a round deals its "
            "devices to them in turn (0: one per device of the first round, as the reference).", ge=0, le=64),
        Opt("mix", float, None, "How far each branch moves to the master at a round's end: W_b <- (1 - mix) W_b "
            "+ mix * master (1: every branch restarts from the master; unset: 1/(B + 1), the reference's).",
            ge=0, le=1, nullable=True),
        Opt("replay", float, 0.01, "Knowledge replay: the share of a device's data replayed per local epoch "
            "as helper devices' rows in its branch's server batches, at least one row per class (0: none).",
            ge=0, le=1),
    )
    # the setting this project ran before it followed the reference (benchmarks/RESULTS.md's older tables)
    TWO_BRANCH = {"branches": 2, "mix": 0.5, "replay": 0.5}

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        self.B = int(self.args["branches"])  # 0 until the first round deals one branch per device
        self.branches: list[dict[str, Tensor]] | None = None  # each branch's whole model, between rounds
        self.dealt: dict[str, int] = {}  # device -> its branch this round
        self.trained: dict[int, dict[str, Tensor]] = {}  # W_b' of the last round's branches (before the mix)
        self._co: Any = None
        self._server: Any = None

    @classmethod
    def check_config(cls, cfg: RunConfig, num_splits: int) -> None:
        check_split(cfg, num_splits)

    @classmethod
    def methods(cls) -> dict[str, Method]:
        return {cls.name: Method(cls.label, split="ref"),
                "multisfl-2branch": Method("MultiSFL, 2 branches, mix 0.5, 50 % replay (our earlier setting)",
                                           split="ref", default=False,
                                           overrides={f"strategy_args.{k}": v for k, v in cls.TWO_BRANCH.items()})}

    @classmethod
    def method_name(cls, cfg: RunConfig, num_splits: int) -> str:
        args = cfg.strategy_args
        return "multisfl-2branch" if all(args.get(k) == v for k, v in cls.TWO_BRANCH.items()) else cls.name

    @property
    def mix(self) -> float:
        m = self.args["mix"]
        return 1.0 / (self.B + 1) if m is None else float(m)

    def replay_rows(self, device: str) -> int:
        """Rows replayed with each of the device's steps: the reference's max(classes, floor(replay n))
        samples per local epoch, spread over the epoch's ceil(n / batch) steps (0 without replay)."""
        frac = float(self.args["replay"])
        n = int(self._co.clients.get(device, 0))
        if frac <= 0 or n <= 0:
            return 0
        tc = self.cfg.train
        steps = math.ceil(n / tc.batch_size)
        steps = min(steps, tc.max_batches) if tc.max_batches else steps
        return math.ceil(max(self._co.num_classes, int(frac * n)) / steps)

    def attach(self, coordinator: Any) -> None:
        self._co = coordinator

    def server_side(self, model: Any, head: Any, cfg: RunConfig, weight: Any) -> Any:
        from ..server_side import BranchServer

        self._server = BranchServer(model, head, cfg, weight, branch_of=self.branch_of, start=self.branch_state,
                                    rows=self.replay_rows, num_classes=self._co.num_classes)
        return self._server

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        self.B = self.B or max(1, len(clients))
        self.dealt = {c: (j + t) % self.B for j, c in enumerate(clients)}
        return {c: self.cfg.split for c in clients}

    def branch_of(self, device: str) -> int:
        return self.dealt[device]

    def branch_state(self, b: int) -> dict[str, "Tensor"]:
        assert self.branches is not None
        return self.branches[b]

    def begin_round(self, t: int, calibrate: bool) -> None:
        if self.branches is None:  # every branch starts from the initial model
            state = self._co.model.state_dict()
            self.branches = [{n: v.detach().clone() for n, v in state.items()} for _ in range(self.B)]

    def device_weights(self, cid: str, t: int, weights: dict[str, "Tensor"]) -> dict[str, "Tensor"]:
        """A device trains its branch's prefix, not the master's."""
        b = self.dealt.get(cid)
        if b is None or self.branches is None:
            return weights
        return {n: self.branches[b][n] for n in weights}

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        """W_b' per branch that trained, the master (their data-weighted average) into the global model, the mix."""
        import torch

        from fedsga_edge.tensors import from_numpy

        assert self.branches is not None
        co = self._co
        unit = co.model.unit_of
        server_trained = self._server.trained if self._server is not None else {}
        self.trained, mass = {}, {}
        for b in range(self.B):
            devs = [c for c in updates if self.dealt.get(c) == b]
            w = {c: self.weight(co.clients[c]) for c in devs}
            if not devs or sum(w.values()) <= 0:
                continue
            ref = self.branches[b]
            state: dict[str, Tensor] = {}
            for n, v in ref.items():
                on_device = [c for c in devs if unit(n) < int(updates[c]["depth"])]
                if on_device:  # the branch's prefix: its devices' average
                    state[n] = weighted_state([{n: from_numpy(updates[c]["weights"][n], v.device)} for c in on_device],
                                              [w[c] for c in on_device], {n: v})[n]
                else:  # the branch's server part as its copy trained it
                    state[n] = server_trained.get(b, ref)[n].detach().clone()
            self.trained[b], mass[b] = state, sum(w.values())
        record["branches"] = {str(b): sorted(c for c in updates if self.dealt.get(c) == b) for b in range(self.B)}
        record["replay_rows"] = sum(r for _, _, r in self._server.replayed) if self._server is not None else 0
        if not self.trained:
            return
        order = sorted(self.trained)
        master = weighted_state([self.trained[b] for b in order], [mass[b] for b in order], co.model.state_dict())
        with torch.no_grad():
            co.model.load_state_dict(master)
        mix = self.mix
        for b in range(self.B):
            base = self.trained.get(b, self.branches[b])
            self.branches[b] = weighted_state([base, master], [1.0 - mix, mix], base) if mix < 1 else \
                {n: v.detach().clone() for n, v in master.items()}

    def info(self) -> dict[str, Any]:
        return {"branches": self.B or "one per device", "mix": self.mix if self.B else "1/(B + 1)",
                "replay": self.args["replay"],
                "master": "data-weighted average of the branches that trained"}

    def state_dict(self) -> dict[str, Any]:
        return {"branches": self.branches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.branches = state.get("branches")
        self.B = len(self.branches) if self.branches else self.B
