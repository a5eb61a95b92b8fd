"""Which interface a job's processes talk over (deadpool/rank/netif.py): chosen in a fixed order,
never assumed; a multi-node store on loopback refused. The multi-host half (each host's children
on its own interface) is tests/integration/test_multihost.py."""

from __future__ import annotations

import socket

import pytest

from deadpool.rank import netif


def cfg(ifname=None, host="127.0.0.1", name="slurm"):
    return {"launcher": {"name": name, "host": host, "port": 29500, "ifname": ifname},
            "_store": {"host": host, "port": 29500}}


def test_the_store_on_loopback_is_reached_through_lo():
    assert netif.route_interface("127.0.0.1") == ("lo", "127.0.0.1")
    assert netif.interface_of("127.0.0.1") == "lo"
    assert "127.0.0.1" in netif.interface_addresses("lo")


def test_a_non_loopback_store_is_reached_through_the_interface_holding_the_source_address():
    routed = [(n, a) for _, n in socket.if_nameindex() if n != "lo"
              for a in netif.interface_addresses(n) if ":" not in a]
    if not routed:
        pytest.skip("this host has no IPv4 interface but loopback")
    name, addr = routed[0]
    assert netif.route_interface(addr) == (name, addr)  # a local address routes through its own


def test_the_order_is_config_then_environment_then_route():
    assert netif.choose(cfg(ifname="lo"), {"GLOO_SOCKET_IFNAME": "eth9"}) == "lo"
    assert netif.choose(cfg(), {"GLOO_SOCKET_IFNAME": "eth9"}) == "eth9"
    assert netif.choose(cfg(), {}) == "lo"


def test_nccl_follows_unless_the_environment_names_its_own():
    assert netif.socket_env(cfg(), {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert netif.socket_env(cfg(), {"NCCL_SOCKET_IFNAME": "ib0"})["NCCL_SOCKET_IFNAME"] == "ib0"


def test_a_named_interface_that_this_host_lacks_is_refused_with_what_it_has():
    with pytest.raises(ValueError, match=r"launcher.ifname='nosuch0'.*it has .*lo"):
        netif.choose(cfg(ifname="nosuch0"), {})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost"])
def test_a_multi_node_slurm_job_is_not_served_from_loopback(host):
    with pytest.raises(ValueError, match="loopback address, but the job spans 3 nodes"):
        netif.check_store_host(cfg(host=host), {"SLURM_JOB_NUM_NODES": "3"})
    netif.check_store_host(cfg(host=host), {"SLURM_JOB_NUM_NODES": "1"})  # one machine: fine
    netif.check_store_host(cfg(host=host, name="local"), {"SLURM_JOB_NUM_NODES": "3"})


def test_the_refusal_comes_before_the_store_binds(tmp_path, monkeypatch):
    from deadpool.launch.job import run_job
    from deadpool.store import auth
    from tests.conftest import compose_train

    c = compose_train(["model=tiny", "num_steps=2", "launcher=slurm"], tmp_path)
    c["launcher"]["host"] = "127.0.1.1"
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setattr(auth, "serve_store", lambda *a, **k: pytest.fail("the store was bound"))
    with pytest.raises(ValueError, match="DEADPOOL_STORE_HOST"):
        run_job(c, log=lambda *a, **k: None)

