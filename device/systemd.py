"""Tell systemd how the device agent is doing: ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``STOPPING=1``.

The unit in ``device/deploy/fedsga-edge-device.service`` is ``Type=notify`` with ``WatchdogSec=``:
systemd considers the agent started only when it says ``READY=1`` (after it registered with the
coordinator) and restarts it when the watchdog pings stop (the agent's worker thread died or its
main loop hangs). The protocol is one datagram per message on the unix socket systemd names in
``$NOTIFY_SOCKET``; a leading ``@`` means Linux's abstract namespace. That is all ``sd_notify(3)``
does, so this needs no dependency. Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op
that returns False, so the same code runs under ``fedsga-edge trial``, in tests and by hand.

Where the ``device`` command calls it (docs/deploy.md, "Watchdog")::

    sd = Systemd()
    agent.start()                         # returns once the coordinator acked the hello
    sd.ready(f"registered as {agent.cid}")
    while running:
        sd.watchdog(agent.health()["alive"])   # rate-limited to half of WatchdogSec
        time.sleep(0.2)
    sd.stopping()
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

__all__ = ["Systemd", "notify"]


def _address(value: str) -> str | None:
    """The socket address of ``$NOTIFY_SOCKET``; None for kinds we do not speak (e.g. ``vsock:``)."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None


def notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Send one sd_notify message (``"KEY=VALUE\\n..."``); True if it was sent.

    Never raises: a service must not die because systemd's socket went away.
    """
    env = os.environ if env is None else env
    address = _address(env.get("NOTIFY_SOCKET", ""))
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(message.encode("utf-8"))
    except OSError:
        return False
    return True


class Systemd:
    """The agent's side of a ``Type=notify`` unit; every method is a no-op (False) outside one."""

    def __init__(self, env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._env = dict(os.environ if env is None else env)
        self._clock = clock
        self._last_ping: float | None = None
        self.watchdog_s = self._watchdog_seconds()

    def _watchdog_seconds(self) -> float | None:
        """WatchdogSec in seconds, when systemd set it for this very process (``$WATCHDOG_PID``)."""
        usec, pid = self._env.get("WATCHDOG_USEC", ""), self._env.get("WATCHDOG_PID", "")
        if not usec.isdigit() or int(usec) == 0:
            return None
        if pid and (not pid.isdigit() or int(pid) != os.getpid()):
            return None  # meant for another process (e.g. our parent): pinging would mislead systemd
        return int(usec) / 1e6

    @property
    def enabled(self) -> bool:
        """Whether systemd listens (``$NOTIFY_SOCKET`` is set)."""
        return _address(self._env.get("NOTIFY_SOCKET", "")) is not None

    def send(self, **fields: str | int) -> bool:
        """Any sd_notify fields, e.g. ``send(STATUS="round 3")``."""
        return notify("\n".join(f"{k}={v}" for k, v in fields.items()), self._env)

    def ready(self, status: str | None = None) -> bool:
        """Start-up is complete: systemd ends ``TimeoutStartSec`` and arms the watchdog."""
        fields: dict[str, str | int] = {"READY": 1}
        if status:
            fields["STATUS"] = status
        return self.send(**fields)

    def status(self, text: str) -> bool:
        """A one-line status that ``systemctl status`` shows."""
        return self.send(STATUS=text.replace("\n", " ")[:200])

    def stopping(self) -> bool:
        """We are shutting down on purpose: systemd stops expecting watchdog pings."""
        return self.send(STOPPING=1)

    def watchdog(self, healthy: bool = True) -> bool:
        """Ping the watchdog if ``healthy`` and half of ``WatchdogSec`` has passed since the last ping.

        An unhealthy agent simply stops pinging: systemd then kills and restarts it after
        ``WatchdogSec`` (``Restart=on-failure`` counts a watchdog timeout as a failure).
        """
        if not healthy or self.watchdog_s is None:
            return False
        now = self._clock()
        if self._last_ping is not None and now - self._last_ping < self.watchdog_s / 2:
            return False
        if self.send(WATCHDOG=1):
            self._last_ping = now
            return True
        return False
