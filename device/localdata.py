"""A device that brings its own data (``fedsga-edge device --data PATH``).

Before its ``hello`` the device reads its data and asks the coordinator what the run's data is
(``describe`` -> ``description``: the class names in class-id order, the input size, the normalisation),
so every problem with the data (an unknown class, an empty folder, a corrupt or too small image) is an
error at start, naming the file, before the device registers (``fedsga_edge.data.local``). The data is
used whole: no partition, only the held-out slice for federated evaluation (``--eval-holdout``,
``device.evaluate.hold_out``). What the device then reveals about it: docs/protocol.md, "What a device
reveals about its data". Numpy and Pillow only, so the torch-free device runs it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fedsga_edge.data.local import LocalDataError, RunData, read_local_data, scan_local_data
from fedsga_edge.transport import Peer, TransportError
from fedsga_edge.wire import RemoteProtocolError

from .evaluate import hold_out
from .role import ClientData

__all__ = ["LocalDataError", "describe_run", "local_client_data"]


def describe_run(peer: Peer, server: str, timeout: float, retry_s: float = 0.5) -> RunData:
    """Ask the coordinator for the run's data description, retrying while it is unreachable (a request sent
    before it subscribed is lost); an error reply or a malformed description is a LocalDataError."""
    deadline = time.monotonic() + timeout
    wait, last = retry_s, ""
    while True:
        left = deadline - time.monotonic()
        try:
            reply = peer.call(server, "describe", 0, {}, timeout=max(min(left, 10.0), 0.1))
        except (TransportError, RemoteProtocolError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if reply.kind == "description":
                return RunData.from_wire(reply.body)
            reason = reply.body.get("reason", reply.kind) if isinstance(reply.body, dict) else reply.kind
            raise LocalDataError(f"the coordinator did not describe the run's data: {str(reason)[:300]}")
        if time.monotonic() + wait > deadline:
            raise TimeoutError(f"no description of the run's data from the coordinator within {timeout:g} s: {last}")
        time.sleep(wait)
        wait = min(wait * 2, 5.0)


def local_client_data(path: str | Path, run: RunData, cfg: Any, cid: str) -> tuple[ClientData, dict[str, int]]:
    """The device's whole data as its ClientData (the held-out slice apart), and its per-class counts."""
    images, counts = read_local_data(path, run)
    import numpy as np

    train, held = hold_out(np.arange(len(images)), cfg.eval_holdout, cfg.seed, cid)
    if len(train) < 2:
        raise LocalDataError(f"--data {path}: {len(images)} sample(s); a device needs at least 2 to train on")
    data = ClientData(images, train, run.mean, run.std, eval_indices=held if len(held) else None)
    return data, counts


def check_local_data(path: str | Path) -> None:
    """What can be checked before the coordinator is asked anything (layout, empty or unreadable folders)."""
    scan_local_data(path)
