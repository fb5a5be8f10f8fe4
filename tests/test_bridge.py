"""Devices at several sites: a site Mosquitto bridged to the central one (broker-config --site / --bridge)."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest

from fedsga_edge.broker.config import (BridgeSpec, BrokerConfigError, BrokerSpec, device_ids, parse_devices,
                                       parse_site, read_bridge, write_broker_config)
from tests._bench import load_bench


def _configs(tmp_path: Path, **bridge) -> tuple:
    ids = tuple(device_ids(4))
    central = write_broker_config(BrokerSpec(devices=ids, run="r", port=1883, host="central",
                                             sites=(parse_site("a=0-1"), parse_site("b=2-3"))), tmp_path / "central")
    spec = BrokerSpec(devices=tuple(parse_devices("0-1")), run="r", port=1884, host="site-a",
                      bridge=BridgeSpec(read_bridge(str(central.credentials["site-a"])), **bridge))
    return central, write_broker_config(spec, tmp_path / "site-a", keys=tmp_path / "central" / "keys")


def test_a_site_bridges_only_its_own_devices_topics(tmp_path):
    central, site = _configs(tmp_path)
    acl = central.acl.read_text().split("user site-a")[1].split("user site-b")[0]
    assert "up/client-000" in acl and "down/client-001" in acl and "client-002" not in acl
    conf = site.conf.read_text()
    assert "address central:1883" in conf and "remote_username site-a" in conf
    assert "topic fedsga/r/up/client-000 out 1" in conf and "topic fedsga/r/down/client-001 in 0" in conf
    assert "client-002" not in conf and "topic fedsga/r/bcast in 0" in conf
    assert stat.S_IMODE(site.conf.stat().st_mode) == 0o640  # it holds the site's password at the central broker
    assert site.keys["client-000"] == central.keys["client-000"]  # one key per device, the coordinator's
    assert "@site-a:1884" in site.urls["client-000"]
    _, kept = _configs(tmp_path / "q1", qos_in=1)
    assert "topic fedsga/r/down/client-001 in 1" in kept.conf.read_text()


@pytest.mark.parametrize("make, why", [
    (lambda: parse_site("a"), "NAME=DEVICES"),
    (lambda: BrokerSpec(devices=("client-000",), sites=(("a", ("client-000",)), ("b", ("client-000",)))),
     "already behind site a"),
    (lambda: BrokerSpec(devices=("client-000",), sites=(("a", ("client-009",)),)), "not one of --devices"),
    (lambda: BridgeSpec("mqtt://central:1883"), "login and password"),
    (lambda: BridgeSpec("mqtt://u:p@central:1883", qos_in=2), "--bridge-qos"),
    (lambda: parse_devices("3-1"), "first index is after the last"),
])
def test_bad_site_input_is_refused_by_name(make, why):
    with pytest.raises(BrokerConfigError, match=why):
        make()


def test_a_site_needs_the_central_keys(tmp_path):
    spec = BrokerSpec(devices=("client-000",), bridge=BridgeSpec("mqtt://u:p@central:1883"))
    with pytest.raises(BrokerConfigError, match="no key for client-000"):
        write_broker_config(spec, tmp_path / "site", keys=tmp_path / "nowhere")
    assert not (tmp_path / "site").exists()


def test_a_small_request_crosses_the_bridge_without_a_delayed_ack(tmp_path):
    bench = load_bench("bridge", needs_mosquitto=True)
    brokers = bench.Brokers(tmp_path, 1)
    try:
        assert bench.round_trip_ms(brokers, bridged=True, n=10) < 20  # ~48 ms with the bridge's PUBACKs (QoS 1)
    finally:
        brokers.close()


@pytest.mark.full("a coordinator and 2 device processes for 2 rounds: 135 s at load average 20")
def test_a_field_run_across_two_brokers_completes_its_rounds(tmp_path):
    bench = load_bench("bridge", needs_mosquitto=True)
    args = argparse.Namespace(devices=2, rounds=2, max_batches=2, timeout=300)
    brokers = bench.Brokers(tmp_path / "brokers", args.devices)
    try:
        records = bench.field_run(brokers, tmp_path / "bridged", args, bridged=True)
    finally:
        brokers.close()
    assert [r["round"] for r in records] == [1, 2]
    assert all(sorted(r["splits"]) == ["client-000", "client-001"] and not r["failures"] for r in records)
