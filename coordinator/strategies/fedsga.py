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
from fedsga_edge.wire import RemoteProtocolError

from ..instructions import Instruction
from ..strategy import Method, Strategy, check_split, register_strategy, split_suffix
from .fedsga_deadline import Deadlines, predict_device

if TYPE_CHECKING:
    from torch import Tensor

    from fedsga_edge.wire import Message

__all__ = ["FedSGA", "label_probe"]

_ABLATIONS = ("adapt", "estimator", "harmonizer")
# A probe's delta and q are clipped to this many times the stored pairs' median (once there are
# _OBS_MIN pairs): the estimator's inputs stay bounded whatever one device reports.
_OBS_CLIP, _OBS_MIN = 10.0, 4
# The per-device numbers an update reports that metrics.jsonl keeps for FedSGA (docs/method.md)
# (and the server's own L1, Lref and s of a calibration round's probe)
_RECORD_KEYS = ("a", "delta", "q", "r", "r_prev", "k_policy", "descriptor_entropy", "margin")
# --label-memory: a device's margin log(Lref / L1) is kept within +-_MARGIN_CAP (a loss of 0 would make it infinite)
_MARGIN_CAP = 10.0
# FedSGA settings the coordinator alone reads: a device sees their effect in its own round-start fields
# ("deadline", "margin": configure_round), and a round start without them is what devices that predate them accept
_SERVER_ONLY = ("deadline_aware", "label_memory", "harmonizer_lr", "harmonizer_form")


def _server_head(model: Any, num_classes: int, fed: Any) -> Any:
    """What follows the pooled features on the server: harmonizer + G, or nothing (the model's head);
    ``rates``: the harmonizer's own base rate (--harmonizer-lr; None: the server's)."""
    from torch import nn

    from fedsga_edge.method import Harmonizer

    class ServerHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            on = fed.harmonizer
            self.harmonizer = Harmonizer(model.feature_dim, model.num_splits, dim=fed.proto_dim,
                                         residual=fed.harmonizer_form == "residual") if on else None
            self.G = nn.Linear(self.harmonizer.dim, num_classes) if on else None
            self.rates = {"harmonizer": fed.harmonizer_lr} if on else {}

    return ServerHead()


def _phi_s_flops(fed: "FedSGA", h1: "Tensor", y: "Tensor") -> float:
    """FLOPs per row of phi_s's step (its forward and backward on the pooled p_1 features): the server's work."""
    from fedsga_edge.method import phi_s_loss

    from ..server_work import pass_flops

    protos, tau = fed.prototypes.protos, fed.cfg.fedsga.tau_a
    return pass_flops((fed.phi_s,), lambda phi: phi_s_loss(phi(h1), y, protos, tau), len(y))


