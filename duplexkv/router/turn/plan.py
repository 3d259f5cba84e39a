"""A turn's plan: what it replays and where its prefill runs, decided once, when the turn begins,
by a pure function (no I/O, no clock, nothing changed; tests/test_router_turn.py calls it alone).

    plan_turn(req, recalled, holder, cfg) -> TurnPlan
        req        the client's request (its prompt's size: the new suffix's estimate)
        recalled   the conversation's entry as the store handed it (conversation/recall.py)
        holder     the D that entry names, as the pool sees it now (a BackendView), or None
        cfg        --placement and its bounds (placement.py decides: decode_local or P)

A plan then gives each D leg its order (`local_order` for a decode_local turn, `decode_order`
after the P leg), and `fallen_back` is the plan once the D that holds the history could not
serve: the turn runs through P as a miss (kv_stats.conversation "retried").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from duplexkv.router.backends import Backend, BackendView
from duplexkv.router.conversation.recall import Recalled
from duplexkv.router.conversation.recognise import Recognition
from duplexkv.router.conversation.store import Entry
from duplexkv.router.placement import (
    Placement,
    PlacementConfig,
    choose,
    local_params,
    prompt_chars,
)
from duplexkv.router.request import ClientRequest


@dataclass(frozen=True, slots=True)
class DecodeOrder:
    """What the D leg is asked to do (decode.py)."""

    params: dict | None  # P's kv_transfer_params; for decode_local D's own stored ones
    key: str | None  # where D's params go for the next turn (None: no conversation)
    prompt_chars: int | None  # stored with them: the next turn's suffix estimate
    preferred_url: str | None = None  # the conversation's D, kept unless busier (backends.py)
    prefill: Backend | None = None  # the P that prefilled: a D still warming with it is avoided
    only: Backend | None = None  # decode_local: the one D that holds the history
    recognition: Recognition | None = None  # no id: D's params go under the answer's key

    def next_key(self, answer: Callable[[], dict | None]) -> str | None:
        """Where D's params go for the next turn: the conversation's key, or for a recognised
        conversation the key of the request's messages + D's answer (`answer()`)."""
        if self.recognition is None:
            return self.key
        return self.recognition.answer_key(answer())


@dataclass(frozen=True, slots=True)
class TurnPlan:
    key: str | None  # the conversation's store key; None: plain P/D, nothing recalled or kept
    entry: Entry | None  # the stored turn the P leg replays; None: a miss
    conversation: str  # kv_stats.conversation: none | miss | hit | expired | ... | retried
    prompt_chars: int | None = None  # conversation turns only
    placement: Placement | None = None  # where the prefill runs and why; None: no conversation
    local_params: dict | None = None  # decode_local: the params D gets for its own entry
    recognition: Recognition | None = None  # no id: the content's keys (recognise.py)

    @property
    def local(self) -> bool:
        return self.local_params is not None

    def local_order(self, holder: Backend) -> DecodeOrder:
        """The D leg of a decode_local turn, on `holder` (the D of the entry) alone."""
        return DecodeOrder(self.local_params, self.key, self.prompt_chars, only=holder,
                           recognition=self.recognition)

    def decode_order(self, params: dict | None, prefill: Backend | None) -> DecodeOrder:
        """The D leg after P prefilled (`params`: P's kv_transfer_params)."""
        return DecodeOrder(params, self.key, self.prompt_chars,
                           self.entry.decode_url if self.entry is not None else None, prefill,
                           recognition=self.recognition)

    def fallen_back(self) -> TurnPlan:
        """decode_local failed: through P as a miss (counted as decode_local_failed)."""
        placement = self.placement and replace(self.placement, local=False,
                                               reason="decode_local_failed")
        return replace(self, entry=None, conversation="retried", placement=placement,
                       local_params=None)


def plan_turn(req: ClientRequest, recalled: Recalled, holder: BackendView | None,
              cfg: PlacementConfig) -> TurnPlan:
    """The plan of a turn whose conversation's store gave `recalled`; `holder` is the D that
    `recalled.entry` names, as the pool sees it now (None: no entry, or that D left)."""
    if recalled.key is None:
        return TurnPlan(None, recalled.entry, recalled.state)
    entry, chars = recalled.entry, prompt_chars(req.body)
    placement = choose(cfg, entry.params if entry is not None else None, holder, chars)
    local = local_params(entry.params) if placement.local and entry is not None else None
    return TurnPlan(recalled.key, entry, recalled.state, chars, placement, local,
                    recalled.recognition)
