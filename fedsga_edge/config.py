"""Run configuration: plain data shared by the roles, the simulation and the CLI."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["SCHEDULES", "FedSGAConfig", "TrainConfig", "RunConfig", "from_wire"]

# How the in-process simulation interleaves its devices (docs/method.md, "Rounds").
SCHEDULES = ("round_robin", "random", "sequential")


@dataclass
class TrainConfig:
    """What a client needs to run its local epochs; travels in every ``round_start``."""

    local_epochs: int = 5
    batch_size: int = 64
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 5e-4
    mu: float = 0.0  # proximal weight the device applies (the strategy sets it: FedProx sends prox_mu)
    augment: bool | None = None  # random crop (pad 4) + horizontal flip; None = auto (not for digits)
    max_batches: int = 0  # cap on batches per local epoch (0 = all); for quick smoke runs

    def problems(self) -> list[str]:
        """What is out of range, each naming its flag: the CLI and a device reading a ``round_start``
        both check here, so a bad value is refused before any training starts."""
        out = []
        if self.local_epochs < 1:
            out.append("--local-epochs must be >= 1")
        if self.batch_size < 2:
            out.append("--batch-size must be >= 2 (BatchNorm needs two samples)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            out.append("--lr must be a finite number > 0")
        if not 0 <= self.momentum < 1:
            out.append("--momentum must lie in [0, 1)")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            out.append("--weight-decay must be a finite number >= 0")
        if not (self.mu >= 0 and math.isfinite(self.mu)):
            out.append("--mu must be a finite number >= 0")
        if self.max_batches < 0:
            out.append("--max-batches must be >= 0 (0 = all)")
        return out


@dataclass
class FedSGAConfig:
    """Hyperparameters of the method (paper §4.1.3 defaults)."""

    rho: float = 0.1
    beta: float = 0.05
    lambda_align: float = 0.1
    tau_a: float = 0.5
    tau_m: float = 0.5
    prompts: int = 4
    mu_proto: float = 0.9
    cal_every: int = 5
    adapt: bool = True  # False: the no-adapt ablation, o = [a, delta] and no prompts
    estimator: bool = True  # False: every client at p_ref
    harmonizer: bool = True  # False: pooled features straight to the head, no alignment loss
    proto_dim: int = 128  # harmonizer / prototype space

    def problems(self) -> list[str]:
        """What is out of range, each naming its flag (see ``TrainConfig.problems``)."""
        out = []
        for name in ("rho", "beta", "lambda_align"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                out.append(f"--{name.replace('_', '-')} must be a finite number >= 0")
        if self.cal_every < 1:
            out.append("--cal-every must be >= 1")
        if not 0 <= self.mu_proto <= 1:
            out.append("--mu-proto must lie in [0, 1]")
        if not (self.tau_a > 0 and self.tau_m > 0 and math.isfinite(self.tau_a) and math.isfinite(self.tau_m)):
            out.append("--tau-a and --tau-m must be finite numbers > 0")
        if self.prompts < 0:
            out.append("--prompts must be >= 0")
        if self.proto_dim < 1:
            out.append("--proto-dim must be >= 1")
        return out


@dataclass
class RunConfig:
    dataset: str = "digits"
    data_root: str | None = None
    partition: str = "iid"
    alpha: float = 0.1
    clients: int = 20
    rounds: int = 100
    model: str = "resnet18_cifar"
    width: float | None = None  # shorthand for model_args["width"] (ResNets)
    model_args: dict[str, Any] = field(default_factory=dict)  # passed to the model factory as keywords
    img_size: int | None = None
    pretrained: str | None = None
    strategy: str = "static"
    split: int = 2  # 1-based split index for `static`
    seed: int = 0
    device: str = "auto"
    train_subset: int = 0  # use only this many training samples (0 = all), stratified by the seed
    eval_every: int = 1
    speed_sigma: float = 0.5  # `resource`: log-normal spread of client speed factors
    profile: str | None = None  # `resource`: a measured latency profile (fedsga-edge profile --json)
    server_copies: str = "shared"  # "shared": one server copy, batches interleaved; "per_client": averaged copies
    server_bn: str = "ema"  # server BN running stats: "ema" = torch's momentum 0.1; "round" = the round's batches averaged
    server_lr: float | None = None  # server-side SGD rate (None: train.lr); docs/method.md, "The server's learning rate"
    server_bn_context: int = 0  # shared copy: other devices' latest activations in each batch's BN statistics (docs/method.md)
    schedule: str = "round_robin"  # simulation only: SCHEDULES
    round_timeout: float = 0.0  # seconds a round may last before missing devices are dropped (0 = no deadline)
    prox_mu: float = 0.01  # FedProx's proximal weight (the CLI's --mu)
    wire_format: str = "fp32"  # activations / gradients on the wire: fp32 | fp16 | int8 (weights stay fp32)
    train: TrainConfig = field(default_factory=TrainConfig)
    fedsga: FedSGAConfig = field(default_factory=FedSGAConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        data = dict(data)
        data["train"] = TrainConfig(**data.get("train", {}))
        data["fedsga"] = FedSGAConfig(**data.get("fedsga", {}))
        return cls(**data)


def from_wire(cls: type, data: Any) -> Any:
    """Build a flat config dataclass from a peer's map, checking every value's type.

    Messages come from other machines: a string where a number belongs must be refused here, not
    crash a training step later. bool is not accepted for numbers, int is accepted for floats.
    """
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} must be a map, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    for name, value in data.items():
        default = getattr(cls, name, None)
        kind = type(default) if default is not None else (bool, type(None))
        ok = (
            isinstance(value, bool) if kind is bool
            else isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
            else isinstance(value, int) and not isinstance(value, bool) if kind is int
            else isinstance(value, kind)
        )
        if not ok:
            raise TypeError(f"{cls.__name__}.{name} = {value!r} has the wrong type")
    obj = cls(**data)
    bad = obj.problems() if hasattr(obj, "problems") else []
    if bad:
        raise ValueError(f"{cls.__name__}: {'; '.join(bad)}")
    return obj
