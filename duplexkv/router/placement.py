"""Where a turn's prefill runs: on a P worker (pulling the history from D, or recomputing it), or
on the conversation's own D, which holds the history and prefills only the new suffix there
(llm-d's decode-first idea, with D verifying its retained blocks token by token).

    kind                when
    decode_local        --placement auto (the default), the conversation's entry names a D of
                        ours (/v1/models owned_by duplexkv: a vLLM D does not verify its own
                        blocks) that is healthy, has fewer than --decode-local-max-outstanding
                        requests in flight, and the new suffix is estimated at most
                        --decode-local-max-tokens
    prefill_pull        otherwise, and P pulled the history from D
    prefill_recompute   otherwise, and P computed it (no history, or P declined: its
                        kv_stats.prefill.pull_outcome says why)
The router has no tokenizer: the suffix is estimated from the prompt's characters (message
contents, or the token list of a completion prompt) against the previous turn's characters and
the tokens D retained (`remote_num_tokens`). The estimate counts the previous answer as new,
so it errs high. Reasons (why not decode_local): placement_prefill, no_history, no_estimate,
decode_unknown, decode_not_duplexkv, decode_down, decode_busy, suffix_over_bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from duplexkv.router.backends import BackendView

PROMPT_CHARS_KEY = "_duplexkv_prompt_chars"  # stored with D's params; "_" keys never leave us
PLACEMENTS = ("decode_local", "prefill_pull", "prefill_recompute")
REASONS = ("history_on_decode", "placement_prefill", "no_history", "no_estimate",
           "decode_unknown", "decode_not_duplexkv", "decode_down", "decode_busy",
           "suffix_over_bound", "decode_local_failed")
MODES = ("auto", "prefill")
# auto: the router chooses per turn (issue 14 point 3); prefill: every turn takes the P leg
DEFAULT_MODE = "auto"
OURS = "duplexkv"  # the /v1/models owned_by of a worker that can take a decode_local turn


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    mode: str = DEFAULT_MODE  # "auto" | "prefill" (every turn takes the P leg)
    max_suffix_tokens: int = 4096
    max_decode_outstanding: int = 4

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError("--placement must be 'prefill' or 'auto'")
        if self.max_suffix_tokens < 1 or self.max_decode_outstanding < 1:
            raise ValueError("--decode-local-max-tokens and --decode-local-max-outstanding "
                             "must be >= 1")


@dataclass(frozen=True, slots=True)
class Placement:
    local: bool  # decode_local
    reason: str
    suffix_tokens: int | None = None  # the estimate, when there was one


def prompt_chars(body: dict) -> int | None:
    """Characters of the prompt (or tokens, for a token-list completion prompt)."""
    if isinstance(body.get("messages"), list):
        n = 0
        for m in body["messages"]:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                n += len(c)
            elif isinstance(c, list):
                n += sum(len(p.get("text") or "") for p in c if isinstance(p, dict))
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return None


def estimate_suffix(params: dict, chars_now: int | None) -> int | None:
    """New tokens of this turn beyond what D retained, from the characters."""
    before, tokens = params.get(PROMPT_CHARS_KEY), params.get("remote_num_tokens")
    if chars_now is None or not isinstance(before, int) or not isinstance(tokens, int) \
            or before <= 0 or tokens <= 0:
        return None
    return max(0, round((chars_now - before) * tokens / before))


def choose(cfg: PlacementConfig, params: dict | None, decode: BackendView | None,
           chars_now: int | None) -> Placement:
    """Where the turn's prefill runs: `params` are D's stored params (None: no history),
    `decode` the D they name as the pool sees it now."""
    if cfg.mode == "prefill":
        return Placement(False, "placement_prefill")
    if not params:
        return Placement(False, "no_history")
    suffix = estimate_suffix(params, chars_now)
    if suffix is None:
        return Placement(False, "no_estimate")
    if decode is None:
        return Placement(False, "decode_unknown", suffix)
    if decode.kind != OURS:
        return Placement(False, "decode_not_duplexkv", suffix)
    if not decode.healthy:
        return Placement(False, "decode_down", suffix)
    if decode.outstanding >= cfg.max_decode_outstanding:
        return Placement(False, "decode_busy", suffix)
    if suffix > cfg.max_suffix_tokens:
        return Placement(False, "suffix_over_bound", suffix)
    return Placement(True, "history_on_decode", suffix)


def local_params(stored: dict) -> dict:
    """D's stored params, sent back to that D: prefill the suffix over your own entry."""
    out = {k: v for k, v in stored.items() if not k.startswith("_")}
    out.update(do_remote_decode=False, do_remote_prefill=False, decode_local=True)
    return out


def with_prompt_chars(params: dict | None, chars: int | None) -> dict | None:
    """What the router stores for the next turn's estimate."""
    if not isinstance(params, dict) or chars is None:
        return params
    return {**params, PROMPT_CHARS_KEY: chars}
