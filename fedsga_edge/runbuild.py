"""Build one side of a run from its config alone: the coordinator side, or device ``i``.

In a field run the coordinator and every device are separate processes on separate machines.
They must agree on who owns which training samples without sending data or index lists, so each
side runs the same seeded steps ``Simulation`` runs (validate, seed, subset, partition) and gets
the same client ids and partition sizes; the coordinator then checks every device's ``hello``
against the size it expects.

This is wiring: it imports both roles. ``Simulation`` is ``plan_run`` + ``build_coordinator`` +
``build_client`` for each device, so the global torch RNG is consumed in the same order everywhere
and a service's coordinator starts from the simulation's initial weights.

torch is imported only where a torch side is built: a device on the ONNX backend plans its data and
builds its agent from here without it (tests/test_onnx_device.py makes torch unimportable).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsga_edge.config import AUTO_WIRE, WIRE_CODECS, RunConfig
from fedsga_edge.data import ArrayImageSet, DatasetBundle, load_dataset, partition
from fedsga_edge.data.local import RunData, read_local_data
from fedsga_edge.latency import ProfileError, hello_profile, read_profile
from fedsga_edge.runfiles import summarize  # re-exported: summary.json is made in one place
from fedsga_edge.transport import Peer, Transport

if TYPE_CHECKING:
    import torch

    from fedsga_edge.models import CostTable, SplitModel

__all__ = ["COORDINATOR", "RunPlan", "plan_local", "run_data_of", "make_client",
           "CoordinatorSide", "client_id", "plan_run", "make_model", "build_coordinator",
           "build_client", "coordinator_service", "device_agent", "default_run_id", "resolve_device", "validate_config",
           "summarize", "WIRE_FORMATS", "peer_format"]

COORDINATOR = "coordinator"
# --wire-format -> the codec's tensor_format (docs/protocol.md, "Messages"); Peer applies it to the
# per-batch tensors only (transport/peer.py LOSSY_FIELDS), weights always travel fp32.
WIRE_FORMATS: dict[str, str] = WIRE_CODECS


def peer_format(cfg: RunConfig) -> str:
    """The Peer ``tensor_format`` for ``cfg.wire_format`` (validated by ``validate_config``); under ``auto`` fp32's
    until a round start names the device's format (the coordinator's Peer sends each device its own)."""
    return WIRE_CODECS.get(cfg.wire_format, WIRE_CODECS["fp32"])


def resolve_device(name: str) -> "torch.device":
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available on this machine")
    return dev


def validate_config(cfg: RunConfig) -> None:
    """Reject bad settings with a message that names the flag, before any work starts.

    The ranges and choices are the options' declarations (``RunConfig.problems``); here are the
    rules that need the registry or tie two options together."""
    from fedsga_edge.coordinator.strategy import get_strategy, list_strategies  # torch-free: a device validates too
    from fedsga_edge.options import class_options, resolve_args

    problems = []
    if cfg.strategy not in list_strategies():
        problems.append(f"--strategy must be one of {', '.join(list_strategies())} (got {cfg.strategy!r})")
    else:
        try:
            resolve_args(class_options(get_strategy(cfg.strategy)), cfg.strategy_args)
        except ValueError as exc:
            problems.append(str(exc))
    problems += cfg.problems()
    if cfg.wire_format == AUTO_WIRE and cfg.strategy != "planner":
        problems.append(f"--wire-format auto needs --strategy planner (it picks each device's format); got "
                        f"--strategy {cfg.strategy}: give one of {', '.join(WIRE_CODECS)}")
    if cfg.server_bn_context and cfg.server_copies == "per_client" and not isinstance(cfg.server_bn_context, bool):
        problems.append("--server-bn-context needs --server-copies shared (a per-client copy sees one device only)")
    if cfg.fronts == "private" and cfg.strategy in list_strategies():
        from fedsga_edge.coordinator.strategy import Strategy

        if get_strategy(cfg.strategy).device_weights is not Strategy.device_weights:
            problems.append(f"--fronts private: --strategy {cfg.strategy} sends each device a copy of its own making "
                            "(device_weights), which would replace the device's own front")
    if cfg.fronts == "private" and cfg.quarantine:
        problems.append("--quarantine needs --fronts shared: a private front's change would be measured against the "
                        "global blocks, which it left when the device first took part")
    if problems:
        raise ValueError("; ".join(problems))


def client_id(i: int) -> str:
    """The id device ``i`` has in every run (the same names simulate uses)."""
    return f"client-{i:03d}"


def default_run_id(cfg: RunConfig) -> str:
    return f"sim-{cfg.seed}"  # Simulation's run id


@dataclass
class RunPlan:
    """What every side derives from the config alone: the data, the resolved device, the partitions."""

    cfg: RunConfig
    bundle: DatasetBundle
    device: Any  # torch.device; the string "cpu" on a torch-free device
    parts: list[np.ndarray]  # training-set indices of each client, in client order (the ones it trains on)
    client_ids: list[str]
    # each client's held-out slice for federated evaluation (--eval-holdout), never trained on; None: none
    eval_parts: list[np.ndarray] | None = None
    # the devices bring their own data: this side holds none of it; sizes come with each hello
    local: bool = False

    @property
    def sizes(self) -> dict[str, int]:
        return {cid: len(p) for cid, p in zip(self.client_ids, self.parts)}

    @property
    def eval_sizes(self) -> dict[str, int]:
        return {cid: len(p) for cid, p in zip(self.client_ids, self.eval_parts or [])}


@dataclass
class CoordinatorSide:
    plan: RunPlan
    model: "SplitModel"
    costs: "CostTable"
    strategy: Any  # fedsga_edge.coordinator.Strategy
    coordinator: Any  # fedsga_edge.coordinator.Coordinator

    def run_info(self) -> dict[str, Any]:
        """``config.json`` as ``run_simulation`` writes it."""
        from fedsga_edge.coordinator import method_of

        cfg = self.plan.cfg
        # "method": the name, label and table group the benchmark and the report show (the strategy's)
        method = method_of(cfg, self.model.num_splits) | {"adaptive": self.strategy.adaptive}
        info = self.strategy.info()
        if clash := set(info) & set(cfg.to_dict()):  # a description must never overwrite a recorded setting
            raise ValueError(f"{cfg.strategy}.info() reuses the run settings' names {sorted(clash)}")
        return cfg.to_dict() | {"resolved_device": str(self.plan.device), "candidate_depths": list(self.model.splits),
                                "client_sizes": self.plan.sizes, "method": method} | info


def plan_run(cfg: RunConfig, bundle: DatasetBundle | None = None, *, seed_globals: bool = True,
             torch_free: bool = False) -> RunPlan:
    """Validate, seed, load the data and partition it exactly as ``Simulation`` does.

    ``seed_globals=False`` leaves Python's, numpy's and torch's global generators alone: a device
    needs none of them (its batches and prompts come from the client's own seeded generators), and
    a device built in the coordinator's process must not reset the stream the coordinator uses.
    Partitions and the training subset use their own seeded generators either way.
    ``torch_free=True`` (a device on the ONNX backend) imports no torch: no global seeding, no
    device resolution.
    """
    validate_config(cfg)
    if seed_globals and not torch_free:
        _seed_everything(cfg.seed)
    device = "cpu" if torch_free else resolve_device(cfg.device)
    bundle = bundle or load_dataset(cfg.dataset, cfg.data_root, image_size=cfg.img_size)
    train_idx = _subset(bundle.train.labels, cfg.train_subset, cfg.seed)
    domains = None if bundle.train.domains is None else bundle.train.domains[train_idx]
    parts = partition(bundle.train.labels[train_idx], cfg.clients, cfg.partition, alpha=cfg.alpha, seed=cfg.seed,
                      domains=domains)
    if cfg.train.augment is None:  # auto: crop + flip for natural images, not for digits
        cfg.train.augment = cfg.dataset != "digits"
    ids = [client_id(i) for i in range(cfg.clients)]
    shares, held = held_out_slices(cfg, [train_idx[p] for p in parts], ids)
    return RunPlan(cfg, bundle, device, shares, ids, held)


def held_out_slices(cfg: RunConfig, shares: list[np.ndarray],
                    ids: list[str]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Each share split into (what the device trains on, its held-out slice) by ``--eval-holdout``, as the
    device does with its own data (``device.evaluate.hold_out``); the shares themselves when it is 0."""
    if not cfg.eval_holdout > 0:
        return shares, None
    from fedsga_edge.device.evaluate import hold_out  # numpy only

    pairs = [hold_out(share, cfg.eval_holdout, cfg.seed, cid) for share, cid in zip(shares, ids)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def run_data_of(bundle: DatasetBundle) -> RunData:
    """What a coordinator announces about its run's data (``describe``): classes, input size, normalisation."""
    return RunData(list(bundle.classes), int(bundle.image_size), tuple(bundle.mean), tuple(bundle.std))  # type: ignore[arg-type]


def _data_only_bundle(run: RunData, train: Any = None, test: Any = None) -> DatasetBundle:
    """A DatasetBundle that holds what ``run`` says (and the given image sets, else empty ones): what the
    model factory and the ONNX artifact check read."""
    S = run.image_size
    empty = ArrayImageSet(np.empty((0, S, S, 3), np.uint8), np.empty(0, np.int64), image_size=S)
    return DatasetBundle("local", train if train is not None else empty, test if test is not None else empty,
                         len(run.classes), list(run.classes), S, run.mean, run.std)


def plan_local(cfg: RunConfig, run: RunData, test: Any = None, *, seed_globals: bool = True) -> RunPlan:
    """The coordinator's plan when the devices bring their own data: the model, the class
    list and the input size, no training data (``test``: an optional test set). Seeded as ``plan_run``, so
    the model starts from the same weights as a simulation of the same config."""
    validate_config(cfg)
    if cfg.img_size and cfg.img_size != run.image_size:
        raise ValueError(f"--img-size {cfg.img_size} but the run's data description says {run.image_size}")
    if seed_globals:
        _seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    if cfg.train.augment is None:  # the same rule as plan_run: crop + flip unless digits
        cfg.train.augment = cfg.dataset != "digits"
    ids = [client_id(i) for i in range(cfg.clients)]
    return RunPlan(cfg, _data_only_bundle(run, test=test), device, [np.empty(0, np.int64) for _ in ids], ids,
                   local=True)


def make_model(cfg: RunConfig, bundle: DatasetBundle) -> "SplitModel":
    """``Simulation._make_model``: the backbone both sides build."""
    from fedsga_edge.models import create_model

    kwargs: dict[str, Any] = {"num_classes": bundle.num_classes, "img_size": cfg.img_size or bundle.image_size,
                              "width": cfg.width, **cfg.model_args}
    return create_model(cfg.model, pretrained=cfg.pretrained, **kwargs)


def build_coordinator(plan: RunPlan) -> CoordinatorSide:
    """Model, costs, strategy and Coordinator for the clients' sizes, in Simulation's order."""
    from fedsga_edge.coordinator import Coordinator, get_strategy
    from fedsga_edge.models import CostTable

    cfg = plan.cfg
    model = make_model(cfg, plan.bundle)
    K = model.num_splits
    cls = get_strategy(cfg.strategy)
    cls.check_config(cfg, K)  # before the cost table: a bad --split fails in a second (create_strategy's order)
    costs = CostTable(model, cls.prompt_tokens(cfg))
    train_flops = {k: costs.train(k) for k in range(0, K + 1)}
    strategy = cls(cfg, K, plan.client_ids, train_flops)
    coordinator = Coordinator(model, cfg, plan.sizes, plan.bundle.num_classes, strategy, costs, device=plan.device,
                              name=COORDINATOR)
    coordinator.fed_eval.expected.update(plan.eval_sizes)
    return CoordinatorSide(plan, model, costs, strategy, coordinator)


def build_client(plan: RunPlan, i: int, peer: Any, *, server: str = COORDINATOR, backend: str = "torch",
                 artifacts: str | Path | None = None, threads: int | None = None) -> Any:
    """Device ``i``'s role: its own partition, the run's seed, and the torch or ONNX backend.

    The ONNX backend needs ``export --train`` artifacts of the run's model (checked here, so a
    mismatch is an error at start-up, not in round 1).
    """
    from fedsga_edge.device.role import ClientData

    if not 0 <= i < len(plan.parts):
        raise ValueError(f"device index {i} out of range 0..{len(plan.parts) - 1} (--clients {plan.cfg.clients})")
    b = plan.bundle
    data = ClientData(b.train, plan.parts[i], b.mean, b.std,
                      eval_indices=plan.eval_parts[i] if plan.eval_parts is not None else None)
    return make_client(plan.cfg, plan.client_ids[i], data, b, plan.device, peer, server=server, backend=backend,
                       artifacts=artifacts, threads=threads)


def make_client(cfg: RunConfig, cid: str, data: Any, b: DatasetBundle, device: Any, peer: Any, *,
                server: str = COORDINATOR, backend: str = "torch", artifacts: str | Path | None = None,
                threads: int | None = None) -> Any:
    """A device role on ``data`` (a ClientData) for the model ``cfg`` and ``b`` (classes, input size) describe."""
    if backend == "torch":
        from fedsga_edge.device.client import TorchClient

        return TorchClient(cid, data, lambda: make_model(cfg, b), peer, server=server, seed=cfg.seed,
                           device=device)
    if backend != "onnx":
        raise ValueError(f"--backend must be torch or onnx (got {backend!r})")
    if artifacts is None:
        raise ValueError("--backend onnx needs --artifacts DIR (made by `fedsga-edge export --train`)")
    from fedsga_edge.coordinator.strategy import get_strategy  # torch-free
    from fedsga_edge.device.onnx_backend import OnnxBackend, check_artifacts
    from fedsga_edge.device.role import SplitClient, device_rng

    rng, backend_seed = device_rng(cfg.seed, cid)
    be = OnnxBackend(artifacts, data, np.random.default_rng(backend_seed), threads=threads)
    check_artifacts(be.manifest, model=cfg.model, width=cfg.width, num_classes=b.num_classes,
                    img_size=cfg.img_size or b.image_size, prompts_m=get_strategy(cfg.strategy).prompt_tokens(cfg))
    return SplitClient(cid, data, be, peer, rng=rng, server=server)


def coordinator_service(
    cfg: RunConfig,
    transport: Transport,
    run_dir: str | Path,
    *,
    bundle: DatasetBundle | None = None,
    run_id: str | None = None,
    run_data: RunData | None = None,
    test_data: str | Path | None = None,
    **service_kwargs: Any,
) -> Any:
    """A ready CoordinatorService (serving on ``transport``) for ``cfg``; ``run()`` or ``start()`` it.

    ``run_data`` (classes, input size, normalisation): the devices bring their own data and this side loads
    no dataset; ``test_data`` is then an optional test set (an image folder or npz, ``--test-data``)."""
    from fedsga_edge.coordinator.service import CoordinatorService

    if run_data is None:
        side = build_coordinator(plan_run(cfg, bundle))
        b = side.plan.bundle
        test: Any = (b.test, b.mean, b.std)
        run_data, info = run_data_of(b), side.run_info()
    else:  # the devices bring their own data: this side holds none of it
        test_set = read_local_data(test_data, run_data)[0] if test_data is not None else None
        side = build_coordinator(plan_local(cfg, run_data, test_set))
        b = side.plan.bundle
        test = (b.test, b.mean, b.std) if test_set is not None else None
        info = side.run_info() | {"client_sizes": {}, "local_data": run_data.to_wire() | {
            "test_data": None if test_data is None else str(test_data),
            "test_samples": 0 if test_set is None else len(test_set)}}
    peer = Peer(transport, COORDINATOR, run_id or default_run_id(cfg), tensor_format=peer_format(cfg))
    return CoordinatorService(side.coordinator, peer, run_dir, test=test, run_info=info, description=run_data,
                              local_data=side.plan.local, **service_kwargs)


def device_agent(
    cfg: RunConfig,
    i: int,
    transport: Transport,
    state_dir: str | Path,
    *,
    bundle: DatasetBundle | None = None,
    run_id: str | None = None,
    plan: RunPlan | None = None,
    backend: str = "torch",
    artifacts: str | Path | None = None,
    threads: int | None = None,
    data: str | Path | None = None,
    latency_profile: str | Path | None = None,
    latency_report: Any = None,
    memory_mb: float | None = None,
    **agent_kwargs: Any,
) -> Any:
    """Device ``i``'s DeviceAgent on ``transport`` (not started); restores its state from ``state_dir``.

    ``data``: the device's own data (an image folder or npz, ``--data``), used whole; the run's classes and
    input size come from the coordinator (``describe``), asked before the agent exists, so bad data is an
    error here, before the device registers. ``latency_profile``: this device's
    `fedsga-edge profile --json`, summarised into its hello; a bad one (unreadable, another model, a split
    missing) is a ``ProfileError`` (a ValueError) here, before the device registers. ``latency_report``: that
    file's JSON where the caller has read it already (the CLI checks it before it connects), so it is read once.
    ``memory_mb``: the device's memory budget, checked against the profile's peak per split (fedsga_edge/latency.py
    ``hello_profile``)."""
    from fedsga_edge.device.agent import DeviceAgent

    report = latency_report
    if report is None and latency_profile is not None:
        report = read_profile(latency_profile)  # before any data is read
    if data is not None:
        agent = _local_device_agent(cfg, i, transport, state_dir, data, run_id=run_id, backend=backend,
                                    artifacts=artifacts, threads=threads, **agent_kwargs)
    else:
        plan = plan or plan_run(cfg, bundle, seed_globals=False, torch_free=backend != "torch")
        if not 0 <= i < len(plan.client_ids):
            raise ValueError(f"device index {i} out of range 0..{len(plan.client_ids) - 1} (--clients {cfg.clients})")
        peer = Peer(transport, plan.client_ids[i], run_id or default_run_id(cfg), tensor_format=peer_format(plan.cfg))
        client = build_client(plan, i, peer, backend=backend, artifacts=artifacts, threads=threads)
        agent = DeviceAgent(client, peer, state_dir, server=COORDINATOR, **agent_kwargs)
    if report is not None:
        try:
            agent.profile = hello_profile(report, cfg.model, agent.client.backend.num_splits, width=cfg.width,
                                          where=f"--latency-profile {latency_profile}", memory_mb=memory_mb)
        except ProfileError:
            agent.log.close()
            raise
    return agent


def _local_device_agent(cfg: RunConfig, i: int, transport: Transport, state_dir: str | Path, data: str | Path, *,
                        run_id: str | None, backend: str, artifacts: str | Path | None, threads: int | None,
                        **agent_kwargs: Any) -> Any:
    from fedsga_edge.data.local import scan_local_data
    from fedsga_edge.device.agent import DeviceAgent
    from fedsga_edge.device.localdata import describe_run, local_client_data

    validate_config(cfg)
    if not 0 <= i < cfg.clients:
        raise ValueError(f"device index {i} out of range 0..{cfg.clients - 1} (--clients {cfg.clients})")
    scan_local_data(data)  # the layout first: no need to reach the coordinator to find an empty folder
    cid = client_id(i)
    peer = Peer(transport, cid, run_id or default_run_id(cfg), tensor_format=peer_format(cfg))
    run = describe_run(peer, COORDINATOR, float(agent_kwargs.get("hello_timeout", 300.0)))
    if cfg.img_size and cfg.img_size != run.image_size:
        raise ValueError(f"--img-size {cfg.img_size} but the coordinator's run takes {run.image_size}x{run.image_size}")
    cdata, counts = local_client_data(data, run, cfg, cid)
    device = "cpu" if backend != "torch" else resolve_device(cfg.device)
    client = make_client(cfg, cid, cdata, _data_only_bundle(run, train=cdata.images), device, peer,
                         server=COORDINATOR, backend=backend, artifacts=artifacts, threads=threads)
    agent = DeviceAgent(client, peer, state_dir, server=COORDINATOR, **agent_kwargs)
    held = cdata.eval_indices
    agent.log.info("local_data", path=str(data), samples=len(cdata.images), train=len(cdata),
                   held_out=0 if held is None else len(held), classes=counts)  # stays on the device
    return agent


def _subset(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A stratified subset of ``n`` training samples (all when n is 0 or too large)."""
    if n <= 0 or n >= len(labels):
        return np.arange(len(labels))
    rng = np.random.default_rng([seed, 3])
    picked = []
    classes = np.unique(labels)
    for c in classes:
        idx = np.flatnonzero(labels == c)
        take = max(1, round(n * len(idx) / len(labels)))
        picked.append(rng.choice(idx, size=min(take, len(idx)), replace=False))
    return np.sort(np.concatenate(picked))


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
