"""The coordinator role: server-side blocks, harmonizer, prototypes, phi_s, the estimator and rounds.

It sees messages, never a transport. ``handle`` answers the devices' requests during a round
(activations, probes, block fetches); ``run_round`` drives one communication round by asking
every participating device to train (``round_start`` -> ``update``) and then aggregates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedsga_edge.config import RunConfig
from fedsga_edge.method import (
    CalibrationBuffer,
    Harmonizer,
    MonotoneEstimator,
    Prototypes,
    ShallowHead,
    alignment_loss,
    fit,
    phi_s_loss,
    reference_index,
    sufficiency_label,
)
from fedsga_edge.method.aggregation import Contribution, aggregate_blocks
from fedsga_edge.models import SplitModel
from fedsga_edge.tensors import from_numpy, image_batch, to_numpy, to_numpy_state
from fedsga_edge.wire import Message

from .strategy import SplitAssigner

__all__ = ["Coordinator"]


class Caller(Protocol):
    def call(self, dst: str, kind: str, round: int, body: dict[str, Any]) -> Message: ...


class ServerHead(nn.Module):
    """What follows the pooled features on the server: harmonizer + G, or the plain head."""

    def __init__(self, model: SplitModel, num_classes: int, harmonizer: bool, dim: int) -> None:
        super().__init__()
        self.harmonizer = Harmonizer(model.feature_dim, model.num_splits, dim=dim) if harmonizer else None
        self.G = nn.Linear(dim, num_classes) if harmonizer else None


class Coordinator:
    def __init__(
        self,
        model: SplitModel,
        cfg: RunConfig,
        peer: Caller,
        clients: dict[str, int],
        num_classes: int,
        assigner: SplitAssigner,
        *,
        device: str | torch.device = "cpu",
        name: str = "coordinator",
    ) -> None:
        self.cfg = cfg
        self.peer = peer
        self.clients = dict(clients)  # id -> |D_i|
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.assigner = assigner
        self.name = name
        self.fedsga = cfg.strategy == "fedsga"
        fed = cfg.fedsga
        use_harm = self.fedsga and fed.harmonizer
        self.head = ServerHead(model, num_classes, use_harm, fed.proto_dim).to(self.device)
        proto_dim = fed.proto_dim if use_harm else model.feature_dim
        self.proto_dim = proto_dim
        self.prototypes = Prototypes(num_classes, proto_dim, fed.mu_proto).to(self.device)
        d1 = model.depth_of(1)
        c1 = model.interface_shape(d1)[0] if model.family == "cnn" else model.prompt_dim
        self.phi_s = ShallowHead(c1, proto_dim).to(self.device)
        num_obs = 3 if fed.adapt else 2
        self.estimator = MonotoneEstimator(num_obs=num_obs)
        self.cal_buffer = CalibrationBuffer(num_obs=num_obs)
        server_params = list(self.model.parameters()) + list(self.head.parameters())
        tc = cfg.train
        self.opt = torch.optim.SGD(server_params, lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
        self.phi_opt = torch.optim.SGD(self.phi_s.parameters(), lr=tc.lr, momentum=tc.momentum)
        self._round_snapshot: dict[str, Tensor] = {}
        self._round: dict[str, Any] = {}

    # -- server-side computation ----------------------------------------------------------------
    def server_forward(self, z: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
        """Logits (and harmonized Z) for an activation that entered at split index k."""
        feats = self.model.suffix(z, self.model.depth_of(k))
        if self.head.harmonizer is None:
            return self.model.head(feats), (feats if self.fedsga else None)
        Z = self.head.harmonizer(feats, k)
        return self.head.G(Z), Z

    def _loss(self, logits: Tensor, Z: Tensor | None, y: Tensor) -> Tensor:
        loss = F.cross_entropy(logits, y)
        if Z is not None and self.head.harmonizer is not None:
            fed = self.cfg.fedsga
            loss = loss + fed.lambda_align * alignment_loss(Z, y, self.prototypes.protos, fed.tau_a)
        return loss

    # -- message handling -------------------------------------------------------------------------
    def handle(self, msg: Message) -> Message | None:
        """Answer one device request; unknown kinds are the device's error, not ours."""
        handler: Callable[[Message], dict[str, Any]] | None = {
            "activation": self._on_activation,
            "probe": self._on_probe,
            "fetch": self._on_fetch,
        }.get(msg.kind)
        if handler is None:
            return self._reply(msg, "error", {"reason": f"coordinator does not accept {msg.kind!r}"})
        try:
            kind, body = handler(msg)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            self._round.setdefault("remote_errors", []).append(f"{msg.sender}: {exc}")
            return self._reply(msg, "error", {"reason": f"bad {msg.kind}: {exc}"})
        return self._reply(msg, kind, body)

    def _reply(self, msg: Message, kind: str, body: dict[str, Any]) -> Message:
        return Message(kind, msg.run, msg.round, msg.seq, self.name, body)

    def _on_activation(self, msg: Message) -> tuple[str, dict[str, Any]]:
        k = int(msg.body["split"])
        if not 1 <= k <= self.model.num_splits:
            raise ValueError(f"split {k} out of range 1..{self.model.num_splits}")
        z = from_numpy(msg.body["z"], self.device).requires_grad_(True)
        y = from_numpy(msg.body["y"], self.device).long()
        expected = self.model.interface_shape(self.model.depth_of(k), self._prompt_tokens(k))
        if tuple(z.shape[1:]) != expected or y.shape != z.shape[:1]:
            raise ValueError(f"activation shape {tuple(z.shape)} / labels {tuple(y.shape)} do not fit split {k} {expected}")
        self.model.train()
        self.head.train()
        self.opt.zero_grad(set_to_none=True)
        logits, Z = self.server_forward(z, k)
        loss = self._loss(logits, Z, y)
        loss.backward()
        self.opt.step()
        if Z is not None:
            self.prototypes.accumulate(Z.detach(), y)
        if self.fedsga and "h1" in msg.body:
            self._train_phi_s(from_numpy(msg.body["h1"], self.device), y)
        stats = self._round
        stats["server_samples"][k] = stats["server_samples"].get(k, 0) + len(y)
        return "gradient", {"dz": to_numpy(z.grad), "loss": float(loss.detach())}

    def _prompt_tokens(self, k: int) -> int:
        fed = self.cfg.fedsga
        if self.model.family == "vit" and self.fedsga and fed.adapt:
            return fed.prompts
        return 0

    def _train_phi_s(self, h1: Tensor, y: Tensor) -> None:
        """phi_s learns to map pooled p_1 features onto the prototypes (our reading of Eq. 3's head)."""
        if not bool(self.prototypes.initialized.any()):
            return
        self.phi_opt.zero_grad(set_to_none=True)
        phi_s_loss(self.phi_s(h1), y, self.prototypes.protos, self.cfg.fedsga.tau_a).backward()
        self.phi_opt.step()

    @torch.no_grad()
    def _on_probe(self, msg: Message) -> tuple[str, dict[str, Any]]:
        """Alg. 1: probe losses at p_1 and p_ref with nothing updated, label, refit Gamma."""
        fed = self.cfg.fedsga
        y = from_numpy(msg.body["y"], self.device).long()
        k_ref = reference_index(self.model.num_splits)
        self.model.eval()
        self.head.eval()
        losses = []
        for key, k in (("z1", 1), ("zref", k_ref)):
            z = from_numpy(msg.body[key], self.device)
            logits, Z = self.server_forward(z, k)
            losses.append(float(self._loss(logits, Z, y)))
        L1, Lref = losses
        s = sufficiency_label(L1, Lref, fed.beta)
        o = torch.tensor(msg.body["o"], dtype=torch.float32)
        self.cal_buffer.append(o, float(msg.body["r_prev"]), s)
        fit_stats = fit(self.estimator, self.cal_buffer)
        stats = self._round
        stats["calibration"].append({"client": msg.sender, "L1": L1, "Lref": Lref, "s": s} | fit_stats)
        n = len(y)
        stats["cal_flops_server"] += n * (self.costs.suffix_fwd(1) + self.costs.suffix_fwd(k_ref))
        return "probe_result", {"L1": L1, "Lref": Lref, "s": s, "estimator": to_numpy_state(self.estimator.state_dict())}

    def _on_fetch(self, msg: Message) -> tuple[str, dict[str, Any]]:
        blocks = {int(j) for j in msg.body["blocks"]}
        if any(not 0 <= j < self.model.num_blocks for j in blocks):
            raise ValueError(f"block indices {sorted(blocks)} out of range 0..{self.model.num_blocks - 1}")
        head = bool(msg.body.get("head"))
        weights = {
            n: v
            for n, v in self._round_snapshot.items()
            if (n.startswith("blocks.") and int(n.split(".", 2)[1]) in blocks) or (head and n.startswith("head."))
        }
        return "weights", {"weights": to_numpy_state(weights)}

    # -- rounds -----------------------------------------------------------------------------------
    costs: Any = None  # set by the wiring: per-depth FLOP costs (a CostTable)

    def run_round(self, t: int) -> dict[str, Any]:
        """One round: assign splits, let every device train, aggregate; returns the round's record."""
        started = time.perf_counter()
        self._round_snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._round = {"server_samples": {}, "calibration": [], "cal_flops_server": 0, "remote_errors": []}
        fed = self.cfg.fedsga
        K = self.model.num_splits
        calibrate = self.fedsga and fed.estimator and (t == 1 or t % max(fed.cal_every, 1) == 0)
        splits = self.assigner.assign(t, list(self.clients))
        updates: dict[str, dict[str, Any]] = {}
        failures: dict[str, str] = {}
        copies = _ServerCopies(self) if self.cfg.server_copies == "per_client" else None
        for cid in self.clients:
            k = splits.get(cid)
            full = k == 0
            body = self._round_start_body(k, full, calibrate)
            if copies is not None:
                copies.start_client()
            try:
                reply = self.peer.call(cid, "round_start", t, body)
            except Exception as exc:  # a device failing must not stop the round
                failures[cid] = f"{type(exc).__name__}: {exc}"
                continue
            if reply.kind != "update":
                failures[cid] = f"replied {reply.kind}: {reply.body.get('reason', '')}"
                continue
            updates[cid] = reply.body
            if copies is not None and not full:
                copies.end_client(int(reply.body["depth"]), float(reply.body["num_samples"]))
        if copies is not None:
            copies.finish()
        if updates:
            self._aggregate(updates)
        if self.fedsga:
            self.prototypes.commit()
        record: dict[str, Any] = {
            "round": t,
            "splits": {cid: u.get("split") if u.get("split") is not None else 0 for cid, u in updates.items()},
            "depths": {cid: int(u["depth"]) for cid, u in updates.items()},
            "train_loss": float(np.mean([u["train_loss"] for u in updates.values()])) if updates else float("nan"),
            "failures": failures,
            "round_s": time.perf_counter() - started,
        }
        if self.fedsga:
            record["clients"] = {
                cid: {k: u[k] for k in ("a", "delta", "q", "r", "r_prev", "L1", "Lref", "s") if k in u}
                for cid, u in updates.items()
            }
            cal = self._round["calibration"]
            if cal:
                record["calibration"] = {
                    "pairs": len(self.cal_buffer),
                    "accuracy": cal[-1]["accuracy"],
                    "brier": cal[-1]["brier"],
                    "bce": cal[-1]["loss"],
                    "positive_rate": float(np.mean([c["s"] for c in cal])),
                }
            client_cal = sum(self.costs.prefix_fwd(reference_index(K)) * int(u.get("probe_samples", 0)) for u in updates.values())
            record["calibration_flops"] = {"client": int(client_cal), "server": int(self._round["cal_flops_server"])}
        if self._round["remote_errors"]:
            record["remote_errors"] = self._round["remote_errors"]
        return record

    def _round_start_body(self, k: int | None, full: bool, calibrate: bool) -> dict[str, Any]:
        cfg = self.cfg
        if full:
            names = list(self._round_snapshot)
            names = [n for n in names if n.startswith(("blocks.", "head."))]
        else:
            known = k if k is not None else 1
            depth = self.model.depth_of(known)
            names = [n for n in self._round_snapshot if n.startswith("blocks.") and int(n.split(".", 2)[1]) < depth]
        body: dict[str, Any] = {
            "split": None if full else k,
            "full": full,
            "train": vars(cfg.train),
            "weights": to_numpy_state({n: self._round_snapshot[n] for n in names}),
            "fedsga": vars(cfg.fedsga) if self.fedsga else None,
        }
        if self.fedsga and k is None:
            body.update(
                calibrate=calibrate,
                estimator=to_numpy_state(self.estimator.state_dict()),
                phi_s=to_numpy_state(self.phi_s.state_dict()),
                prototypes=to_numpy(self.prototypes.protos),
                proto_dim=self.proto_dim,
            )
        elif self.fedsga:
            body["split"] = k
        return body

    def _aggregate(self, updates: dict[str, dict[str, Any]]) -> None:
        """DESIGN §1.8: per block, clients' copies and the server's copy, weighted by data."""
        L = self.model.num_blocks
        state = self.model.state_dict()
        units: dict[int, dict[str, Tensor]] = {j: {} for j in range(L + 1)}  # L = the head
        for name, v in state.items():
            units[_unit(name, L)][name] = v
        contributions = []
        server_weight = {j: 0.0 for j in range(L + 1)}
        for u in updates.values():
            depth = int(u["depth"])
            n = float(u["num_samples"])
            client_states: dict[int, dict[str, Tensor]] = {}
            for name, arr in u["weights"].items():
                client_states.setdefault(_unit(name, L), {})[name] = from_numpy(arr, self.device)
            complete = {j: s for j, s in client_states.items() if set(s) == set(units[j])}
            contributions.append(Contribution(complete, n))
            for j in range(L + 1):
                if j not in complete and (j >= depth):
                    server_weight[j] += n
        for j in range(L + 1):
            if server_weight[j] > 0:
                contributions.append(Contribution({j: units[j]}, server_weight[j]))
        snapshot_units = {j: {n: self._round_snapshot[n] for n in units[j]} for j in units}
        new = aggregate_blocks(snapshot_units, contributions)
        merged = {n: v for j in new for n, v in new[j].items()}
        self.model.load_state_dict(merged)

    # -- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, images: Any, mean: tuple, std: tuple, batch_size: int = 256) -> tuple[float, float]:
        """Accuracy and loss of the global model on ``images`` (no prompts: they are private)."""
        self.model.eval()
        self.head.eval()
        k_eval = reference_index(self.model.num_splits)
        correct, loss_sum, n = 0, 0.0, len(images)
        for start in range(0, n, batch_size):
            idx = np.arange(start, min(n, start + batch_size))
            x = image_batch(images.get_batch(idx), mean, std, self.device)
            y = torch.from_numpy(np.asarray(images.labels[idx], dtype=np.int64)).to(self.device)
            depth = self.model.depth_of(k_eval)
            logits, _ = self.server_forward(self.model.prefix(x, depth), k_eval)
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
        return correct / max(n, 1), loss_sum / max(n, 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "head": self.head.state_dict(),
            "prototypes": self.prototypes.state_dict(),
            "phi_s": self.phi_s.state_dict(),
            "estimator": self.estimator.state_dict(),
            "cal_buffer": self.cal_buffer.state_dict(),
        }


