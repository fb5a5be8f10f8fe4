"""Building the paho client: the optional import, the login and TLS, and the reconnect policy.

paho-mqtt is optional (``pip install "fedsga-edge[device]"``), so it is imported here when a
transport is built, never when the package is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from ..base import TransportError

__all__ = ["Login", "Paho", "ReturnCodes", "import_paho", "new_client"]


class ReturnCodes(NamedTuple):
    """paho's publish/subscribe results we tell apart: done, and queued while the connection is down."""

    ok: int
    no_conn: int


@dataclass(frozen=True, slots=True)
class Paho:
    """The imported library: its client module and the callback API version we are written against."""

    mqtt: Any
    callback_api: Any

    @property
    def codes(self) -> ReturnCodes:
        return ReturnCodes(self.mqtt.MQTT_ERR_SUCCESS, self.mqtt.MQTT_ERR_NO_CONN)


def import_paho() -> Paho:
    """paho-mqtt 2, or a TransportError saying how to install it."""
    try:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion
    except ImportError as e:  # pragma: no cover - paho is installed wherever the tests run
        raise TransportError('MQTT needs paho-mqtt >= 2: pip install "fedsga-edge[device]"') from e
    return Paho(mqtt, CallbackAPIVersion.VERSION2)


@dataclass(frozen=True, slots=True)
class Login:
    """Who we are to the broker (a login; None for an anonymous one) and how the link is secured."""

    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    def apply(self, client: Any) -> None:
        """Credentials and TLS on a client not yet connected; a CA or client certificate implies TLS."""
        if self.username is not None:
            client.username_pw_set(self.username, self.password)
        if self.tls or self.ca or self.certfile:
            client.tls_set(ca_certs=self.ca, certfile=self.certfile, keyfile=self.keyfile)


def new_client(paho: Paho, client_id: str, login: Login, *, clean_session: bool,
               reconnect_min: float, reconnect_max: float) -> Any:
    """An MQTT 3.1.1 client that reconnects by itself (between ``reconnect_min`` and ``reconnect_max`` s).

    ``clean_session=False`` keeps the broker session (and the QoS 1 messages queued for us) across a
    network blip; the client id must then be unique per process.
    """
    client = paho.mqtt.Client(
        callback_api_version=paho.callback_api,
        client_id=client_id,
        clean_session=clean_session,
        protocol=paho.mqtt.MQTTv311,
        reconnect_on_failure=True,
    )
    login.apply(client)
    client.reconnect_delay_set(reconnect_min, reconnect_max)  # floats work
    return client
