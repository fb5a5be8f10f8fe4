"""``fedsga-edge broker-config``: Mosquitto config, password file, ACL, one credentials file per login and one
message key per device.

The work is in ``fedsga_edge.broker.config``; this command only reads flags and
prints what was written and how to start the broker (docs/deploy.md, "The broker").
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:
    from fedsga_edge.broker.config import BrokerFiles, BrokerSpec

__all__ = ["register"]


def broker_config(
    devices: str = typer.Option(..., help="N (logins client-000 .. client-{N-1}, the ids `device --index` uses) "
                                "or a file of device ids, one per line."),
    out: Path = typer.Option(..., help="Folder for mosquitto.conf, acl, passwd, credentials/<login>.env and "
                             "keys/<device>.key."),
    run: Optional[str] = typer.Option(None, help="Allow only this run id's topics (default: any run; "
                                      "the field commands use sim-<seed>)."),
    tls_cert: Optional[Path] = typer.Option(None, help="Broker certificate (PEM): the listener speaks TLS only."),
    tls_key: Optional[Path] = typer.Option(None, help="Its private key (PEM)."),
    ca: Optional[Path] = typer.Option(None, help="The CA that signed it: devices need it to trust the broker."),
    port: Optional[int] = typer.Option(None, help="Listener port (default 8883 with TLS, 1883 without)."),
    bind: Optional[str] = typer.Option(None, help="Listen on this address only (default: every interface)."),
    loopback_port: Optional[int] = typer.Option(None, help="Also a plaintext listener on 127.0.0.1:PORT, for a "
                                                "coordinator on the broker's host."),
    host: Optional[str] = typer.Option(None, help="Broker host name in the devices' URLs (default: this host's name; "
                                       "with TLS it must match the certificate)."),
    max_packet: int = typer.Option(256 * 1024, help="Broker's max_packet_size: at least every client's --max-packet."),
    force: bool = typer.Option(False, "--force", help="Overwrite an earlier config in --out (new passwords for all)."),
    site: list[str] = typer.Option([], help="The central broker of several sites: NAME=DEVICES (an index range I-J, a "
                                   "count or a file of ids, all among --devices), one per site: a login site-NAME for "
                                   "that site's bridge, allowed only its devices' topics (docs/deploy.md)."),
    bridge: Optional[str] = typer.Option(None, help="A site broker: bridge to the central broker with this site's "
                                         "login there, the central config's credentials/site-NAME.env (or its URL)."),
    bridge_ca: Optional[Path] = typer.Option(None, help="--bridge over TLS: the CA of the central broker's certificate."),
    bridge_qos: int = typer.Option(0, help="--bridge: QoS of the messages bridged to the site's devices. 1 costs each "
                                   "request ~48 ms on Mosquitto 2.0 (a bridge's own connection keeps Nagle on; "
                                   "docs/deploy.md); at 0 a message crossing as the bridge reconnects is lost and its "
                                   "device loses the round."),
    keys: Optional[Path] = typer.Option(None, help="The devices' message keys already written (a site broker: the "
                                        "central config's keys/); default: new keys in --out/keys."),
) -> None:
    """Write a Mosquitto config where every device may use only its own topics and its own login as client id
    (docs/protocol.md)."""
    from fedsga_edge.broker.config import (BridgeSpec, BrokerConfigError, BrokerSpec, TlsFiles, parse_devices,
                                           parse_site, read_bridge, write_broker_config)

    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("--tls-cert and --tls-key go together")
    if ca is not None and tls_cert is None:
        raise typer.BadParameter("--ca is for a TLS listener: give --tls-cert and --tls-key too")
    try:
        ids = parse_devices(devices)
        spec = BrokerSpec(devices=tuple(ids), run=run, port=port, bind=bind, loopback_port=loopback_port,
                          tls=TlsFiles(tls_cert, tls_key, ca) if tls_cert is not None else None,
                          max_packet=max_packet, sites=tuple(parse_site(s) for s in site),
                          bridge=None if bridge is None else BridgeSpec(read_bridge(bridge), bridge_ca, bridge_qos),
                          **({"host": host} if host else {}))
        files = write_broker_config(spec, out, force=force, keys=keys)
    except BrokerConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    except OSError as exc:
        typer.secho(f"error: cannot write {out}: {exc}", fg="red", err=True)
        raise typer.Exit(1) from None

    _say_written(spec, files, ids, host)


def _say_written(spec: "BrokerSpec", files: "BrokerFiles", ids: list[str], host: Optional[str]) -> None:
    """What was written, how to start the broker, and where each file goes."""
    run, bind, loopback_port = spec.run, spec.bind, spec.loopback_port
    scheme = "mqtts" if spec.tls else "mqtt"
    typer.echo(f"Wrote a broker config for {len(ids)} device(s) ({ids[0]} .. {ids[-1]}) and the coordinator, "
               f"{'run ' + run if run else 'any run'}:")
    listener = f"{scheme} on {bind or '*'}:{spec.listen_port}" + (
        f", plaintext on 127.0.0.1:{loopback_port}" if loopback_port else "")
    rows = [(str(files.conf), f"the listener: {listener}; client id = login"), (str(files.acl), "each login's topics"),
            (str(files.passwd), f"password hashes ({files.hasher})"),
            (f"{files.conf.parent / 'credentials'}/<login>.env", "secret, mode 0600: FEDSGA_EDGE_BROKER=<url>"),
            (f"{files.conf.parent / 'keys'}/<device>.key", "secret, mode 0600: the device's message key "
             "(device --key; the folder: coordinator --keys)")]
    width = max(len(path) for path, _ in rows)
    for path, what in rows:
        typer.echo(f"  {path.ljust(width)}  {what}")
    if spec.tls is None and bind not in ("127.0.0.1", "localhost", "::1"):
        typer.secho("warning: no TLS: passwords and payloads cross the network in clear (give --tls-cert/--tls-key)",
                    fg="yellow", err=True)
    if spec.tls is not None and spec.tls.ca is None:
        typer.echo("note: without --ca, devices must already trust the broker certificate's issuer")
    typer.echo("\nStart the broker:")
    typer.echo(f"  mosquitto -c {files.conf} -v                      # in the foreground, to try it")
    typer.echo(f"  sudo ln -s {files.conf} /etc/mosquitto/conf.d/fedsga.conf && sudo systemctl restart mosquitto"
               "   # Debian's service")
    typer.echo("Then copy credentials/<id>.env to each device as /etc/fedsga-edge/credentials.env (mode 0600), "
               "keys/<id>.key as /etc/fedsga-edge/device.key (mode 0600, owned by the agent's user), "
               f"{'and the CA as /etc/fedsga-edge/ca.crt, ' if spec.tls and spec.tls.ca else ''}"
               f"and give the coordinator credentials/{spec.coordinator}.env (docs/deploy.md).")
    for login in spec.site_logins:
        typer.echo(f"Site broker {login[5:]}: broker-config --devices <its devices> --bridge "
                   f"{files.credentials[login]} --keys {files.conf.parent / 'keys'} --out <its folder>")
    if spec.bridge is not None:
        typer.echo(f"The bridge to {spec.bridge.parts()[0]}:{spec.bridge.parts()[1]} carries {len(ids)} device(s)' "
                   "topics; the config holds the site's password: mode 0640.")
    typer.echo(f"Devices will connect to {scheme}://<login>:<password>@{spec.host}:{spec.listen_port}"
               + ("" if host else " (change the host name with --host)") + ".")


def register(app: typer.Typer) -> None:
    app.command("broker-config")(broker_config)
