"""Bind and advertised addresses of the KV plane (kv/addresses.py, kv/config.py): vLLM's
VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT are honoured, the TCP transport follows the side channel,
and addresses that cannot work stop the worker at start-up with a message naming the fix."""

from __future__ import annotations

import pytest

from duplexkv.kv import addresses
from duplexkv.kv.addresses import Listen
from duplexkv.kv.config import KVConfigError, KVTransferConfig


def parse(extra: dict | None = None) -> KVTransferConfig:
    return KVTransferConfig.parse({"kv_connector": "TcpConnector",
                                   "kv_connector_extra_config": extra or {}})


def test_setting_only_the_vllm_host_moves_both_listeners(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.9.8.7")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    cfg = parse()
    assert (cfg.side_channel_host, cfg.side_channel_bind, cfg.side_channel_port) == \
        ("10.9.8.7", "10.9.8.7", 5600)
    assert (cfg.transfer_host, cfg.transfer_bind) == ("10.9.8.7", "10.9.8.7")
    # the config's own keys win; the transport can be configured apart
    cfg = parse({"side_channel_host": "10.1.1.1", "side_channel_bind_host": "0.0.0.0",
                 "transfer_host": "10.2.2.2", "transfer_port": 7000})
    assert (cfg.side_channel_host, cfg.side_channel_bind) == ("10.1.1.1", "0.0.0.0")
    assert (cfg.transfer_host, cfg.transfer_bind, cfg.transfer_port) == ("10.2.2.2", "10.2.2.2",
                                                                         7000)


def test_defaults_stay_on_loopback(monkeypatch):
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    cfg = parse()
    assert cfg.side_channel_bind == cfg.side_channel_host == "127.0.0.1"
    assert cfg.transfer_bind == cfg.transfer_host == "127.0.0.1"


def test_a_bad_port_variable_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "56x")
    with pytest.raises(KVConfigError, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):
        parse()


@pytest.mark.parametrize("listen, match", [
    (Listen("side channel", "0.0.0.0", "0.0.0.0"), "no peer can dial"),
    (Listen("side channel", "0.0.0.0", "127.0.0.1"), "would dial themselves"),
    (Listen("transport", "127.0.0.1", "192.0.2.10"), "no other host can reach"),
    (Listen("side channel", "192.0.2.10", "192.0.2.10"), "not an address of this host"),
    (Listen("side channel", "no-such-host.invalid", "no-such-host.invalid"), "does not resolve"),
])
def test_addresses_that_cannot_work_are_refused(listen, match):
    with pytest.raises(KVConfigError, match=match) as e:
        addresses.check(listen)
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in str(e.value) or "bind" in str(e.value)


def test_addresses_that_work_pass():
    addresses.check(Listen("side channel", "127.0.0.1", "127.0.0.1"))
    addresses.check(Listen("side channel", "0.0.0.0", "192.0.2.10"))  # e.g. behind NAT
    assert addresses.interface_of("127.0.0.1") == "lo"
    assert addresses.interface_of("192.0.2.10") is None


def test_a_worker_advertising_a_foreign_address_stops_at_start(tiny_model_dir, tmp_path):
    from workers import kv_config, start_worker

    with pytest.raises(RuntimeError, match="not an address of this host") as e:
        w = start_worker(tiny_model_dir, tmp_path / "w.log", "--num-kv-blocks", "64",
                         kv=kv_config("TcpConnector"),
                         env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "192.0.2.10"})
        w.stop()
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in str(e.value)
