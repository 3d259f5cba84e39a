"""`n > 1`: one request, n choices, the prompt computed once.

Choice 0 is the request itself: its id, its KV transfer params (a pull from P, a decode-local
adoption, retention when it finishes). Choices 1..n-1 are sequences of their own, with ids
`<request id>#<i>` (`#` is outside what a client's X-Request-Id may hold, http/request_id.py),
held back until choice 0 has computed the prompt's full blocks before its last token. Then each
takes those blocks by reference (`Scheduler.adopt_prefix`) and computes only the rest of the
prompt (the last partial block: 1..block_size tokens, at least the last token, whose logits it
samples from). This does not depend on the prefix cache (it holds with it off, as P runs) nor on
where choice 0's KV came from (computed, cached, pulled). The shared blocks are full and hold
only prompt tokens, so nobody writes them again; each choice's refcount keeps them alive past
choice 0's end.

Sampling follows vLLM (vllm/v1/engine/parallel_sampling.py): each choice is its own request with
n=1 and, when the request has a seed, seed + index; every choice has its own generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from duplexkv.wire.sampling import SamplingParams
from duplexkv.engine.sequence import Sequence

CHOICE_SEP = "#"


def choice_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}{CHOICE_SEP}{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s own params: n=1 and seed + index (vLLM's child seeds)."""
    return replace(params, n=1, seed=None if params.seed is None else params.seed + index)


def shared_prompt_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """The prompt's tokens in full blocks before its last token: what choices 1.. take."""
    return (num_prompt_tokens - 1) // block_size * block_size


@dataclass(slots=True)
class ChoiceGroup:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # the request's (n > 1)
    shared_tokens: int
    held: list[int] = field(default_factory=list)  # choices not started yet
    live: set[str] = field(default_factory=set)  # started, unfinished choices' ids

    def ids(self) -> list[str]:
        return [choice_id(self.request_id, i) for i in range(self.params.n)]


class Choices:
    """The engine's n > 1 requests in flight, by request id (= choice 0's id)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.groups: dict[str, ChoiceGroup] = {}

    def open(self, seq: Sequence, params: SamplingParams) -> None:
        """`seq` is choice 0 of a request with `params.n` > 1."""
        g = ChoiceGroup(seq.request_id, seq.prompt_token_ids, params,
                        shared_prompt_tokens(seq.num_prompt_tokens, self.block_size),
                        list(range(1, params.n)), {seq.request_id})
        self.groups[seq.request_id] = g

    def ready(self, seq: Sequence) -> tuple[list[Sequence], list[int], int]:
        """The held choices that may start now that `seq` has progressed (none unless `seq` is
        a choice 0 whose shared blocks are computed), with the blocks they share and for how
        many tokens."""
        g = self.groups.get(seq.request_id)
        if g is None or not g.held or seq.num_computed_tokens < g.shared_tokens:
            return [], [], 0
        children = [self._child(g, i, seq) for i in g.held]
        g.held = []
        g.live.update(c.request_id for c in children)
        return children, seq.block_table[: g.shared_tokens // self.block_size], g.shared_tokens

    def _child(self, g: ChoiceGroup, index: int, parent: Sequence) -> Sequence:
        child = Sequence(choice_id(g.request_id, index), list(g.prompt_ids),
                         choice_params(g.params, index), self.block_size,
                         parent_id=g.request_id, index=index)
        child.arrival_time = parent.arrival_time  # one request: queue time from its arrival
        return child

    def finished(self, seq: Sequence) -> None:
        """One choice ended; the group goes once none is left."""
        g = self.groups.get(seq.parent_id or seq.request_id)
        if g is not None:
            g.live.discard(seq.request_id)
            if not g.live and not g.held:
                del self.groups[g.request_id]

    def close(self, request_id: str) -> list[str] | None:
        """End a group early (abort, a choice failed): its unfinished choices' ids, or None when
        `request_id` names no group."""
        g = self.groups.pop(request_id, None)
        return None if g is None else sorted(g.live)
