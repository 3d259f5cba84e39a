"""Verified reuse for prefill workers that do not check tokens themselves (vLLM).

vLLM's P takes `min(remote_num_tokens, prompt_tokens)` tokens of D's KV and never compares
token ids (protocol.md 4, 8): a next-turn prompt that is not a token-exact extension of D's
sequence (a re-tokenized answer, a stripped reasoning trace, an edited history) is computed on
another text's KV. Our own workers verify before a pull; for the others the router does:

    learn      D's sequence in tokens: the D leg asks `return_token_ids` (prompt_token_ids +
               each choice's token_ids), stripped from the client's answer unless it asked;
               the first `remote_num_tokens` of them (the ones whose KV D holds) are stored
               with the conversation's entry
    next turn  the prompt exactly as P will see it: P's own /tokenize with the same messages,
               tools, chat_template(_kwargs), add_generation_prompt, continue_final_message and
               add_special_tokens; then the P leg asks `return_token_ids` too, and a P whose
               prompt does not start with the verified prefix is retried as a miss (so the
               check does not rest on /tokenize alone)
    hand over  the common prefix, cut to whole blocks of D's block size (learned from D's
               `vllm:cache_config_info`) unless it is D's whole sequence (then D's own partial
               last block, as vLLM hands it); `remote_num_tokens` and `remote_block_ids` trimmed
               to it; nothing below `threshold` tokens (a miss)

A turn that reuses nothing still hands P D's params with `remote_num_tokens` 0 (`release`):
vLLM's P then reads nothing and sends D the notify-only message that frees D's blocks at once,
instead of D holding them to its TTL (vLLM counts those as expired). Not for `bad_params`.

Outcomes (kv_stats.prefill.pull_outcome, the reuse metric): `pulled` (handed over all D held:
`verify.outcome` hit) or a cut prefix (`partial`), `mismatch` (with `verify.reason`),
`threshold`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

TOKENIZE_CHAT_FIELDS = ("messages", "tools", "chat_template", "chat_template_kwargs",
                        "add_generation_prompt", "continue_final_message", "add_special_tokens",
                        "mm_processor_kwargs", "media_io_kwargs")
TOKENIZE_COMPLETION_FIELDS = ("prompt", "add_special_tokens")
_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.M)
MAX_TOKENS_KEPT = 1 << 20  # a sequence longer than this is not stored (no reuse): bounded memory


@dataclass(slots=True)
class Verdict:
    outcome: str  # hit | partial | mismatch | threshold
    reason: str = ""  # for mismatch: diverged | unverifiable | tokenize_failed | ...
    held_tokens: int = 0  # D's sequence with KV
    prompt_tokens: int = 0  # the new prompt as P tokenizes it
    matched_tokens: int = 0  # their common prefix
    offered_tokens: int = 0  # what P is told it may read (whole blocks of it)
    verify_ms: float = 0.0  # the router's /tokenize round trip

    @property
    def reuses(self) -> bool:
        return self.outcome in ("hit", "partial")

    def as_dict(self) -> dict:
        return asdict(self)

    def pull_outcome(self) -> str:
        return "pulled" if self.reuses else self.outcome


def block_size_from_metrics(text: str) -> int | None:
    """vLLM's /metrics -> its KV block size in tokens (None if it does not say)."""
    m = _BLOCK_SIZE.search(text)
    size = int(m.group(1)) if m else 0
    return size if 0 < size <= 1 << 16 else None


def tokenize_body(body: dict, chat: bool) -> dict:
    fields = TOKENIZE_CHAT_FIELDS if chat else TOKENIZE_COMPLETION_FIELDS
    out = {k: body[k] for k in fields if k in body}
    if "model" in body:
        out["model"] = body["model"]
    return out


def token_list(value, limit: int = MAX_TOKENS_KEPT) -> list[int] | None:
    """A JSON value that should be a list of token ids -> that list, or None if it is not one."""
    if not isinstance(value, list) or len(value) > limit:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return value
    return None


def held_sequence(prompt_ids, output_ids, params: dict | None) -> list[int] | None:
    """D's prompt + output tokens, cut to the `remote_num_tokens` whose KV D holds."""
    prompt, output = token_list(prompt_ids), token_list(output_ids)
    n = params.get("remote_num_tokens") if isinstance(params, dict) else None
    if prompt is None or output is None or not _count(n):
        return None
    seq = prompt + output
    return seq[:n] if n <= len(seq) else None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def verify(params: dict, held: list[int] | None, prompt: list[int] | None,
           block_size: int | None, threshold: int) -> tuple[dict | None, Verdict]:
    """-> (the params to hand P, or None for a miss; the verdict)."""
    if held is None:
        return None, Verdict("mismatch", "unverifiable")
    v = Verdict("mismatch", held_tokens=len(held))
    if prompt is None:
        v.reason = "tokenize_failed"
        return None, v
    v.prompt_tokens = len(prompt)
    v.matched_tokens = matched = common_prefix(held, prompt)
    blocks = _block_ids(params)
    if blocks is None:
        v.reason = "bad_params"
        return None, v
    if matched == len(held):
        offered, n_blocks, v.outcome = matched, None, "hit"
    elif block_size is None:
        v.reason = "block_size_unknown"
        return None, v
    else:
        n_blocks = matched // block_size
        offered, v.outcome = n_blocks * block_size, "partial"
    if offered == 0:
        v.outcome, v.reason = "mismatch", "diverged"
        return None, v
    if offered < threshold:
        v.outcome = "threshold"
        return None, v
    v.offered_tokens = offered
    out = dict(params, remote_num_tokens=offered)
    if n_blocks is not None:
        out["remote_block_ids"] = [g[:n_blocks] for g in blocks]
    return out, v


def release_params(params: dict) -> dict | None:
    """D's params that tell P to read nothing and free D's blocks (None: they are malformed)."""
    return dict(params, remote_num_tokens=0) if _block_ids(params) is not None else None


def _block_ids(params: dict) -> list[list[int]] | None:
    ids = params.get("remote_block_ids")
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        ids = [ids]  # old builds sent a flat list
    if (isinstance(ids, list) and ids and all(isinstance(g, list) for g in ids)):
        return ids
    return None


def prefix_holds(answer: dict, params: dict | None, held: list[int]) -> bool:
    """After the P leg: P's own prompt tokens start with the prefix it was told to read."""
    if params is None:
        return True
    n = params.get("remote_num_tokens")
    prompt = token_list(answer.get("prompt_token_ids"))
    return _count(n) and prompt is not None and prompt[:n] == held[:n]


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
