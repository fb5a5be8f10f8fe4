"""The strategy contract and its registry: one registered object per method, owning what differs.

A strategy is Flower's shape: it configures each device's round (``configure_round``: one
``Instruction`` per device: the split from ``assign``, the local settings, the method's fields;
``lr_scale``: the round's rate, for the devices and the server side alike), takes the server-side
step it wants (``forward`` / ``loss`` / ``after_step``), answers the requests only it understands (``requests``, e.g. FedSGA's probe), weighs and closes the round
(``weight``, ``end_round``) and says how the model is evaluated (``eval_logits``). The
coordinator calls these hooks and never asks which strategy runs.

A new baseline is one file in ``coordinator/strategies/`` holding a ``Strategy`` subclass with
``@register_strategy``, plus its import line in ``coordinator/strategies/__init__.py``. It then
appears in ``simulate --help`` (``name``, ``help``), in ``benchmarks/accuracy.py`` and in the
report (``methods``: the named variants it contributes, with their labels).

Importing this module, or the strategies package, needs no torch: a torch-free device validates
its config against the registry. Strategies import torch inside the hooks that use it.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fedsga_edge.config import RunConfig
from fedsga_edge.method.policy import reference_index
from fedsga_edge.options import Opt, class_options, resolve_args
from fedsga_edge.wire import RemoteProtocolError

from .instructions import Instruction

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Method", "Strategy", "register_strategy", "unregister_strategy", "get_strategy", "create_strategy",
           "list_strategies", "all_methods", "method_of", "check_split", "parse_cut", "split_suffix", "head_state"]

_REGISTRY: dict[str, type["Strategy"]] = {}


@dataclass(frozen=True)
class Method:
    """A named variant a strategy contributes to the benchmark and the report.

    ``overrides`` are RunConfig fields (``"fedsga.adapt": False``) set on top of the benchmark's
    preset; ``split`` pins a split-at-one-depth method to "1" (p_1), "ref" (p_ref) or "K" (p_K).
    ``group``: "main" rows go into the accuracy table (Table 2), "ablation" rows into Table 4.
    """

    label: str
    group: str = "main"
    overrides: dict[str, Any] = field(default_factory=dict)
    split: str | None = None
    default: bool = True  # run by the benchmark when no --methods are given


def register_strategy(cls: type["Strategy"]) -> type["Strategy"]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"strategy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_strategy(name: str) -> None:
    """Take a strategy out of the registry (a test's throwaway strategy, after the test)."""
    _REGISTRY.pop(name, None)


def _load_builtin() -> None:
    importlib.import_module("fedsga_edge.coordinator.strategies")  # each module registers itself


def list_strategies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type["Strategy"]:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def create_strategy(cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> "Strategy":
    cls = get_strategy(cfg.strategy)
    cls.check_config(cfg, num_splits)
    return cls(cfg, num_splits, clients, train_flops)


def all_methods() -> dict[str, tuple[str, Method]]:
    """Every registered method variant: name -> (strategy name, Method), in registration order."""
    _load_builtin()
    out: dict[str, tuple[str, Method]] = {}
    for name, cls in _REGISTRY.items():
        for method, spec in cls.methods().items():
            if method in out:
                raise ValueError(f"method {method!r} is contributed by {out[method][0]!r} and {name!r}")
            out[method] = (name, spec)
    return out


def method_of(cfg: RunConfig, num_splits: int) -> dict[str, str]:
    """The method a config runs, as config.json records it for the report: name, label and group."""
    cls = get_strategy(cfg.strategy)
    name = cls.method_name(cfg, num_splits)
    spec = cls.methods().get(name)
    return {"name": name, "label": spec.label if spec else name, "group": spec.group if spec else "main"}


def split_suffix(split: int, num_splits: int) -> str:
    """How a method pinned to one split names it: "p1", "pK" or "k<split>" (p_ref is the unnamed default)."""
    return "p1" if split == 1 else "pK" if split == num_splits else f"k{split}"


def check_split(cfg: RunConfig, num_splits: int) -> None:
    """For the strategies that put every device at ``--split`` (SplitFed and the baselines built on it)."""
    if not 1 <= cfg.split <= num_splits:
        raise ValueError(f"--split must be in 1..{num_splits} for {cfg.model}")


def parse_cut(token: str, num_splits: int, flag: str) -> int:
    """One cut as the fixed-cut strategies (mix, phased) spell it: ``1``..``K``, ``ref`` (p_ref) or ``K`` (p_K)."""
    token = token.strip()
    if token == "ref":
        return reference_index(num_splits)
    if token == "K":
        return num_splits
    try:
        k = int(token)
    except ValueError:
        raise ValueError(f"{flag}: {token!r} is not a cut (1..{num_splits}, ref or K)") from None
    if not 1 <= k <= num_splits:
        raise ValueError(f"{flag}: cut {k} is outside 1..{num_splits}")
    return k


def head_state(model: Any) -> dict[str, "Tensor"]:
    """A copy of the model's head (its last unit): what FedBABU and FedGH put back after aggregation."""
    state = model.state_dict()
    return {n: v.detach().clone() for n, v in state.items() if model.unit_of(n) == model.num_blocks}


class Strategy:
    """Base: every device at one split, plain local SGD, updates weighted by |D_i|, plain head."""

    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    label: ClassVar[str] = ""  # the report's and the benchmark's row label (default: name)
    adaptive: ClassVar[bool] = False  # splits can differ between devices and rounds
    # Request kinds only this strategy answers: kind -> method name taking (coordinator, msg), returning
    # (reply kind, reply body). The round's per-device sequence (coordinator/round.py) must allow the kind.
    requests: ClassVar[dict[str, str]] = {}
    # The method's own hyperparameters (flags --<name>-<option>, values in cfg.strategy_args; read self.args)
    options: ClassVar[tuple[Opt, ...]] = ()
    # Run options only this strategy reads: RunConfig keys, or a group of them ("fedsga": --rho, --deadline-aware
    # ...). Set off its default under another --strategy, such an option is refused instead of silently ignored.
    owns_options: ClassVar[tuple[str, ...]] = ()
    # Run options this strategy never reads (RunConfig keys): FedAvg's devices train the whole model, so no server
    # option reaches its training. A benchmark record that differs from its plan only in these still stands for
    # it (benchmarks/accuracy.py); tests/test_strategies.py checks each declaration by training both ways.
    ignores_options: ClassVar[tuple[str, ...]] = ()
    # In an evaluation round its whole-model devices also report a fine-tuned figure (``eval_loss_finetuned``,
    # ``eval_acc_finetuned``: FedBABU's personalised accuracy); the coordinator requires it then, and refuses it
    # from every other strategy's devices (coordinator/evaluation.py)
    finetuned_eval: ClassVar[bool] = False
    # Its devices run passes beyond training (FedAS's alignment and Fisher trace, FedGH's class means) that each
    # round's record counts as ``method_flops``; a record without that count predates it (benchmarks/accuracy.py
    # tables its client FLOPs as "—" then, not as training alone)
    device_passes: ClassVar[bool] = False

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        self.cfg = cfg
        self.K = num_splits
        self.clients = list(clients)
        self.args = resolve_args(class_options(type(self)), cfg.strategy_args)

    # -- what the strategy is, before any run (torch-free) ------------------------------------------
    @classmethod
    def methods(cls) -> dict[str, Method]:
        return {cls.name: Method(cls.label or cls.name)}

    @classmethod
    def method_name(cls, cfg: RunConfig, num_splits: int) -> str:
        """Which of ``methods()`` this config runs (the benchmark's and report's name)."""
        return cls.name

    @classmethod
    def check_config(cls, cfg: RunConfig, num_splits: int) -> None:
        """A ValueError naming what this strategy cannot run with ``cfg`` on a model of ``num_splits`` splits:
        called once the model is built and before anything slow (its cost table), so that a bad ``--split``
        is an error in a second. Nothing by default."""

    @classmethod
    def prompt_tokens(cls, cfg: RunConfig) -> int:
        """Prompt tokens m each device trains (its costs, its exported prefix); 0 without prompts."""
        return 0

    # -- the devices ----------------------------------------------------------------------------------
    def device_registered(self, cid: str, hello: dict[str, Any]) -> None:
        """A field run's device registered (again, or restored on resume): what the service kept of its
        checked hello (``backend``, ``capabilities``, ``profile`` when it reported one; docs/protocol.md).
        Called under the service's lock, before the round the device joins starts; never in ``simulate``.
        ``resource`` takes the device's speed from its profile. Nothing by default."""

    def device_left(self, cid: str) -> None:
        """A field run's device said ``bye``: it is no longer registered (it may register again later). Called
        under the service's lock; never in ``simulate``. ``resource`` stops counting its profile in the fleet's
        median. Nothing by default."""

    # -- configure the round ------------------------------------------------------------------------
    def configure_round(self, t: int, devices: list[str]) -> dict[str, Instruction]:
        """Each device's ``Instruction`` for round t (coordinator/instructions.py): by default ``assign``'s
        split, the run's training settings at the round's rate (``lr_scale``) with no proximal term, and no
        method fields. A method that sends more (FedProx's mu, FedBABU's frozen head, a device side's
        ``method`` map, FedSGA's settings and per-device predictions) extends what this returns."""
        tc = self.cfg.train
        train = dataclasses.replace(tc, mu=0.0, lr=tc.lr * self.lr_scale(t))
        return {cid: Instruction(k, train) for cid, k in self.assign(t, devices).items()}

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        """Device -> split index k (1..K), 0 for the whole model on the device, None: the device chooses."""
        raise NotImplementedError

    def lr_scale(self, t: int) -> float:
        """Round t's factor on the learning rates, the devices' (``configure_round``) and the server side's
        alike: the run's --lr-schedule by default."""
        return self.cfg.lr_scale(t)

    def calibrates(self, t: int) -> bool:
        """Whether round t is a calibration round (devices may go deeper than assigned and probe)."""
        return False

    def accepts_split(self, assigned: int | None, k: int, calibrate: bool) -> bool:
        """May a device assigned ``assigned`` train at split k this round?"""
        return assigned is None or assigned == k

    def device_weights(self, cid: str, t: int, weights: dict[str, "Tensor"]) -> dict[str, "Tensor"]:
        """The global weights as device ``cid`` receives them in round t (its round start and its fetches):
        FedMut sends each device a mutated copy. ``weights`` is a subset of the round's snapshot; the
        default sends it unchanged (the same tensors, so nothing else moves)."""
        return weights

    # -- the server side ----------------------------------------------------------------------------
    def attach(self, coordinator: Any) -> None:
        """Build what the method keeps on the server, once the model is on its device."""

    def server_head(self) -> Any:
        """The trainable module after the pooled features (part of every server copy); none by default."""
        from torch import nn

        return nn.Module()

    def server_side(self, model: Any, head: Any, cfg: RunConfig, weight: Any) -> Any:
        """The method's own ``ServerSide`` (coordinator/server_side.py), or None for the one ``cfg`` asks for
        (``make_server_side``): MultiSFL's per-branch copies."""
        return None

    def server_steps(self) -> int:
        """Server optimizer steps per accepted activation (MU-SplitFed's tau); one for every other method
        (coordinator/server_side.py, ``ServerSide.steps``)."""
        return 1

    def forward(self, side: Any, z: "Tensor", k: int) -> tuple["Tensor", "Tensor | None"]:
        """Logits (and the method's representation, or None) for an activation entering at split k."""
        return side.model.head(side.model.suffix(z, side.model.depth_of(k))), None

    def loss(self, logits: "Tensor", Z: "Tensor | None", y: "Tensor") -> "Tensor":
        import torch.nn.functional as F

        return F.cross_entropy(logits, y)

    def check_activation(self, body: dict[str, Any], n: int) -> Any:
        """Validate the method's extra activation fields (raise RemoteProtocolError: the device's fault; any
        other exception is a bug and fails the run); returns what after_step needs."""
        return None

    def after_step(self, Z: "Tensor | None", y: "Tensor", extra: Any) -> None:
        """Called after an accepted server step (prototypes, auxiliary heads)."""

    def weight(self, num_samples: int) -> float:
        """A device's weight in aggregation (and its data's weight in the server copies' average)."""
        return float(num_samples)

    def check_update(self, body: dict[str, Any]) -> None:
        """Validate the method's fields of a device's update (``body["method"]``, from its device side,
        device/methods.py) before the update is accepted; raise RemoteProtocolError. The default accepts none."""
        if body.get("method") is not None:
            raise RemoteProtocolError(f"{self.name} takes no method fields in an update")

    def aggregation_weight(self, cid: str, update: dict[str, Any], weight: float) -> float:
        """Device ``cid``'s weight in this round's aggregation, given its accepted ``update`` and its
        ``weight(n)``: FedAS weighs by the Fisher information its device reported. The default keeps
        ``weight``; 0 leaves the device out of the average."""
        return weight

    def begin_round(self, t: int, calibrate: bool) -> None:
        """Reset the method's per-round state."""

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        """After aggregation: the method's round-end work and its fields of the round's record."""

    def eval_logits(self, model: Any, feats: "Tensor") -> dict[int, "Tensor"]:
        """Logits of the global model per depth embedding (0: one model for every split)."""
        return {0: model.head(feats)}

    def test_models(self) -> list[tuple[float, dict[str, "Tensor"]]]:
        """The models the test figure averages, each a (weight, whole state); empty: the global model.
        A method whose devices keep models of their own (FedGH's bodies) has no global model to test."""
        return []

    # -- state ----------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """What the strategy decided up front, for config.json."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The method's trained server state (checkpoint.pt's "coordinator" entries)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (resume)."""

    def optimizer_state(self) -> dict[str, Any]:
        """Optimizers the method owns, for resume."""
        return {}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore ``optimizer_state()``."""
