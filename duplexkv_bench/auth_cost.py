"""What authentication adds to a pull, part by part, in one process (no model, no engine), so
that a loaded machine's noise does not hide sub-millisecond differences as it does in the
end-to-end `bench reuse --secret`:

    params check     the reader's check of D's params (kv_signature over a 16k entry's block ids;
                     without a secret: the loopback-host check)
    verify, fresh    one verify of a 16k-token prompt on a new side-channel socket (connect, and
                     with a secret the CURVE handshake and the ZAP check): the old per-request path
    verify, kept     the same verify on a kept socket (`ClientPool`): what readers do now
    transport HELLO  connect + HELLO of the TCP transport (once per connection, which a reader
                     keeps; reopened after 60 s idle)

    .venv/bin/duplexkv bench auth_cost [--tokens 16384] [--reps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from duplexkv.kv import messages as m
from duplexkv.kv import side_channel
from duplexkv.kv.auth import KVAuth, SIGNATURE_KEY
from duplexkv.kv.transport import make_transport
from duplexkv.wire.kv_params import KVTransferParams

BLOCK = 16


def _median_ms(fn, reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(auth: KVAuth, tokens: int, reps: int) -> dict[str, float]:
    blocks = tokens // BLOCK
    p = KVTransferParams(do_remote_decode=True, remote_block_ids=tuple(range(blocks)),
                         remote_engine_id="d", remote_request_id="r", remote_host="127.0.0.1",
                         remote_port=1, remote_num_tokens=tokens)
    if auth.enabled:
        p.extra[SIGNATURE_KEY] = auth.sign_params(p)
    out = {"params check": _median_ms(lambda: auth.params_trusted(p), reps)}

    hs = side_channel.Handshake("d", "c", "tcp", b"", BLOCK, blocks, 1)
    reply = m.VerifyReply(tokens, 0.0, "", b"\0" * 16)
    server = side_channel.SideChannelServer("127.0.0.1", 0, hs, {"verify": lambda r: reply},
                                            auth)
    server.start()
    pool = side_channel.ClientPool(auth)
    verify = m.Verify("r", [b"\0" * 16] * blocks, list(range(tokens)))
    try:
        out["verify, fresh socket"] = _median_ms(lambda: side_channel.request(
            "127.0.0.1", server.port, verify, m.VerifyReply, 5.0, auth), reps)
        out["verify, kept socket"] = _median_ms(lambda: pool.request(
            "127.0.0.1", server.port, verify, m.VerifyReply, 5.0), reps)
    finally:
        pool.close()
        server.close()

    holder = make_transport("tcp", engine_id="h", auth=auth)
    reader = make_transport("tcp", engine_id="r", auth=auth)
    holder.register(torch.zeros((4, 64), dtype=torch.uint8))
    reader.register(torch.zeros((4, 64), dtype=torch.uint8))
    md = holder.metadata()

    def hello() -> None:  # a fresh link: connect + HELLO, then one 64-byte READ
        reader.disconnect("h")
        reader.connect("h", md)
        h = reader.read("h", [0], [1], b"x")
        while reader.poll(h).value == "pending":
            pass
        reader.release(h)

    try:
        out["transport connect + HELLO + READ"] = _median_ms(hello, max(10, reps // 4))
    finally:
        reader.close()
        holder.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="alternating plain/secret rounds")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "secret": []}
    for _ in range(args.rounds):  # alternate, so that a machine getting busier hits both
        runs["plain"].append(measure(KVAuth(None), args.tokens, args.reps))
        runs["secret"].append(measure(KVAuth(b"bench-auth-cost-secret-0123456789"),
                                      args.tokens, args.reps))
    plain, secret = ({k: statistics.median(r[k] for r in rs) for k in rs[0]}
                     for rs in (runs["plain"], runs["secret"]))
    print(f"{args.tokens} tokens; median over {args.rounds} alternating rounds of the median of "
          f"{args.reps} (connections: {max(10, args.reps // 4)})")
    print("| part | no secret | secret | added |")
    print("|---|---|---|---|")
    for k in plain:
        print(f"| {k} | {plain[k]:.3f} ms | {secret[k]:.3f} ms | {secret[k] - plain[k]:+.3f} ms |")
    per_pull = sum(secret[k] - plain[k] for k in ("params check", "verify, kept socket"))
    print(f"added per pull on kept connections (params check + verify): {per_pull:+.3f} ms")


if __name__ == "__main__":
    main()
