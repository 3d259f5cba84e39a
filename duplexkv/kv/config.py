"""`--kv-transfer-config`: vLLM's JSON keys, parsed into a frozen dataclass."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

CONNECTORS = {"NixlConnector": "nixl", "TcpConnector": "tcp"}
POLICIES = ("fail", "recompute")
OPTIONAL_INTS = ("kv_recompute_threshold",)  # None by default, an int when set


class KVConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    kv_connector: str = "TcpConnector"
    kv_role: str = "kv_both"  # accepted for vLLM compatibility; the role is per request
    # vLLM defaults to "fail"; we default to recompute so that no request is lost
    kv_load_failure_policy: str = "recompute"
    bidirectional_kv_xfer: bool = False
    # None (default): P pulls when the predicted transfer beats the predicted recompute
    # (kv/pull_decision.py); set, the fixed rule: pull when the gain reaches this many tokens
    kv_recompute_threshold: int | None = None
    # the reader's link model before it has measured a peer, and a stand-in bandwidth for
    # every peer (> 0: replaces the measured one, e.g. to emulate a slow link on loopback)
    kv_link_prior_gbps: float = 10.0
    kv_link_prior_rtt_ms: float = 1.0
    kv_link_assumed_gbps: float = 0.0
    # READ bandwidth samples older than this are forgotten (the prior again: the next pull probes)
    kv_link_sample_max_age_s: float = 60.0
    decoder_kv_blocks_ttl: float = 480.0  # the cap: D never holds a finished turn longer
    # D holds a finished turn this long unless the router renews it (its conversation is active)
    decoder_kv_lease_duration: float = 60.0
    # under memory pressure, release retained turns by "value" (kv/eviction.py) or "oldest" first
    decoder_kv_eviction: str = "value"
    kv_lease_duration: float = 30.0
    # addresses (kv/addresses.py): *_host is what peers dial (advertised), *_bind_host where we
    # listen ("" = the advertised address; "0.0.0.0" = every interface). `parse` fills the side
    # channel's from $VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT, and the TCP transport's follow the
    # side channel's unless set.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0 = any free port
    side_channel_bind_host: str = ""
    transfer_host: str = "127.0.0.1"  # TCP transport listener
    transfer_bind_host: str = ""
    transfer_port: int = 0
    enforce_handshake_compat: bool = True
    read_timeout_s: float = 10.0  # a READ that has not landed by then has failed
    # TcpConnector: a READ that moved no byte for this long has stalled (a link cut, a hung
    # holder) and fails at once: the reader recomputes. NIXL posts one READ and sees no
    # progress until it ends: there only read_timeout_s applies
    read_stall_s: float = 1.0
    # side-channel round trips (handshake, verify, heartbeat), connecting included: a dead or
    # partitioned peer costs a request at most this long
    connect_timeout_s: float = 1.0
    peer_breaker_s: float = 2.0  # a peer that failed is skipped this long (doubling, to 60 s)
    peer_max_in_flight: int = 4  # side-channel jobs per peer at once; the rest queue
    expiry_margin_s: float = 5.0  # decline remote blocks that expire sooner than this
    # D leg: emit P's greedy first token instead of recomputing the last prompt token
    use_prefill_first_token: bool = True
    # a file holding the cluster secret (or set $DUPLEXKV_KV_SECRET); never the secret itself
    auth_secret_file: str = ""
    # without a cluster secret, pull from loopback holders named in unsigned params (any local
    # process can then feed this worker KV: docs/security.md); off = no pull without a secret
    insecure_kv: bool = False

    @property
    def transport(self) -> str:
        return CONNECTORS[self.kv_connector]

    @property
    def side_channel_bind(self) -> str:
        return self.side_channel_bind_host or self.side_channel_host

    @property
    def transfer_bind(self) -> str:
        return self.transfer_bind_host or self.transfer_host

    @property
    def heartbeat_interval_s(self) -> float:
        return max(self.kv_lease_duration / 6, 0.05)

    @classmethod
    def parse(cls, raw: str | dict | None) -> "KVTransferConfig | None":
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise KVConfigError(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise KVConfigError("--kv-transfer-config must be a JSON object")
        extra = raw.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise KVConfigError("kv_connector_extra_config must be a JSON object")
        conn = raw.get("kv_connector", "TcpConnector")
        if conn not in CONNECTORS:
            raise KVConfigError(f"kv_connector {conn!r} is not supported; use one of "
                                f"{', '.join(CONNECTORS)}")
        policy = raw.get("kv_load_failure_policy", "recompute")
        if policy not in POLICIES:
            raise KVConfigError(f"kv_load_failure_policy must be one of {POLICIES}")
        fields = cls.__dataclass_fields__
        kw: dict = {"kv_connector": conn, "kv_load_failure_policy": policy,
                    "kv_role": raw.get("kv_role", "kv_both")}
        legacy = {"remote_pull_threshold": "kv_recompute_threshold"}
        for k, v in extra.items():
            if k in ("auth_secret", "secret", "kv_secret"):
                raise KVConfigError(f"kv_connector_extra_config.{k}: the KV secret is never "
                                    "taken from the command line; set DUPLEXKV_KV_SECRET or "
                                    "name a file in auth_secret_file")
            k = legacy.get(k, k)
            if k in fields and k not in kw:
                want = int if k in OPTIONAL_INTS else type(getattr(cls(), k))
                if want is float and isinstance(v, int) and not isinstance(v, bool):
                    v = float(v)
                if not isinstance(v, want) or (want is int and isinstance(v, bool)):
                    raise KVConfigError(f"kv_connector_extra_config.{k} must be {want.__name__}")
                kw[k] = v
            # other vLLM keys (backends, num_threads, engine_ttl, ...) are accepted and ignored
        _addresses_from_env(kw)
        cfg = cls(**kw)
        if (cfg.kv_recompute_threshold or 0) < 0 or cfg.kv_link_prior_gbps <= 0 \
                or cfg.kv_link_prior_rtt_ms < 0 or cfg.kv_link_assumed_gbps < 0 \
                or cfg.kv_link_sample_max_age_s <= 0 \
                or cfg.decoder_kv_blocks_ttl <= 0 or cfg.decoder_kv_lease_duration <= 0 \
                or cfg.kv_lease_duration <= 0 or cfg.connect_timeout_s <= 0 \
                or cfg.read_timeout_s <= 0 or cfg.read_stall_s <= 0 or cfg.peer_breaker_s < 0 or cfg.peer_max_in_flight < 1:
            raise KVConfigError("thresholds and durations must be positive")
        if cfg.decoder_kv_eviction not in ("value", "oldest"):
            raise KVConfigError("kv_connector_extra_config.decoder_kv_eviction must be 'value' "
                                "or 'oldest'")
        return cfg


HOST_ENV, PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"


def _addresses_from_env(kw: dict) -> None:
    """vLLM's side-channel variables where the config names no address; then the transport
    follows the side channel (so setting only VLLM_NIXL_SIDE_CHANNEL_HOST, as a vLLM user does,
    is enough for P/D across hosts with either transport)."""
    host = os.environ.get(HOST_ENV, "").strip()
    if host and "side_channel_host" not in kw:
        kw["side_channel_host"] = host
    port = os.environ.get(PORT_ENV, "").strip()
    if port and "side_channel_port" not in kw:
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise KVConfigError(f"{PORT_ENV}={port!r} is not a port number (0-65535)")
        kw["side_channel_port"] = int(port)
    if "transfer_host" not in kw and "side_channel_host" in kw:
        kw["transfer_host"] = kw["side_channel_host"]
        if "transfer_bind_host" not in kw and "side_channel_bind_host" in kw:
            kw["transfer_bind_host"] = kw["side_channel_bind_host"]