@register_strategy
class FedSGA(Strategy):
    name = "fedsga"
    help = "each device picks its split with the sufficiency estimator (docs/method.md)"
    label = "**FedSGA**"
    adaptive = True
    requests = {"probe": "on_probe"}
    owns_options = ("fedsga",)

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        # --deadline-aware: each device's fleet class and the predictions it is sent
        self.deadlines = Deadlines(cfg, clients) if cfg.fedsga.deadline_aware else None

    @classmethod
    def check_config(cls, cfg: RunConfig, num_splits: int) -> None:
        if not cfg.fedsga.estimator:  # every device at --split, as in SplitFed
            check_split(cfg, num_splits)

    @classmethod
    def methods(cls) -> dict[str, Method]:
        out = {"fedsga": Method(cls.label)}
        labels = {"adapt": "w/o adaptation channel", "estimator": "w/o estimator (all at p_ref)",
                  "harmonizer": "w/o harmonizer"}
        for flag in _ABLATIONS:
            out[f"fedsga-no-{flag}"] = Method(labels[flag], group="ablation", overrides={f"fedsga.{flag}": False},
                                              split="ref" if flag == "estimator" else None)
        # a diagnostic beside static at p_K: the method's additions (prompts, harmonizer, phi_s) at the deepest split
        out["fedsga-no-estimator-pK"] = Method("FedSGA w/o estimator, all at p_K (diagnostic)", group="extension",
                                               overrides={"fedsga.estimator": False}, split="K", default=False)
        # beyond the paper, off by default and outside the paper's tables (docs/fleet.md, "Deadline-aware splits")
        out["fedsga-deadline"] = Method("FedSGA, deadline-aware (beyond the paper)", group="extension",
                                        overrides={"fedsga.deadline_aware": True}, default=False)
        # the paper's (w_s, {w_i}): each device's blocks its own, the server side shared (docs/method.md,
        # "Private fronts")
        out["fedsga-private"] = Method("FedSGA, private fronts", group="extension", overrides={"fronts": "private"},
                                       default=False)
        # the paper's harmonizer, a fresh two-layer MLP (the default is the identity-start residual form)
        out["fedsga-mlp"] = Method("FedSGA, the paper's harmonizer (two-layer MLP)", group="extension",
                                   overrides={"fedsga.harmonizer_form": "mlp"}, default=False)
        out["fedsga-memory"] = Method("FedSGA, label memory (beyond the paper)", group="extension",
                                      overrides={"fedsga.label_memory": True}, default=False)
        return out

    @classmethod
    def method_name(cls, cfg: RunConfig, num_splits: int) -> str:
        off = [flag for flag in _ABLATIONS if getattr(cfg.fedsga, flag) is False]
        pinned = []  # without the estimator every device sits at --split: named unless it is p_ref
        if "estimator" in off and num_splits and cfg.split != reference_index(num_splits):
            pinned = [split_suffix(cfg.split, num_splits)]
        return "-".join(["fedsga"] + [f"no-{flag}" for flag in off] + pinned
                        + (["deadline"] if getattr(cfg.fedsga, "deadline_aware", False) else [])
                        + (["memory"] if getattr(cfg.fedsga, "label_memory", False) else [])
                        + (["mlp"] if cfg.fedsga.harmonizer and cfg.fedsga.harmonizer_form == "mlp" else [])
                        + (["private"] if cfg.fronts == "private" else []))

    @classmethod
    def prompt_tokens(cls, cfg: RunConfig) -> int:
        return cfg.fedsga.prompts if cfg.fedsga.adapt else 0

    # -- configure the round ------------------------------------------------------------------------
    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        if not self.cfg.fedsga.estimator:  # ablation: everyone at --split (p_ref in the benchmark's ablation row)
            return {c: self.cfg.split for c in clients}
        return {c: None for c in clients}

    def calibrates(self, t: int) -> bool:
        fed = self.cfg.fedsga
        return fed.estimator and (t == 1 or t % max(fed.cal_every, 1) == 0)

    def accepts_split(self, assigned: int | None, k: int, calibrate: bool) -> bool:
        # a calibration round's probe compares the device's own blocks up to p_ref: it may go deeper
        return assigned is None or assigned == k or (calibrate and k >= assigned)

    def configure_round(self, t: int, devices: list[str]) -> dict[str, Instruction]:
        """FedSGA's device settings for every device (device/fedsga.py); a device that chooses its split also gets
        Gamma, phi_s and the prototypes to observe with, whether the round calibrates, and, on its own:
        --label-memory, its margin at its last calibration (0 before one), which it appends to its observation;
        --deadline-aware, its predicted round seconds per split and the deadline, from which it picks
        (fedsga_edge/method/policy.py ``deadline_split``)."""
        from fedsga_edge.tensors import to_numpy, to_numpy_state

        calibrate = self.calibrates(t)
        if self.deadlines is not None:
            self.deadlines.predicted = {}
        settings = {k: v for k, v in vars(self.cfg.fedsga).items() if k not in _SERVER_ONLY}
        out = {}
        for cid, i in super().configure_round(t, devices).items():
            if i.split is not None:
                out[cid] = i.with_fields(fedsga=settings)
                continue
            fields: dict[str, Any] = dict(
                fedsga=settings, calibrate=calibrate, estimator=to_numpy_state(self.estimator.state_dict()),
                phi_s=to_numpy_state(self.phi_s.state_dict()), prototypes=to_numpy(self.prototypes.protos),
                proto_dim=self.proto_dim)
            if self.cfg.fedsga.label_memory:
                fields["margin"] = self._sent_margin[cid] = self._margins.get(cid, 0.0)
            if self.deadlines is not None:
                fields.update(self.deadlines.fields(self, cid, calibrate))
            out[cid] = i.with_fields(**fields)
        return out

    def predict(self, cls: Any, cid: str, calibrate: bool) -> list[float]:
        """Device ``cid``'s predicted round seconds per split on fleet class ``cls`` (fedsga_deadline.py)."""
        return predict_device(self, cls, cid, calibrate)

    # -- the server side ----------------------------------------------------------------------------
    def attach(self, coordinator: Any) -> None:
        import torch

        from fedsga_edge.method import CalibrationBuffer, MonotoneEstimator, Prototypes, ShallowHead

        co, fed = coordinator, self.cfg.fedsga
        self.co = co
        model, dev = co.model, co.device
        self.head = _server_head(model, co.num_classes, fed).to(dev)
        self.proto_dim = self.head.harmonizer.dim if fed.harmonizer else model.feature_dim
        self.prototypes = Prototypes(co.num_classes, self.proto_dim, fed.mu_proto).to(dev)
        self._h1_dim = model.phi_input_dim  # the pooled p_1 features each activation carries
        self.phi_s = ShallowHead(self._h1_dim, self.proto_dim).to(dev)
        self.estimator = MonotoneEstimator(num_obs=3 if fed.adapt else 2, margin=fed.label_memory)
        self.cal_buffer = CalibrationBuffer(num_obs=self.estimator.num_obs)
        # the columns of o that are norms the device measured (delta[, q]); a trailing margin is the server's own
        self._norms = slice(1, 3 if fed.adapt else 2)
        # --label-memory: each device's margin log(Lref / L1) at its last probe, and what this round's start sent it
        self._margins: dict[str, float] = {}
        self._sent_margin: dict[str, float] = {}
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
            raise RemoteProtocolError("h1 must be pooled p_1 features, one row per sample")
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
        self.co.server.work.add("phi_s", len(y), lambda: _phi_s_flops(self, h1, y))  # coordinator/server_work.py
        self._phi_loss += float(loss.detach())
        self._phi_steps += 1

    def on_probe(self, co: Any, msg: "Message") -> tuple[str, dict[str, Any]]:
        """Calibration (docs/method.md): the device's interfaces at p_1 and p_ref (its own blocks, just
        trained), checked and kept; the label comes at the round's end (``label_probe``), when the server's
        blocks have had this round too. Nothing is updated."""
        import torch

        from fedsga_edge.coordinator.limits import MAX_ABS_VALUE

        if not co.round.calibrate:
            raise RemoteProtocolError("this round does not calibrate")
        if any(c["client"] == msg.sender for c in self._calibration):
            raise RemoteProtocolError("this device already probed this round")
        k_ref = reference_index(self.K)
        body = msg.body
        z1, y = co.check_activation(body, "z1", 1)
        zref, y2 = co.check_activation(body, "zref", k_ref)
        if not torch.equal(y, y2):
            raise RemoteProtocolError("z1 and zref must come from the same batch")
        o = np.asarray(body["o"], dtype=np.float64)
        r_prev = float(body["r_prev"])
        if o.shape != (self.cal_buffer.num_obs,) or not np.isfinite(o).all() or not 0.0 <= r_prev <= 1.0:
            raise RemoteProtocolError(f"o must be {self.cal_buffer.num_obs} finite values and r_prev in [0, 1]")
        # o = (a, delta[, q][, m]) (docs/method.md): a is a mean cosine, delta and q are norms of changes, m the
        # margin this round's start sent: the server's own copy is stored, whatever the device says it was
        norms = o[self._norms]
        if not (-1.0001 <= o[0] <= 1.0001 and (norms >= 0).all() and (norms <= MAX_ABS_VALUE).all()):
            raise RemoteProtocolError(f"o = {o.tolist()} is out of range: a in [-1, 1], delta and q in "
                                      f"[0, {MAX_ABS_VALUE:g}]")
        if self.cfg.fedsga.label_memory:
            o[-1] = self._sent_margin.get(msg.sender, 0.0)
        self._calibration.append({"client": msg.sender, "z1": z1, "zref": zref, "y": y, "o": self._bounded(o),
                                  "r_prev": r_prev})
        self._cal_flops_server += len(y) * (co.costs.suffix_fwd(1) + co.costs.suffix_fwd(k_ref))
        return "probe_result", {}

    def _bounded(self, o: np.ndarray) -> np.ndarray:
        """Clip delta (and q) to _OBS_CLIP x the stored pairs' median of each (the margin is the server's own)."""
        if len(self.cal_buffer) < _OBS_MIN:
            return o
        out = o.copy()
        for j in range(self._norms.start, self._norms.stop):
            typical = self.cal_buffer.typical(j)
            if typical:
                out[j] = min(out[j], _OBS_CLIP * typical)
        return out

    def begin_round(self, t: int, calibrate: bool) -> None:
        self._calibration, self._new_pairs, self._cal_flops_server = [], 0, 0
        self._phi_loss, self._phi_steps = 0.0, 0

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        if self.deadlines is not None:  # --deadline-aware: its timing, read at the next round start
            self.deadlines.keep(record, self.co.round.t)
        self._calibration = [label_probe(self, p) for p in self._calibration]  # the prototypes the round trained with
        self.prototypes.commit()
        record["clients"] = {cid: {k: u[k] for k in _RECORD_KEYS if k in u} for cid, u in updates.items()}
        for c in self._calibration:  # the server's own figures, whatever a device reports
            if c["client"] in record["clients"] and c["s"] is not None:
                record["clients"][c["client"]].update(L1=c["L1"], Lref=c["Lref"], s=c["s"])
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
        if self.deadlines is not None and self.deadlines.predicted:  # what each device was told (docs/fleet.md)
            record["deadline"] = {"s": float(self.cfg.round_timeout), "split_s": dict(self.deadlines.predicted)}

    def _refit(self) -> dict[str, Any]:
        """Score the Gamma that chose this round's splits on this round's new pairs (fitted before they came:
        ``heldout_brier``), then refit on every stored pair. Without any stored pair Gamma stays as it is
        (its prior at the start). docs/method.md, "Calibration"."""
        from fedsga_edge.method import fit
        from fedsga_edge.method.estimator import score

        new, total = self._new_pairs, len(self.cal_buffer)
        out: dict[str, Any] = {"probes": len(self._calibration), "new_pairs": new, "pairs": total,
                               "positive_rate": float(np.mean([c["s"] for c in self._calibration if c["s"] is not None]
                                                              or [np.nan])),
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
                "estimator": self.estimator.state_dict(), "cal_buffer": self.cal_buffer.state_dict(),
                "margins": dict(self._margins)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("prototypes", "phi_s", "estimator", "cal_buffer"):
            getattr(self, key).load_state_dict(state[key])
        self._margins = {str(c): float(m) for c, m in state.get("margins", {}).items()}

    def optimizer_state(self) -> dict[str, Any]:
        return {"phi_opt": self.phi_opt.state_dict()}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.phi_opt.load_state_dict(state["phi_opt"])


def label_probe(st: "FedSGA", probe: dict[str, Any]) -> dict[str, Any]:
    """A probe FedSGA ``st`` kept, labelled at the round's end: L1 through the server's blocks p_1..p_ref and
    Lref from the device's interface at p_ref, both on to the head through the same (aggregated) server side, so
    both paths have had this round (docs/method.md, "Calibration"). The pair is stored for the refit; nothing
    is updated."""
    from types import SimpleNamespace

    from fedsga_edge.method import sufficiency_label
    from fedsga_edge.method.estimator import informative
    from fedsga_edge.tensors import probe_mode

    side, y, o, r_prev = SimpleNamespace(model=st.co.model, head=st.head), probe["y"], probe["o"], probe["r_prev"]
    with probe_mode(side.model, side.head):
        L1 = float(st.loss(*st.forward(side, probe["z1"], 1), y))
        Lref = float(st.loss(*st.forward(side, probe["zref"], reference_index(st.K)), y))
    s = sufficiency_label(L1, Lref, st.cfg.fedsga.beta) if math.isfinite(L1) and math.isfinite(Lref) else None
    if s is not None and st.cfg.fedsga.label_memory:  # the next round start's margin: log(Lref / L1), bounded
        st._margins[probe["client"]] = float(np.clip(math.log((Lref + 1e-12) / (L1 + 1e-12)), -_MARGIN_CAP,
                                                     _MARGIN_CAP))
    # a device's first observation is the same point for everyone: it does not decide Gamma (docs/method.md)
    stored = s is not None and informative(o, r_prev)
    if stored:
        st.cal_buffer.append(o.tolist(), r_prev, s)
        st._new_pairs += 1
    return {"client": probe["client"], "L1": L1, "Lref": Lref, "s": s, "stored": stored}
