"""Small run configurations shared by the simulation and round tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedsga_edge.config import FedSGAConfig, RunConfig, TrainConfig


def tiny_config(strategy: str = "static", *, batch_size: int = 32, max_batches: int = 3, **kw: Any) -> RunConfig:
    """digits, resnet18_cifar at width 0.25, 3 clients, 2 rounds, a few batches: seconds per round."""
    base = dict(dataset="digits", clients=3, rounds=2, model="resnet18_cifar", width=0.25, seed=0, device="cpu",
                fedsga=FedSGAConfig(), train=TrainConfig(local_epochs=1, batch_size=batch_size, max_batches=max_batches))
    return RunConfig(strategy=strategy, **(base | kw))


def assert_test_accuracy(rec: dict[str, Any], n_test: int) -> None:
    """What a round's evaluation must be: a count of right answers over the test set (not a mean of
    batch accuracies), the headline equal to its split's entry, a share of predictions per class."""
    acc = rec["test_acc"]
    assert abs(acc * n_test - round(acc * n_test)) < 1e-6, (acc, n_test)
    split = rec.get("eval_split")
    assert rec["test_acc_by_split"][str(split) if split else "1"] == acc
    assert abs(sum(rec["test_pred_share"]) - 1.0) < 1e-3


def write_fleet(path: Path, classes: dict[str, dict[str, Any]]) -> str:
    """A fleet file with these classes (each a map of its keys); its path, as --fleet takes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, keys in classes.items():
        lines.append(f"[classes.{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@contextmanager
def loopback_field_run(cfg: RunConfig, bundle: Any, tmp_path: Path) -> Iterator[Any]:
    """The coordinator service and one device agent per client over the loopback transport, in real time: the
    started service (``wait`` runs the rounds); the agents are stopped on the way out."""
    from fedsga_edge.runbuild import coordinator_service, device_agent
    from fedsga_edge.transport import LoopbackTransport

    transport = LoopbackTransport()
    service = coordinator_service(cfg, transport, tmp_path / "run", bundle=bundle, register_timeout=60)
    service.start()
    agents = []
    try:
        for i in range(cfg.clients):
            agent = device_agent(cfg, i, transport, tmp_path / f"state-{i}", bundle=bundle)
            agent.start(timeout=30)
            agents.append(agent)
        yield service
    finally:
        for a in agents:
            a.stop()
