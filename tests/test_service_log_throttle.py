"""The coordinator service's own lines about refused requests go through the log throttle: a device that
floods refused hellos leaves 10 `hello_refused` lines and one `log_suppressed` count in coordinator.log,
while every hello is still answered (docs/protocol.md, "What is rejected and how it is counted")."""

from __future__ import annotations

import json

from fedsga_edge.config import RunConfig, TrainConfig
from fedsga_edge.logthrottle import Throttle
from fedsga_edge.runbuild import coordinator_service
from fedsga_edge.transport import LoopbackTransport, Peer


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_flood_of_refused_hellos_is_ten_lines_and_a_count(digits, tmp_path) -> None:
    cfg = RunConfig(dataset="digits", clients=2, rounds=1, model="resnet18_cifar", width=0.25, seed=0, device="cpu",
                    round_timeout=60.0, train=TrainConfig(local_epochs=1, batch_size=32, max_batches=1))
    transport = LoopbackTransport()
    service = coordinator_service(cfg, transport, tmp_path / "run", bundle=digits, min_devices=1)
    clock = Clock()
    service.events.throttle = Throttle(clock=clock)
    # a device of the run whose hello is wrong (its share is not 1 sample): refused by the service, not on the
    # envelope (an unknown sender would be, by the Peer, with its own throttle)
    intruder = Peer(transport, "client-000", "sim-0")
    body = {"backend": "torch", "num_samples": 1, "capabilities": {}}
    replies = [intruder.call("coordinator", "hello", 0, body) for _ in range(50)]
    clock.t += 61
    replies.append(intruder.call("coordinator", "hello", 0, body))
    service.close()
    assert [m.kind for m in replies] == ["error"] * 51
    events = [json.loads(line) for line in (tmp_path / "run" / "coordinator.log").read_text().splitlines()]
    assert sum(e["event"] == "hello_refused" for e in events) == 11  # 10, then the next minute's first
    [summary] = [e for e in events if e["event"] == "log_suppressed"]
    assert (summary["of"], summary["device"], summary["count"]) == ("hello_refused", "client-000", 40)
