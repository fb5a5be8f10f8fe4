"""FedSGA's device side (docs/method.md): the prompts, the split the device picks, and the calibration probe.

A plug-in like every method's device side (device/methods.py), armed by the round start's ``fedsga``
settings: its fields ride at the round start's top level (``fedsga``, and for a device that chooses its
split ``calibrate``, ``estimator``, ``phi_s``, ``prototypes``, ``proto_dim``, per device ``margin`` and
``deadline``), as the wire has always carried them. At the role's fixed points it

* ``prepare``: on a calibration round holds the probe slice out (back after the probe), makes the prompts,
  and, when the coordinator named no split, observes (the round's global blocks, eval mode), estimates r with
  Gamma and picks the split
  (Eq. 8; at least p_ref on a calibration round; never one predicted to miss the deadline);
* ``after_train``: keeps the trained prompts, their descriptor (Eq. 2) and how far they moved (q, Eq. 5);
* ``requests``: on a calibration round, the probe after local training;
* ``report``: nothing under ``method``: its figures (a, delta, q, r ...) are the update's own (the probe's
  label is the server's, made at the round's end).

The method's arithmetic is numpy (``fedsga_edge.method``), so it runs the same on every backend; the
prefix's comes from the backend. No torch here.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from fedsga_edge.config import FedSGAConfig, from_wire
from fedsga_edge.method.adaptation import descriptor, descriptor_weights, weight_entropy
from fedsga_edge.method.heads import estimate, shallow_head
from fedsga_edge.method.observation import Observation, alignment, drift, prompt_variation
from fedsga_edge.method.policy import deadline_split, reference_index, split_index

from .backend import Refused, Steps, expect
from .methods import DeviceMethod, register_device_method

__all__ = ["FedSGADevice"]


@register_device_method
class FedSGADevice(DeviceMethod):
    """FedSGA on the device; ``settings`` is the round start itself (its fields are top-level ones)."""

    name = "fedsga"
    field = "fedsga"
    chooses_split = True

    _CHOOSER_FIELDS: ClassVar[tuple[str, ...]] = ("estimator", "phi_s", "prototypes", "proto_dim")

    def __init__(self, settings: dict[str, Any]) -> None:
        super().__init__(settings)
        self.fed = from_wire(FedSGAConfig, settings["fedsga"])
        self._o: list[float] = []  # this round's observation vector: private, sent only in a probe

    @classmethod
    def check(cls, settings: dict[str, Any]) -> None:
        from_wire(FedSGAConfig, settings["fedsga"])
        if settings.get("split") is None and not settings.get("full"):
            for key in cls._CHOOSER_FIELDS:
                settings[key]
        margin = settings.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                   or not math.isfinite(margin) or abs(margin) > 1e6):
            raise ValueError(f"margin must be a finite number, not {margin!r:.40}")
        deadline = settings.get("deadline")
        if deadline is not None:  # the deadline-aware policy's predictions: checked before anything trains
            if not isinstance(deadline, dict) or not isinstance(deadline.get("split_s"), (list, tuple)):
                raise TypeError("deadline must be a map with a split_s list")
            deadline_split(1, list(deadline["split_s"]), deadline.get("s"))

    # -- before the first request ------------------------------------------------------------------
    def prepare(self, client: Any, plan: Any) -> None:
        fed, be = self.fed, client.backend
        client.data.release_probe()  # a round that broke off after holding it out
        if fed.estimator and not plan.full and self.settings.get("calibrate"):  # probe on data this round never saw
            seq = client._probe_seq
            client.data.hold_out_probe(fed.probe_holdout, np.random.SeedSequence(
                seq.entropy, spawn_key=(*seq.spawn_key, client.state.rounds)))  # a fresh slice each calibration round
        use_prompts = fed.adapt and fed.prompts > 0
        if use_prompts and client.state.prompts is None:
            client.state.prompts = be.init_prompts(fed.prompts)
        plan.prompts = client.state.prompts if use_prompts else None
        plan.want_h1 = not plan.full  # phi_s trains on pooled p_1 features (docs/method.md)
        plan.prompt_lr = fed.prompt_lr if plan.prompts is not None else None  # docs/method.md, "Adaptation channel"
        if plan.k is None:
            self._choose(client, plan)

    def _choose(self, client: Any, plan: Any) -> None:
        """Observe, estimate r, pick the split (docs/method.md); a calibration round probes at p_ref or deeper."""
        K = client.backend.num_splits
        calibrate = bool(self.settings.get("calibrate"))
        k, report = self.choose_split(client, plan.prompts)
        floor = reference_index(K) if calibrate else 1
        k = max(k, floor)  # a calibration round's probe compares the device's own trained blocks up to p_ref
        deadline = self.settings.get("deadline")
        if deadline is not None:  # --deadline-aware (docs/fleet.md): never a split predicted to miss the deadline
            if len(deadline["split_s"]) != K:
                raise Refused(f"the deadline's predictions cover {len(deadline['split_s'])} splits, not {K}")
            k = deadline_split(k, list(deadline["split_s"]), deadline["s"], floor)
        plan.k = k
        plan.report.update(report)
        plan.calibrate = calibrate and k >= reference_index(K)  # kept shallower than p_ref by the deadline: no probe

    def choose_split(self, client: Any, prompts: np.ndarray | None) -> tuple[int, dict[str, Any]]:
        """Observation at round start (the round's global blocks, eval mode) -> r -> split (Eq. 8)."""
        body, fed, state = self.settings, self.fed, client.state
        K = client.backend.num_splits
        idx = client._one_batch(body["train"]["batch_size"])
        x, y = client._inputs(idx, augment=False)
        hbar = client.backend.observe(x, prompts)  # (B, C) pooled p_1 features
        H = hbar.mean(axis=0)
        obs = Observation(
            a=alignment(shallow_head(body["phi_s"], hbar), body["prototypes"], y),
            delta=drift(H, state.H_prev),
            q=float(state.extra.get("q", 0.0)),  # 0 before the prompts have trained once
        )
        state.H_prev = H
        o = obs.values(adapt=fed.adapt)
        if "margin" in body:  # --label-memory: the margin the server kept from this device's last probe
            o.append(float(body["margin"]))
        r_prev = state.r_prev
        r = estimate(body["estimator"], o, r_prev)
        k = split_index(r, K, fed.rho)
        state.r_prev = r
        self._o = o
        report = {"a": obs.a, "delta": obs.delta, "q": obs.q, "r_prev": r_prev, "r": r, "k_policy": k,
                  "obs_samples": len(y)}  # the observation forward is client compute too (docs/method.md, "Costs")
        if "margin" in body:
            report["margin"] = o[-1]
        return k, report

    # -- after local training ----------------------------------------------------------------------
    def after_train(self, client: Any, plan: Any, trained: Any) -> None:
        """Keeps the trained prompts, their descriptor (Eq. 2) and how far they moved (q, Eq. 5) for the
        next round's observation.

        q = ||sum_k alpha_k (e_k after - e_k before)|| with this round's weights alpha on both sides
        (docs/method.md, "Observation"): it follows the prompts' movement, not which token alpha favours.
        """
        before = plan.prompts
        prompts = before
        if before is not None and trained.new_prompts is not None:
            client.state.prompts = plan.prompts = prompts = trained.new_prompts
        if prompts is not None and trained.contrib is not None:
            tau_m = self.fed.tau_m
            mean_c = trained.contrib / max(trained.steps, 1)
            alpha = descriptor_weights(mean_c, tau_m)
            client.state.m_prev = client.state.m_last
            client.state.m_last = descriptor(prompts, mean_c, tau_m)
            client.state.extra["q"] = prompt_variation(prompts, before, alpha)
            plan.report["descriptor_entropy"] = weight_entropy(alpha)

    def requests(self, client: Any, plan: Any) -> Steps[None]:
        """On a calibration round: the probe, after local training and before aggregation (docs/method.md)."""
        report = plan.report
        if plan.calibrate and "r" in report:
            probe = self.probe(client, plan.train.batch_size, plan.prompts, self._o, report["r_prev"])
            expect((yield "probe", probe), "probe_result")  # the label is the server's, at the round's end
            report["probe_samples"] = len(probe["y"])
        client.data.release_probe()  # held out on a calibration round only (docs/method.md, "Calibration")

    def report(self, client: Any, plan: Any) -> dict[str, Any] | None:
        return None  # FedSGA's figures are the update's own fields

    @staticmethod
    def probe(client: Any, batch_size: int, prompts: np.ndarray | None, o: list[float],
              r_prev: float) -> dict[str, Any]:
        """One batch through the device's own (locally trained) blocks to p_1 and on to p_ref, from the
        held-out probe slice when there is one (docs/method.md, "Calibration")."""
        be = client.backend
        d1, dref = be.depth_of(1), be.depth_of(reference_index(be.num_splits))
        idx = _probe_batch(client, batch_size)
        x, y = client._inputs(idx, augment=False)
        z1, zref = be.probe(x, prompts, d1, dref)
        return {"z1": z1, "zref": zref, "y": y, "o": o, "r_prev": r_prev}


def _probe_batch(client: Any, batch_size: int) -> np.ndarray:
    """Up to one batch of the probe slice (a batch of the training data when there is no slice)."""
    held = client.data.probe_indices
    if held is None:
        return client._one_batch(batch_size)
    return held[client.rng.permutation(len(held))][:batch_size]
