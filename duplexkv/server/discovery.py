"""`duplexkv serve ... --discovery redis://...`: the worker registers itself for the routers.

    --discovery [URL]        the registry (without URL: $DUPLEXKV_DISCOVERY)
    --discovery-role R       prefill | decode | both: which of the router's pools it joins
                             (default from kv_role: kv_producer = prefill, kv_consumer = decode;
                             kv_both says neither, so it must be given)
    --advertise-url URL      the HTTP URL routers use; default http://<--host>:<bound port>,
                             which a wildcard --host (0.0.0.0, ::) cannot give: then required
    --discovery-heartbeat S  2 s; the key lives 3 heartbeats

The flags are checked before the engine loads (`DiscoverySpec.from_args`); the registration
starts once the server listens and is deleted as soon as shutdown begins (before the server
drains its requests), so routers stop choosing this worker while it finishes what it has.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from duplexkv.discovery.record import (
    DISCOVERY_ENV,
    MAX_HEARTBEAT_S,
    MIN_HEARTBEAT_S,
    ROLES,
    Capacity,
    DiscoveryURL,
    Registration,
    check_worker_url,
    discovery_url,
    is_wildcard,
    new_worker_id,
    secret_key,
)
from duplexkv.discovery.registrar import Registrar

if TYPE_CHECKING:
    from duplexkv.engine.state import EngineCapacity

KV_ROLE_TO_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode"}


def add_discovery_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--discovery", nargs="?", const="", default=None, metavar="URL",
                   help="register this worker in redis://[:password@]host:port/db for routers "
                        f"started with the same --discovery (without URL: ${DISCOVERY_ENV}, "
                        "which keeps a password off the command line)")
    p.add_argument("--discovery-role", choices=ROLES, default=None,
                   help="the router pool this worker joins (default: from kv_role, "
                        "kv_producer = prefill, kv_consumer = decode)")
    p.add_argument("--advertise-url", default=None, metavar="URL",
                   help="the HTTP URL routers reach this worker at (default http://HOST:PORT; "
                        "required with --discovery when --host is 0.0.0.0 or ::)")
    p.add_argument("--discovery-heartbeat", type=float, default=2.0, metavar="S",
                   help="registration renewal period; the registration expires after 3 "
                        "(default 2 s)")


@dataclass(frozen=True, slots=True)
class DiscoverySpec:
    url: DiscoveryURL
    role: str
    advertise_url: str | None
    heartbeat_s: float
    key: bytes | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DiscoverySpec | None:
        """None without --discovery; bad flags raise ValueError naming the fix."""
        url = discovery_url(args.discovery)
        if url is None:
            for flag in ("discovery_role", "advertise_url"):
                if getattr(args, flag) is not None:
                    raise ValueError(f"--{flag.replace('_', '-')} needs --discovery")
            return None
        role = args.discovery_role
        kv_role = (args.kv_transfer_config or {}).get("kv_role")
        if role is None:
            role = KV_ROLE_TO_ROLE.get(kv_role)
            if role is None:
                raise ValueError(f"--discovery needs --discovery-role prefill|decode|both "
                                 f"(kv_role {kv_role or 'unset'} does not say which pool of the "
                                 "routers this worker joins)")
        if not MIN_HEARTBEAT_S <= args.discovery_heartbeat <= MAX_HEARTBEAT_S:
            raise ValueError(f"--discovery-heartbeat must be within [{MIN_HEARTBEAT_S:g}, "
                             f"{MAX_HEARTBEAT_S:g}] s")
        advertise = args.advertise_url
        if advertise is not None:
            advertise = check_worker_url(advertise if "://" in advertise
                                         else "http://" + advertise)
        elif is_wildcard(args.host):
            raise ValueError(f"--host {args.host or '(all)'} listens on every interface and names "
                             "no address a router can reach: with --discovery give "
                             "--advertise-url http://<this host's routable address>:<port>")
        return cls(url, role, advertise, args.discovery_heartbeat, secret_key())

    def advertised(self, bound_host: str, bound_port: int) -> str:
        if self.advertise_url is not None:
            return self.advertise_url
        host = f"[{bound_host}]" if ":" in bound_host else bound_host
        return f"http://{host}:{bound_port}"

    def registrar(self, engine: EngineCapacity, model: str, bound_host: str, bound_port: int
                  ) -> Registrar:
        cap = Capacity(max_num_seqs=engine.max_num_seqs, kv_blocks=engine.num_kv_blocks,
                       block_size=engine.block_size, max_model_len=engine.max_model_len)
        record = Registration(id=new_worker_id(), role=self.role,
                              url=self.advertised(bound_host, bound_port), model=model,
                              capacity=cap, heartbeat_s=self.heartbeat_s, seq=0, issued_at=0.0)
        return Registrar(self.url, record, self.key)


async def run_registration(registrar: Registrar, server) -> None:
    """Register now; deregister as soon as the server starts to shut down (a signal, or the
    engine died)."""
    registrar.start()
    try:
        while not server.should_exit:
            await asyncio.sleep(0.05)
    finally:
        await registrar.stop()
