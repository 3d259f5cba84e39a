"""D-local suffix prefill: a conversation's next turn runs on the D that holds its history.

The router (router/placement.py) sends the turn straight to the D that retained the previous
turn, with that turn's params and `"decode_local": true`. D then checks its own retained entry
against the new prompt exactly as a P reader would (the holder's chained block hashes, then token
by token in the first block that differs: retained.match_tokens) and starts the request from the
verified blocks, as a local prefix; only the new suffix is prefilled, in chunks between the
decodes of the other requests (the scheduler's chunked prefill). The old entry is released at
once (the new turn is retained in its place when it finishes).

    params check   our own engine id; signed when the cluster has a secret (auth.py)
    entry          unknown / mismatch -> the whole prompt is computed here (still correct)
    blocks         full blocks of the match; the entry's unfinished last block too when the match
                   covers it and nobody else holds it (the new tokens are written after the
                   verified ones in it); never a full (cached) block the match stops inside
Every outcome is in `kv_stats.decode_local` and counted (`duplexkv_kv_decode_local`).
"""

from __future__ import annotations

from duplexkv.engine.block_manager import hash_token_blocks, salt_tag, salted
from duplexkv.engine.kv_transfer import EngineHost, KVLayout
from duplexkv.wire.kv_params import KVTransferParams
from duplexkv.engine.sequence import Sequence
from duplexkv.kv.auth import SIGNATURE_KEY, KVAuth, signed_fields
from duplexkv.kv.holder import Holder
from duplexkv.kv.retained import match_tokens

DECODE_LOCAL_KEY = "decode_local"
OUTCOMES = ("reused", "mismatch", "unknown", "untrusted", "other_engine")


def is_decode_local(p: KVTransferParams) -> bool:
    return p.extra.get(DECODE_LOCAL_KEY) is True


class LocalReuse:
    def __init__(self, holder: Holder, host: EngineHost, layout: KVLayout, engine_id: str,
                 auth: KVAuth) -> None:
        self.holder, self.host, self.layout = holder, host, layout
        self.engine_id, self.auth = engine_id, auth
        self.counters = dict.fromkeys(OUTCOMES, 0)
        self.reused_tokens = 0

    def adopt(self, seq: Sequence, p: KVTransferParams) -> str:
        """Start `seq` from our retained entry named by `p` (before it is queued)."""
        outcome, verified, reused = self._adopt(seq, p)
        self.counters[outcome] += 1
        self.reused_tokens += reused
        seq.stats.decode_local = {"outcome": outcome, "verified_tokens": verified,
                                  "reused_tokens": reused}
        return outcome

    def _adopt(self, seq: Sequence, p: KVTransferParams) -> tuple[str, int, int]:
        if p.remote_engine_id != self.engine_id:
            return "other_engine", 0, 0  # e.g. D restarted: compute here
        if self.auth.enabled and not self.auth.verify(signed_fields(p),
                                                      p.extra.get(SIGNATURE_KEY)):
            return "untrusted", 0, 0
        table = self.holder.retained
        entry = table.get(p.remote_request_id or "")
        if entry is None:
            return "unknown", 0, 0
        bs = self.layout.block_size
        fp, salt = self.layout.fingerprint, seq.params.cache_salt
        if salt_tag(fp, salt) != entry.seed_tag:  # another tenant's turn (cache_salt)
            return "mismatch", 0, 0
        tokens = seq.prompt_token_ids[: len(entry.token_ids)]
        matched = match_tokens(entry, hash_token_blocks(salted(fp, salt), tokens, bs), tokens, bs)
        usable = min(matched, seq.num_prompt_tokens - 1)
        if usable <= 0:
            return "mismatch", matched, 0
        nblocks = self.host.blocks_needed(usable)
        if usable % bs:
            # the new tokens go into the block after the verified ones: only into the entry's
            # own unfinished last block (no hash: in no prefix cache) that nobody else holds;
            # a full block whose match stops inside it is cached and shared, never written
            last = entry.block_ids[nblocks - 1]
            if not self.host.is_private_block(last) or entry.claimed(table.clock()):
                usable, nblocks = (usable // bs) * bs, usable // bs
        if usable > 0:
            self.host.adopt_prefix(seq, entry.block_ids[:nblocks], usable)
        # the new turn replaces the old one (retained again when it finishes)
        gone = table.pop(entry.request_id, "local")
        if gone is not None:
            self.host.unpin(gone.block_ids)
        return "reused", matched, usable

    def state(self) -> dict:
        return {**self.counters, "reused_tokens": self.reused_tokens}
