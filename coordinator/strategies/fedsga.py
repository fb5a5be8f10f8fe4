"""FedSGA: each device picks its split with the sufficiency estimator (docs/method.md).

Everything the method keeps on the server lives here: the harmonizer and its head G, the class
prototypes, the shallow head phi_s, the estimator Gamma with its calibration pairs, and the probe
a device sends on calibration rounds. The coordinator only calls the strategy's hooks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsga_edge.config import RunConfig
from fedsga_edge.method.policy import reference_index

from ..strategy import Method, Strategy, register_strategy

if TYPE_CHECKING:
    from torch import Tensor

    from fedsga_edge.wire import Message

__all__ = ["FedSGA"]

_ABLATIONS = ("adapt", "estimator", "harmonizer")
# A probe's delta and q are clipped to this many times the stored pairs' median (once there are
# _OBS_MIN pairs): the estimator's inputs stay bounded whatever one device reports.
_OBS_CLIP, _OBS_MIN = 10.0, 4
# The per-device numbers an update reports that metrics.jsonl keeps for FedSGA (docs/method.md)
_RECORD_KEYS = ("a", "delta", "q", "r", "r_prev", "k_policy", "L1", "Lref", "s", "descriptor_entropy")


def _server_head(model: Any, num_classes: int, harmonizer: bool, dim: int) -> Any:
    """What follows the pooled features on the server: harmonizer + G, or nothing (the model's head)."""
    from torch import nn

    from fedsga_edge.method import Harmonizer

    class ServerHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.harmonizer = Harmonizer(model.feature_dim, model.num_splits, dim=dim) if harmonizer else None
            self.G = nn.Linear(dim, num_classes) if harmonizer else None

    return ServerHead()


@register_strategy
class FedSGA(Strategy):
    name = "fedsga"
    help = "each device picks its split with the sufficiency estimator (docs/method.md)"
    label = "**FedSGA**"
    adaptive = True
    requests = {"probe": "on_probe"}

    @classmethod
    def methods(cls) -> dict[str, Method]:
        out = {"fedsga": Method(cls.label)}
        labels = {"adapt": "w/o adaptation channel", "estimator": "w/o estimator (all at p_ref)",
                  "harmonizer": "w/o harmonizer"}
        for flag in _ABLATIONS:
            out[f"fedsga-no-{flag}"] = Method(labels[flag], group="ablation", overrides={f"fedsga.{flag}": False})
        return out

    @classmethod
    def method_name(cls, cfg: RunConfig, num_splits: int) -> str:
        off = [flag for flag in _ABLATIONS if getattr(cfg.fedsga, flag) is False]
        return "-".join(["fedsga"] + [f"no-{flag}" for flag in off])

    @classmethod
    def prompt_tokens(cls, cfg: RunConfig) -> int:
        return cfg.fedsga.prompts if cfg.fedsga.adapt else 0

    # -- configure the round ------------------------------------------------------------------------
    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        if not self.cfg.fedsga.estimator:  # ablation: everyone at p_ref
            return {c: reference_index(self.K) for c in clients}
        return {c: None for c in clients}

    def calibrates(self, t: int) -> bool:
        fed = self.cfg.fedsga
        return fed.estimator and (t == 1 or t % max(fed.cal_every, 1) == 0)

    def accepts_split(self, assigned: int | None, k: int, calibrate: bool) -> bool:
        # a calibration round's probe compares the device's own blocks up to p_ref: it may go deeper
        return assigned is None or assigned == k or (calibrate and k >= assigned)

    def round_start_fields(self, k: int | None, calibrate: bool) -> dict[str, Any]:
        from fedsga_edge.tensors import to_numpy, to_numpy_state

        body: dict[str, Any] = {"fedsga": vars(self.cfg.fedsga)}
        if k is None:  # the device chooses: it needs Gamma, phi_s and the prototypes to observe
            body.update(calibrate=calibrate, estimator=to_numpy_state(self.estimator.state_dict()),
                        phi_s=to_numpy_state(self.phi_s.state_dict()), prototypes=to_numpy(self.prototypes.protos),
                        proto_dim=self.proto_dim)
        return body

    # -- the server side ----------------------------------------------------------------------------
    def attach(self, coordinator: Any) -> None:
        import torch

        from fedsga_edge.method import CalibrationBuffer, MonotoneEstimator, Prototypes, ShallowHead

        co, fed = coordinator, self.cfg.fedsga
        self.co = co
        model, dev = co.model, co.device
        self.head = _server_head(model, co.num_classes, fed.harmonizer, fed.proto_dim).to(dev)
        self.proto_dim = fed.proto_dim if fed.harmonizer else model.feature_dim
        self.prototypes = Prototypes(co.num_classes, self.proto_dim, fed.mu_proto).to(dev)
        self.phi_s = ShallowHead(model.phi_input_dim, self.proto_dim).to(dev)
        num_obs = 3 if fed.adapt else 2
        self.estimator = MonotoneEstimator(num_obs=num_obs)
        self.cal_buffer = CalibrationBuffer(num_obs=num_obs)
        # phi_s takes a step on every device's batch, like the shared server copy: its own rate (docs/method.md)
        self.phi_opt = torch.optim.SGD(self.phi_s.parameters(), lr=fed.phi_lr, momentum=self.cfg.train.momentum)
        self._calibration: list[dict[str, Any]] = []
        self._new_pairs = 0  # this round's informative pairs, the newest in the buffer
        self._cal_flops_server = 0
        self._phi_loss, self._phi_steps = 0.0, 0

    def server_head(self) -> Any:
        return self.head

    def forward(self, side: Any, z: "Tensor", k: int) -> tuple["Tensor", "Tensor | None"]:
        feats = side.model.suffix(z, side.model.depth_of(k))
        if side.head.harmonizer is None:
            return side.model.head(feats), feats  # the pooled features still feed the prototypes
        Z = side.head.harmonizer(feats, k)
        return side.head.G(Z), Z

    def loss(self, logits: "Tensor", Z: "Tensor | None", y: "Tensor") -> "Tensor":
        import torch.nn.functional as F

        from fedsga_edge.method import alignment_loss

        loss = F.cross_entropy(logits, y)
        if Z is not None and self.head.harmonizer is not None:
            fed = self.cfg.fedsga
            loss = loss + fed.lambda_align * alignment_loss(Z, y, self.prototypes.protos, fed.tau_a)
        return loss

    def check_activation(self, body: dict[str, Any], n: int) -> Any:
        from fedsga_edge.coordinator.limits import check_values

        if "h1" not in body:
            return None
        h1 = body["h1"]
        if not isinstance(h1, np.ndarray) or h1.shape != (n, self.phi_s.net[0].in_features):
            raise ValueError("h1 must be pooled p_1 features, one row per sample")
        check_values(h1, "h1")
        return h1

    def after_step(self, Z: "Tensor | None", y: "Tensor", extra: Any) -> None:
        from fedsga_edge.method import phi_s_loss
        from fedsga_edge.tensors import from_numpy

        if Z is not None:
            self.prototypes.accumulate(Z.detach(), y)
        if extra is None or not bool(self.prototypes.initialized.any()):
            return
        # phi_s learns to map pooled p_1 features onto the prototypes (our reading of Eq. 3's head)
        self.phi_opt.zero_grad(set_to_none=True)
        h1 = from_numpy(extra, self.co.device).float()
        loss = phi_s_loss(self.phi_s(h1), y, self.prototypes.protos, self.cfg.fedsga.tau_a)
        loss.backward()
        self.phi_opt.step()
        self._phi_loss += float(loss.detach())
        self._phi_steps += 1

    def on_probe(self, co: Any, msg: "Message") -> tuple[str, dict[str, Any]]:
        """Calibration (docs/method.md): L1 through the server's blocks from p_1, Lref through the
        device's own blocks up to p_ref; nothing is updated. The pair is stored for the refit."""
        import torch

        from fedsga_edge.coordinator.limits import MAX_ABS_VALUE
        from fedsga_edge.method import sufficiency_label
        from fedsga_edge.method.estimator import informative
        from fedsga_edge.tensors import probe_mode

        if not co.round.calibrate:
            raise ValueError("this round does not calibrate")
        if any(c["client"] == msg.sender for c in self._calibration):
            raise ValueError("this device already probed this round")
        k_ref = reference_index(self.K)
        body = msg.body
        z1, y = co.check_activation(body, "z1", 1)
        zref, y2 = co.check_activation(body, "zref", k_ref)
        if not torch.equal(y, y2):
            raise ValueError("z1 and zref must come from the same batch")
        o = np.asarray(body["o"], dtype=np.float64)
        r_prev = float(body["r_prev"])
        if o.shape != (self.cal_buffer.num_obs,) or not np.isfinite(o).all() or not 0.0 <= r_prev <= 1.0:
            raise ValueError(f"o must be {self.cal_buffer.num_obs} finite values and r_prev in [0, 1]")
        # o = (a, delta[, q]) (docs/method.md): a is a mean cosine, delta and q are norms of changes.
        if not (-1.0001 <= o[0] <= 1.0001 and (o[1:] >= 0).all() and (o[1:] <= MAX_ABS_VALUE).all()):
            raise ValueError(f"o = {o.tolist()} is out of range: a in [-1, 1], the rest in [0, {MAX_ABS_VALUE:g}]")
        o = self._bounded(o)
        side = co.server.copy_for(msg.sender)
        with probe_mode(side.model, side.head):
            L1 = float(self.loss(*self.forward(side, z1, 1), y))
            Lref = float(self.loss(*self.forward(side, zref, k_ref), y))
        if not (math.isfinite(L1) and math.isfinite(Lref)):
            raise ValueError("probe losses are not finite")
        s = sufficiency_label(L1, Lref, self.cfg.fedsga.beta)
        # a device's first observation is the same point for everyone: it does not decide Gamma (docs/method.md)
        stored = informative(o, r_prev)
        if stored:
            self.cal_buffer.append(o.tolist(), r_prev, s)
            self._new_pairs += 1
        self._calibration.append({"client": msg.sender, "L1": L1, "Lref": Lref, "s": s, "stored": stored})
        self._cal_flops_server += len(y) * (co.costs.suffix_fwd(1) + co.costs.suffix_fwd(k_ref))
        return "probe_result", {"L1": L1, "Lref": Lref, "s": s}

    def _bounded(self, o: np.ndarray) -> np.ndarray:
        """Clip delta (and q) to _OBS_CLIP x the stored pairs' median of each."""
        if len(self.cal_buffer) < _OBS_MIN:
            return o
        out = o.copy()
        for j in range(1, len(o)):
            typical = self.cal_buffer.typical(j)
            if typical:
                out[j] = min(out[j], _OBS_CLIP * typical)
        return out

    def begin_round(self, t: int, calibrate: bool) -> None:
        self._calibration, self._new_pairs, self._cal_flops_server = [], 0, 0
        self._phi_loss, self._phi_steps = 0.0, 0

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        self.prototypes.commit()
        record["clients"] = {cid: {k: u[k] for k in _RECORD_KEYS if k in u} for cid, u in updates.items()}
        if self._calibration:  # Alg. 1: refit Gamma once per calibration round, on all pairs; used from round t+1
            record["calibration"] = self._refit()
        if self._phi_steps:
            record["phi_s_loss"] = self._phi_loss / self._phi_steps
        costs = self.co.costs
        client_cal = sum(costs.prefix_fwd(reference_index(self.K)) * int(u.get("probe_samples", 0))
                         for u in updates.values())
        record["calibration_flops"] = {"client": int(client_cal), "server": int(self._cal_flops_server)}
        # the round-start observation: obs_samples through the prefix to p_1 (docs/method.md, "Costs")
        client_obs = sum(costs.prefix_fwd(1) * int(u.get("obs_samples", 0)) for u in updates.values())
        record["observation_flops"] = {"client": int(client_obs)}

    def _refit(self) -> dict[str, Any]:
        """Score the Gamma that chose this round's splits on this round's new pairs (fitted before they came:
        ``heldout_brier``), then refit on every stored pair. Without any stored pair Gamma stays as it is
        (its prior at the start). docs/method.md, "Calibration"."""
        from fedsga_edge.method import fit
        from fedsga_edge.method.estimator import score

        new, total = self._new_pairs, len(self.cal_buffer)
        out: dict[str, Any] = {"probes": len(self._calibration), "new_pairs": new, "pairs": total,
                               "positive_rate": float(np.mean([c["s"] for c in self._calibration])),
                               "heldout_brier": None, "accuracy": None, "brier": None, "bce": None}
        if new and total > new:  # Gamma has been fit on the older pairs: score it on the new ones first
            obs, r_prev, s = self.cal_buffer.tensors()
            out["heldout_brier"] = score(self.estimator, obs[-new:], r_prev[-new:], s[-new:])["brier"]
        if total:
            stats = fit(self.estimator, self.cal_buffer)
            out.update(accuracy=stats["accuracy"], brier=stats["brier"], bce=stats["loss"])
        return out

    def eval_logits(self, model: Any, feats: "Tensor") -> dict[int, "Tensor"]:
        if self.head.harmonizer is None:
            return {0: model.head(feats)}
        return {k: self.head.G(self.head.harmonizer(feats, k)) for k in range(1, self.K + 1)}

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"prototypes": self.prototypes.state_dict(), "phi_s": self.phi_s.state_dict(),
                "estimator": self.estimator.state_dict(), "cal_buffer": self.cal_buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("prototypes", "phi_s", "estimator", "cal_buffer"):
            getattr(self, key).load_state_dict(state[key])

    def optimizer_state(self) -> dict[str, Any]:
        return {"phi_opt": self.phi_opt.state_dict()}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.phi_opt.load_state_dict(state["phi_opt"])
