"""A device's own broker login against the other devices and the coordinator, via
``benchmarks/hostile.py``'s ``login_attacks``: client-000's password read from the broker's files (and its
own key) must neither read client-001's tensors nor get a forged ``bye``, ``round_start`` or activation
acted on; on the embedded broker (no ACL) that takes the sealed, encrypted messages, on Mosquitto the ACL
alone already holds. The unsealed run on the embedded broker is the control: there the same attacks work.
"""

from __future__ import annotations

import pytest
from _bench import load_bench

from fedsga_edge.broker.launch import embedded_available

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hostile():
    return load_bench("hostile")


def _need(hostile, kind: str) -> None:
    if kind == "embedded" and not embedded_available():
        pytest.skip('no iotcore (pip install "fedsga-edge[train]")')
    if kind == "mosquitto" and hostile.MOSQUITTO is None:
        pytest.skip("no mosquitto binary (apt-get install mosquitto)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,encrypt", [("embedded", True), ("mosquitto", False), ("mosquitto", True)])
def test_a_devices_own_login_reads_and_forges_nothing(hostile, tmp_path, kind, encrypt) -> None:
    _need(hostile, kind)
    res = hostile.login_attacks(tmp_path, kind, sealed=True, encrypt=encrypt)
    assert res["honest_ok"], res
    assert res["tensors_read"] == 0 and res["forged_orders_acted"] == 0 and res["forged_requests_acted"] == 0, res
    assert res["forged_orders_sent"] >= 4 and res["coordinator_answers"], res
    if kind == "mosquitto":  # the ACL: nothing heard on '#', the client id bound to the login
        assert res["messages_heard"] == 0 and not res["coordinator_dropped"], res


@pytest.mark.timeout(120)
def test_on_the_embedded_broker_the_mac_refuses_forgeries_but_only_encryption_hides(hostile, tmp_path) -> None:
    _need(hostile, "embedded")
    res = hostile.login_attacks(tmp_path, "embedded", sealed=True, encrypt=False)
    assert res["forged_orders_acted"] == 0 and res["forged_requests_acted"] == 0 and res["coordinator_answers"], res
    assert res["forged_orders_sent"] >= 5, res  # the four forgeries and what it heard on the down topic, replayed
    assert res["tensors_read"] > 0, res  # rumqttd has no ACL: the MAC authenticates, it does not hide


@pytest.mark.timeout(120)
def test_control_without_keys_the_same_attacks_work_on_the_embedded_broker(hostile, tmp_path) -> None:
    _need(hostile, "embedded")
    res = hostile.login_attacks(tmp_path, "embedded", sealed=False)
    assert res["tensors_read"] > 0 and res["forged_orders_acted"] > 0 and res["forged_requests_acted"] > 0, res