class _ServerCopies:
    """``server_copies="per_client"``: every client trains its own copy of the server side.

    The shared copy (the default) trains on the round's clients one after another, so under label
    skew it ends the round fitted to the last clients' classes (benchmarks/RESULTS.md). Here each
    client starts from the round's global server side; the copies (blocks, head or harmonizer, and
    BatchNorm statistics) are averaged, weighted by |D_i|, per block over the clients whose data
    passed through it, and the average enters DESIGN §1.8's aggregation as the server's copy.
    """

    def __init__(self, co: "Coordinator") -> None:
        self.co = co
        self.model0 = {k: v.detach().clone() for k, v in co.model.state_dict().items()}
        self.head0 = {k: v.detach().clone() for k, v in co.head.state_dict().items()}
        self.sums: dict[str, Tensor] = {}
        self.weights: dict[str, float] = {}

    def start_client(self) -> None:
        self.co.model.load_state_dict(self.model0)
        self.co.head.load_state_dict(self.head0)

    @torch.no_grad()
    def end_client(self, depth: int, weight: float) -> None:
        L = self.co.model.num_blocks
        trained = [(k, v) for k, v in self.co.model.state_dict().items() if _unit(k, L) >= depth]
        trained += [("head:" + k, v) for k, v in self.co.head.state_dict().items()]
        for k, v in trained:
            self.sums[k] = self.sums.get(k, 0) + weight * v.double()
            self.weights[k] = self.weights.get(k, 0.0) + weight

    def _mean(self, key: str, like: Tensor) -> Tensor:
        if key not in self.sums:
            return like
        mean = self.sums[key] / self.weights[key]
        return mean.to(like.dtype) if like.is_floating_point() else mean.round().to(like.dtype)

    def finish(self) -> None:
        self.co.model.load_state_dict({k: self._mean(k, v) for k, v in self.model0.items()})
        self.co.head.load_state_dict({k: self._mean("head:" + k, v) for k, v in self.head0.items()})


def _unit(name: str, num_blocks: int) -> int:
    return int(name.split(".", 2)[1]) if name.startswith("blocks.") else num_blocks

