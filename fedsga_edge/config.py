"""Run configuration: plain data shared by the roles, the simulation and the CLI.

Each field is also its option's one declaration (``opt``: help, range, CLI spelling); the CLI, the
checks and the benchmark derive theirs from it (``fedsga_edge.options``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fedsga_edge.options import Opt, declared, opt, problems, to_config

__all__ = ["AUTO_WIRE", "RECORD_BEFORE", "record_settings", "SCHEDULES", "WIRE_CODECS", "WIRE_FORMATS", "DEVICE_ORDERS", "FedSGAConfig",
           "TrainConfig", "RunConfig", "from_wire", "run_options", "parse_model_args"]

# How the in-process simulation interleaves its devices (docs/method.md, "Rounds").
SCHEDULES = ("round_robin", "random", "sequential")
# Which device takes the first turn of a simulated round, and in which order the rest follow.
DEVICE_ORDERS = ("shuffled", "fixed")
# Activations / gradients on the wire (weights stay fp32), most precise first, and the codec's tensor_format each
# travels in (fedsga_edge/wire/codec.py). ``--wire-format auto``: the planner picks one per device and round.
WIRE_FORMATS = ("fp32", "fp16", "int8", "int4")
WIRE_CODECS: dict[str, str] = {"fp32": "raw", "fp16": "fp16", "int8": "int8", "int4": "int4"}
AUTO_WIRE = "auto"
# How the copies of one unit become its new global value (fedsga_edge/method/aggregation.py ``RULES``).
AGGREGATIONS = ("mean", "trimmed_mean", "median", "norm_bounded", "krum")
# Options whose default changed after runs were recorded: a run record (config.json, a checkpoint) that lacks
# the key ran with this value, not today's default (docs/method.md, "Batches": every run before the option cut
# its epochs with the tail rule). ``RunConfig.from_record`` applies it; so does the benchmark's record check.
# FedSGA's harmonizer was the paper's two-layer MLP before the residual form became the default.
RECORD_BEFORE: dict[str, Any] = {"train.batching": "tail", "fedsga.harmonizer_form": "mlp"}


def record_settings(data: Mapping[str, Any]) -> dict[str, Any]:
    """A run record's top-level keys as settings. FedAS's and FedMut's records once carried their weighting's
    description under ``aggregation`` (written over the setting of that name); those runs aggregated with the
    mean, the only rule then."""
    data = dict(data)
    if data.get("aggregation") not in (None, *AGGREGATIONS):
        data["aggregation"] = "mean"
    return data


@dataclass
class TrainConfig:
    """What a client needs to run its local epochs; travels in every ``round_start``."""

    local_epochs: int = opt(5, "Local epochs per round.", ge=1, le=1000)
    batch_size: int = opt(64, "Batch size.", ge=2, le=8192, note="BatchNorm needs two samples")
    lr: float = opt(0.1, "SGD learning rate (paper: 0.1 on CIFAR-10, 0.01 elsewhere).", gt=0, le=100, finite=True)
    momentum: float = opt(0.0, "SGD momentum (not stated in the paper: 0).", ge=0, lt=1)
    weight_decay: float = opt(5e-4, "SGD weight decay (not stated in the paper: 5e-4).", ge=0, le=1, finite=True)
    # proximal weight the device applies (the strategy sets it: FedProx sends prox_mu)
    mu: float = opt(0.0, "Proximal weight the device applies.", flag="--mu", cli=False, ge=0, le=1000, finite=True)
    augment: bool | None = opt(None, "Crop+flip (default: on except for digits).", flag="--augment/--no-augment")
    max_batches: int = opt(0, "Cap on batches per local epoch (0 = all).", ge=0, le=1_000_000, note="0 = all")
    # How an epoch's samples are cut into batches (docs/method.md, "Batches"): "balanced" (ceil(n / batch_size)
    # batches of nearly equal size, none under half a batch) or "tail" (full batches and the remainder, a last
    # batch of one folded into the one before: runs made before the option existed; a 2-sample batch per device
    # and round took FedSGA's digits runs from 95-98 % to 18-29 %).
    batching: str = opt("balanced", "How an epoch is cut into batches: balanced (equal sizes, none under half a "
                        "batch) | tail (full batches and the remainder: runs before this option).",
                        choices=("balanced", "tail"))
    # the device keeps the classifier head as it received it (the strategy sets it: FedBABU)
    freeze_head: bool = opt(False, "Whole-model rounds: train the body only, the head stays as received.",
                            cli=False)

    def problems(self) -> list[str]:
        """What is out of range, each naming its flag: the CLI and a device reading a ``round_start``
        both check here, so a bad value is refused before any training starts."""
        return problems(self)

    def to_wire(self) -> dict[str, Any]:
        """The ``round_start``'s "train" map. ``freeze_head`` travels only when set: a round of any other
        method has the bytes it had before the field existed, and a device that predates it can still
        take those rounds (it refuses a field it does not know)."""
        out = dict(vars(self))
        if not out["freeze_head"]:
            del out["freeze_head"]
        return out


_TAU = "--tau-a and --tau-m must be finite numbers in (0, 100]"


@dataclass
class FedSGAConfig:
    """Hyperparameters of the method (paper §4.1.3 defaults)."""

    rho: float = opt(0.1, "FedSGA split-policy budget rho (Eq. 8).", ge=0, le=1, finite=True)
    beta: float = opt(0.05, "FedSGA sufficiency margin beta (Eq. 7).", ge=0, le=10, finite=True)
    lambda_align: float = opt(0.1, "Prototype alignment weight lambda (Eq. 10).", ge=0, le=100, finite=True)
    tau_a: float = opt(0.5, "Prototype temperature tau_a (Eq. 9).", gt=0, le=100, finite=True, message=_TAU)
    tau_m: float = opt(0.5, "Prompt contribution temperature tau_m (Eq. 2).", gt=0, le=100, finite=True, message=_TAU)
    prompts: int = opt(4, "Prompt tokens per client m.", ge=0, le=256)
    mu_proto: float = opt(0.9, "Prototype EMA coefficient mu.", ge=0, le=1)
    cal_every: int = opt(5, "Calibrate the estimator every this many rounds (and round 1).", ge=1, le=100_000)
    adapt: bool = opt(True, "Ablation: no adaptation channel, o = [a, delta].", flag="--no-adapt", negated=True)
    estimator: bool = opt(True, "Ablation: every client at --split (the benchmark's ablation row: p_ref).", flag="--no-estimator", negated=True)
    harmonizer: bool = opt(True, "Ablation: pooled features straight to the head.", flag="--no-harmonizer",
                           negated=True)
    proto_dim: int = opt(128, "Harmonizer / prototype space (the residual form: its MLP's hidden width).", ge=1,
                         le=4096, cli=False)  # not a flag today
    harmonizer_form: str = opt(
        "residual", "residual (the default): Z = pool(u) + MLP(pool(u), e(k)) in the pooled space, the MLP's last "
        "layer at zero, so the harmonizer starts as the identity and every depth's head starts as one; mlp: the paper's "
        "Z = MLP(pool(u), e(k)) into a 128-d space (docs/method.md, \"Server side\").", choices=("mlp", "residual"))
    probe_holdout: float = opt(
        0.1, "Fraction of each device's data held out for the calibration probe, drawn each calibration round and "
        "not trained on in that round (0 = probe on training data) (docs/method.md, \"Calibration\").", ge=0, le=0.5,
        finite=True)
    prompt_lr: float = opt(
        0.1, "SGD learning rate of each device's private prompts (docs/method.md, \"Adaptation channel\": 1-3 "
        "moved them 10-30x further without making them useful, so the paper's device rate stays).",
        gt=0, le=1000, finite=True)
    harmonizer_lr: float | None = opt(
        None, "SGD learning rate of the harmonizer's MLP on the server (default: the server's rate, --server-lr); the "
        "classifier G and the server blocks keep the server's rate (docs/method.md, \"Server side\").",
        gt=0, le=100, finite=True)
    phi_lr: float = opt(
        0.3, "SGD learning rate of the shallow head phi_s on the server (docs/method.md, \"Observation\": its "
        "loss fell fastest at 0.3-1 and the alignment a swung at 1).",
        gt=0, le=100, finite=True)
    # Beyond the paper: off by default; the coordinator's alone (they never travel to a device:
    # a device reads their effect from its round start's "deadline" and "margin").
    deadline_aware: bool = opt(
        False, "Deadline-aware split policy, beyond the paper: a device never trains at a split whose predicted round "
        "seconds on its fleet class (its FLOPs over its speed, its bytes over its link, a round trip per request) miss "
        "--round-timeout; it takes the fitting split nearest the estimator's choice (docs/fleet.md, \"Deadline-aware "
        "splits\"). Needs --fleet and --round-timeout.", flag="--deadline-aware")
    label_memory: bool = opt(
        False, "Label memory, beyond the paper: the server keeps each device's margin log(Lref / L1) from its last "
        "calibration probe and sends it back in that device's round start as a fourth input of the estimator (r "
        "non-decreasing in it); the pair is stored with the margin the server sent (docs/method.md, \"Label "
        "memory\").", flag="--label-memory")

    def problems(self) -> list[str]:
        """What is out of range, each naming its flag (see ``TrainConfig.problems``)."""
        return problems(self)


def parse_model_args(items: list[str]) -> dict[str, Any]:
    """``--model-arg KEY=VALUE`` pairs; values parse as JSON when they can (numbers, booleans), else stay strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--model-arg {item!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


@dataclass
class RunConfig:
    dataset: str = opt("digits", "digits | cifar10 | cifar100 | tinyimagenet | domainnet[:d1,d2] | npz:PATH")
    data_root: str | None = opt(None, "Folder holding the dataset in its official layout.", path=True)
    partition: str = opt("iid", "iid | dirichlet | domain | mixed (even-positioned devices IID shares, odd ones "
                         "Dirichlet(--alpha) of the rest)", choices=("iid", "dirichlet", "domain", "mixed"))
    alpha: float = opt(0.1, "Dirichlet concentration (paper: 0.1).", gt=0, when=lambda c: c.partition != "iid")
    clients: int = opt(20, "Number of clients N (all participate every round).", ge=1)
    rounds: int = opt(100, "Communication rounds T (paper: 100 on CIFAR-10).", ge=1)
    lr_schedule: str = opt(
        "constant", "Learning rate over the rounds, devices' and server's alike: constant (the paper's) | cosine "
        "(round t at lr x (1 + cos(pi (t-1) / T)) / 2; the devices get the round's rate in its round_start).",
        choices=("constant", "cosine"))
    model: str = opt("resnet18_cifar", "The backbone")  # the CLI lists the registered backbones
    width: float | None = opt(None, "ResNet width multiplier (1.0 standard; 0.25 for CPU runs).")  # model_args["width"]
    model_args: dict[str, Any] = opt(
        help="Extra model option KEY=VALUE (repeatable), passed to the model factory.", factory=dict,
        flag="--model-arg", parse=parse_model_args, cli_type=list[str], cli_default=[])
    img_size: int | None = opt(None, "Input size (default: the dataset's).")
    pretrained: str | None = opt(None, "Local weights file (torchvision / timm / fedsga-edge).", path=True)
    strategy: str = opt("static", "The method that runs")  # the CLI lists the registered strategies
    split: int = opt(2, "1-based split index for --strategy static and FedSGA --no-estimator (ResNet: 1=after layer1 .. 3=after layer3).")
    seed: int = opt(0, "Seed for partitions, initialisation and batching.")
    device: str = opt("auto", "auto (CUDA when present) | cpu | cuda | cuda:N")
    train_subset: int = opt(0, "Use only this many training samples, stratified (0 = all).")
    eval_every: int = opt(1, "Evaluate every this many rounds (and the last).")
    eval_holdout: float = opt(
        0.0, "Federated evaluation: the fraction of each device's own data held out (never trained on, at least 2 "
        "samples) on which it evaluates the global model it starts a round with (round 1 and every round after an "
        "evaluation round; docs/protocol.md, \"Federated evaluation\"); 0 = off.", ge=0, le=0.5, finite=True)
    speed_sigma: float = opt(0.5, "--strategy resource: log-normal spread of device speeds.")
    profile: str | None = opt(
        None, "--strategy resource: a measured `fedsga-edge profile --json` of a median device (its latency per "
        "split; a device's own is `device --latency-profile`, docs/method.md, \"Strategies\").", path=True)
    fleet: str | None = opt(
        None, "A fleet file (TOML: device classes with a count, a compute speed, a link and an availability; "
        "docs/fleet.md): simulate runs the devices on a virtual clock (their FLOPs over their speed, their bytes "
        "over their link), --round-timeout and dropouts act on that clock; trial runs each device process under its "
        "class's CPU quota and link; --strategy resource takes the devices' speeds from it (simulate, coordinator, "
        "trial).", path=True)
    server_copies: str = opt(
        "shared", "shared: one server copy trained on the clients in turn (SplitFed-v2 style); "
        "per-client: each client trains its own copy, averaged every round (SplitFed-v1 style).",
        choices=("shared", "per_client"), dashed=True)
    fronts: str = opt(
        "shared", "The blocks a device runs: shared (averaged across devices at the round's end, with the server's "
        "copy) | private (each device keeps its own copy of every block up to the deepest split, never averaged; "
        "only the server side is shared, the paper's (w_s, {w_i}); docs/method.md, \"Private fronts\").",
        choices=("shared", "private"))
    server_bn: str = opt(
        "ema", "Server-side BatchNorm running statistics: ema (torch's momentum 0.1: the last ~10 batches "
        "dominate) | round (the average over the round's batches, every device weighed by its data).",
        choices=("ema", "round"))
    server_lr: float | None = opt(
        None, "Learning rate of the server-side SGD (default: --lr). The shared copy takes every device's "
        "steps, so it moves ~N times as far per round as an averaged copy (docs/method.md, \"The server's learning "
        "rate\").", gt=0, finite=True)
    server_bn_context: int = opt(
        0, "Shared server copy: normalise each device's batch in the server's BatchNorm layers together with "
        "the latest activations of up to N other devices at the same split (no loss on their rows). Under label "
        "skew a single device's batch is nearly one class (docs/method.md, \"Server-side BatchNorm statistics\").",
        ge=0)
    server_steps: int = opt(
        1, "Server optimizer steps on each accepted activation, on the copy it trains (the device's gradient is "
        "the first's), times a method's own (MU-SplitFed's tau): SplitFed at another method's server work "
        "(docs/method.md, \"Costs\"). Not with --server-bn-context, nor with MultiSFL's or MergeSFL's own server "
        "sides.", ge=1, le=64)
    clip_activations: float = opt(
        3.0, "Bounded influence of one device: an activation sample whose L2 norm exceeds this many times the "
        "other devices' typical norm at its split (the upper median over them of each one's median) is scaled "
        "down to that bound before the server step; 0 = off (docs/protocol.md, \"Bounded influence\").", ge=0,
        finite=True)
    clip_updates: float = opt(
        5.0, "Bounded influence of one device: its change of an aggregation unit is scaled down to this many "
        "times the other devices' median change of that unit (with 3 or more devices); 0 = off.", ge=0,
        finite=True)
    aggregation: str = opt(
        "mean", "How the copies of a unit are combined, whatever the strategy: mean (weighted by data) | "
        "trimmed-mean (coordinate-wise, the --trim-fraction largest and smallest values left out) | median "
        "(coordinate-wise) | norm-bounded (each copy's change scaled to at most the median change, then the "
        "weighted mean) | krum (multi-Krum: the --trim-fraction of copies farthest from their nearest neighbours "
        "left out whole, the rest averaged); docs/protocol.md, \"Robust aggregation\".", choices=AGGREGATIONS,
        dashed=True)
    trim_fraction: float = opt(
        0.2, "--aggregation trimmed-mean: the fraction of copies cut at each end of every coordinate; krum: the "
        "fraction of copies assumed hostile (at least one).", ge=0, lt=0.5,
        when=lambda c: c.aggregation in ("trimmed_mean", "krum"))
    quarantine: float = opt(
        0.0, "Anomaly scores act: an activation batch whose median norm is more than 2^S times (or less than 2^-S "
        "times) the other devices' is refused before it steps the server; a device whose round scores beyond S "
        "(activations, server-side loss) or whose update points against the others' is left out of that round's "
        "aggregation; --quarantine-rounds such rounds in a row quarantine it for the rest of the run; 0 = off "
        "(scores are recorded either way; docs/protocol.md, \"Anomaly scores and quarantine\").", ge=0, finite=True)
    quarantine_rounds: int = opt(
        2, "--quarantine: consecutive rounds beyond the threshold before a device is quarantined.", ge=1)
    sample_cap: float = opt(
        3.0, "A sample count the coordinator cannot verify (devices bringing their own data) weighs at most "
        "this many times the fleet's median count; 0 = the counts as claimed (docs/protocol.md, \"Claims\").",
        ge=0, finite=True)
    schedule: str = opt(
        "round_robin", "How devices interleave: round-robin (one local step each in turn) | random (seeded) | "
        "sequential (one device after another).", choices=SCHEDULES, dashed=True)  # simulation only
    device_order: str = opt(
        "shuffled", "The order the simulated devices take their turns in: shuffled (a permutation drawn per round "
        "from --seed, the same for the same seed) | fixed (partition order, client-000 first, every round). "
        "Simulation only (docs/method.md, \"Rounds\").", choices=DEVICE_ORDERS)  # simulation only
    round_timeout: float = opt(
        0.0, "Seconds a round may last; devices still training then are left out of it (0 = no deadline).",
        ge=0, note="0 = no deadline")
    prox_mu: float = opt(0.01, "FedProx proximal weight (used by --strategy fedprox).", flag="--mu", ge=0)
    wire_format: str = opt(
        "fp32", "Tensor encoding of the per-batch activations and gradients on the wire: fp32 | fp16 (half the "
        "bytes) | int8 (a quarter, per-tensor scale) | int4 (0.129x, a float32 scale per 256 values) | auto (--strategy "
        "planner: each device's format per round, the most precise that keeps the round's makespan; docs/fleet.md). "
        "Weights always travel fp32 (docs/protocol.md, \"Messages\").",
        choices=WIRE_FORMATS + (AUTO_WIRE,))
    train: TrainConfig = field(default_factory=TrainConfig)
    fedsga: FedSGAConfig = field(default_factory=FedSGAConfig)
    # the chosen strategy's own options (``Strategy.options``), by name; the CLI fills in their defaults
    strategy_args: dict[str, Any] = field(default_factory=dict)

    def lr_scale(self, t: int) -> float:
        """Round t's factor on every learning rate of the devices' and the server's SGD (--lr-schedule); 1 when
        constant. A decaying rate lets the last rounds settle instead of swinging (benchmarks/RESULTS.md)."""
        if self.lr_schedule == "constant":
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * (min(max(t, 1), self.rounds) - 1) / self.rounds))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def problems(self) -> list[str]:
        """Every declared option out of range, each naming its flag (strategy and cross-option rules:
        ``runbuild.validate_config``)."""
        return problems(self)

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

    @classmethod
    def from_record(cls, data: Mapping[str, Any], *, drop_unknown: bool = True) -> "RunConfig":
        """The config a run folder or checkpoint recorded, an option the record predates set to what that run
        did (``RECORD_BEFORE``), not to today's default, so a resumed or re-simulated old run trains as it did.
        ``drop_unknown``: keys beside the config in config.json (``client_sizes``, ``method``) are dropped;
        False refuses them, as ``from_dict`` does."""
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in record_settings(data).items() if k in known or not drop_unknown}
        for key, before in RECORD_BEFORE.items():
            section, _, name = key.rpartition(".")
            if section:
                data[section] = {name: before} | dict(data.get(section) or {})
            else:
                data.setdefault(name, before)
        return cls.from_dict(data)

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], strategy_options: Sequence[Opt] = ()) -> "RunConfig":
        """The config that command-line values describe (keys: parameter names such as ``mu``,
        ``no_adapt``; absent ones take their defaults). ``strategy_options``: the chosen strategy's
        declarations, whose values go to ``strategy_args``. Raises ValueError for a value that does
        not parse (``--model-arg``)."""
        flags = dict(flags)
        sections: dict[str, dict[str, Any]] = {"": {}, "train.": {}, "fedsga.": {}}
        for o in run_options():
            if o.cli and o.param in flags:
                sections[o.key[: len(o.key) - len(o.name)]][o.name] = to_config(o, flags.pop(o.param))
        args = {o.name: to_config(o, flags.pop(o.param, o.command_line_default())) for o in strategy_options}
        if flags:
            raise TypeError(f"not run options: {sorted(flags)}")
        return cls(**sections[""], train=TrainConfig(**sections["train."]), fedsga=FedSGAConfig(**sections["fedsga."]),
                   strategy_args=args)


def run_options() -> tuple[Opt, ...]:
    """Every declared run option, ``train.*`` and ``fedsga.*`` included, in field order."""
    return declared(RunConfig)


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
