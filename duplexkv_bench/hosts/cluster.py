"""Routers, workers and Redis as real processes in the hosts of a `Network`.

    with Network(["r0", "p0", "d0"]) as net:
        hc = HostCluster(net, model_dir, log_dir)
        p, d = hc.worker("p0", "prefill-0"), hc.worker("d0", "decode-0")
        hc.ready([p, d])
        r = hc.router("r0", "router-0", [p], [d]); hc.ready([r])

A worker is started as a user on its own machine would start it: `duplexkv serve MODEL --host
<its address>` with `VLLM_NIXL_SIDE_CHANNEL_HOST=<its address>` and the cluster secret in
`DUPLEXKV_KV_SECRET`, nothing else about addresses. Because the hosts share one kernel, UCX
would otherwise see its peers as local and copy through CMA / shared memory; `UCX_TLS=tcp`
makes NIXL's bytes cross the (shaped) link as they must between real machines (where UCX picks
its network transports by itself).
"""

from __future__ import annotations

import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from duplexkv.launch import (Proc, bidirectional_kv, router_args, spawn, start, wait_ready,
                             worker_args)
from duplexkv_bench.hosts.netns import Network

WORKER_PORT, ROUTER_PORT, REDIS_PORT = 8000, 8080, 6379


@dataclass
class HostCluster:
    net: Network
    model: str
    log_dir: Path
    connector: str = "TcpConnector"
    served_name: str | None = None  # the API's model name; default: the model directory's name
    secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    procs: list[Proc] = field(default_factory=list)

    def worker(self, host: str, name: str, *args: str, kv_extra: dict | None = None,
               bidirectional: bool = True, env: dict | None = None,
               port: int = WORKER_PORT) -> Proc:
        """`env` adds to (a None value removes from) the worker's environment."""
        addr = self.net.addr(host)
        kv = bidirectional_kv(self.connector, bidirectional, **(kv_extra or {}))
        served = self.served_name or Path(self.model).name
        argv = worker_args(self.model, kv, "--served-model-name", served, *args, host=addr,
                           port=port)
        wenv = {"DUPLEXKV_KV_SECRET": self.secret, "VLLM_NIXL_SIDE_CHANNEL_HOST": addr,
                "UCX_NET_DEVICES": None, "UCX_TLS": "tcp", **(env or {})}
        return self._spawn(host, name, argv, wenv)

    def router(self, host: str, name: str, prefill: list[Proc], decode: list[Proc],
               *args: str, store: str = "memory", port: int = ROUTER_PORT) -> Proc:
        argv = router_args([p.url for p in prefill], [d.url for d in decode], *args,
                           host=self.net.addr(host), port=port, store=store)
        return self._spawn(host, name, argv, {})

    def redis(self, host: str) -> str:
        """Start redis-server in `host` (only the hosts' bridge reaches it); returns its URL."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        addr = self.net.addr(host)
        p = start(f"redis-{host}", [*self.net.prefix(host), exe, "--bind", addr, "--port",
                                    str(REDIS_PORT), "--save", "", "--appendonly", "no",
                                    "--protected-mode", "no"], self.log_dir)
        self.net.adopt(p.proc)
        url = f"redis://{addr}:{REDIS_PORT}/0"
        import redis  # a test dependency of the router's Redis store

        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
        for _ in range(100):
            try:
                client.ping()
                return url
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server in {host} did not answer; see {p.log}")

    def ready(self, procs: list[Proc], timeout_s: float = 120) -> None:
        wait_ready(procs, timeout_s)

    def _spawn(self, host: str, name: str, argv: list[str], env: dict) -> Proc:
        p = spawn(name, argv, self.log_dir, env, die_with_parent=True,
                  prefix=self.net.prefix(host))
        self.net.adopt(p.proc)
        self.procs.append(p)
        return p
