"""What a fresh MQTT subscriber sees: the retained status and last-will checks of the broker tests."""

from __future__ import annotations

import os
import threading
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion


def retained(port: int, topic: str, timeout: float = 3.0) -> bytes | None:
    """The retained payload of ``topic`` as a fresh subscriber sees it (None if there is none)."""
    got: list[bytes] = []
    done = threading.Event()
    c = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"probe-{os.urandom(3).hex()}")
    c.on_connect = lambda cl, u, f, rc, p: cl.subscribe(topic, qos=1)
    c.on_subscribe = lambda cl, u, mid, rc, p: threading.Timer(0.3, done.set).start()  # retained comes first

    def on_message(cl: paho.Client, u: object, m: paho.MQTTMessage) -> None:
        if m.retain:
            got.append(m.payload)
            done.set()

    c.on_message = on_message
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        done.wait(timeout)
    finally:
        c.disconnect()
        c.loop_stop()
    return got[-1] if got else None


def wait_retained(port: int, topic: str, want: bytes, timeout: float = 5.0) -> bytes | None:
    """Poll the retained status until it reads ``want`` (the broker publishes a will asynchronously)."""
    deadline = time.monotonic() + timeout
    while (got := retained(port, topic, timeout=1)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got
