"""Multi-turn workloads: conversations planned in tokens, then filled with real text.

    agentic   a shared system prompt (1k tokens), then turns that each add a 1-2k-token tool
              result or user message and get a 128-256-token answer, until the history would
              pass --max-context
    chat      vLLM's generator defaults (benchmarks/multi_turn/generate_multi_turn.json): a
              500-token prefix shared by all and a unique lognormal one (avg 1000, max 5000) on
              the first user message, user messages 120-160 tokens, answers 80-120, 12-18
              messages (6-9 turns)
    FILE      a JSON list of conversations, each {"id": ..., "messages": [...]} or a bare list of
              messages; consecutive non-assistant messages form one turn, an assistant message
              in the file sets the length of the answer asked for (its text is replaced by the
              model's real answer, as in vLLM's benchmark)

Lengths come from `seed` alone; the text (windows of tokenised Python standard-library source)
from `seed` and a `salt`, so the modes of one run can send conversations of identical shape but
different content (no mode warms another's caches).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from duplexkv.model.tokenizer import Tokenizer

MESSAGE_OVERHEAD = 5  # template tokens around a message: <|im_start|>role\n ... <|im_end|>\n


@dataclass(frozen=True, slots=True)
class Sizes:
    system_tokens: int
    input_tokens: tuple[int, int]  # per turn: the tool result or user message
    answer_tokens: tuple[int, int]
    max_turns: int = 1_000
    first_prefix: tuple[int, int] = (0, 0)  # chat: unique prefix on the first message (avg, max)


DEFAULT_SIZES = {
    "agentic": Sizes(1024, (1024, 2048), (128, 256)),
    "chat": Sizes(500, (120, 160), (80, 120), max_turns=9, first_prefix=(1000, 5000)),
}


@dataclass(frozen=True, slots=True)
class Turn:
    kind: str  # "tool", "user" (what the added message stands for)
    input_tokens: int
    answer_tokens: int
    text: str = ""  # filled by `materialise`


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    system_tokens: int
    turns: tuple[Turn, ...]
    system: str = ""

    @property
    def planned_context(self) -> int:
        """Prompt tokens of the last turn, as planned (the server's count is the truth)."""
        return context_before(self, len(self.turns) - 1) + self.turns[-1].input_tokens


def context_before(conv: Conversation, k: int) -> int:
    """Planned prompt tokens before turn k's new message (system + earlier turns + answers)."""
    n = conv.system_tokens + MESSAGE_OVERHEAD if conv.system_tokens else 0
    for t in conv.turns[:k]:
        n += t.input_tokens + t.answer_tokens + 2 * MESSAGE_OVERHEAD
    return n + MESSAGE_OVERHEAD + 3  # the new message's wrapper and the generation prompt


def plan(workload: str, sizes: Sizes, n: int, max_context: int, seed: int) -> list[Conversation]:
    """`n` conversations of the generated workload, each ending before `max_context`."""
    rng = random.Random(seed)
    convs = []
    for i in range(n):
        turns: list[Turn] = []
        n_turns = rng.randint(6, 9) if workload == "chat" else sizes.max_turns
        conv = Conversation(f"c{i}", sizes.system_tokens, ())
        for k in range(min(n_turns, sizes.max_turns)):
            size = rng.randint(*sizes.input_tokens)
            if k == 0 and sizes.first_prefix[0]:
                size += lognormal(rng, *sizes.first_prefix)
            kind = "user" if workload == "chat" or k == 0 or rng.random() < 0.3 else "tool"
            turn = Turn(kind, size, rng.randint(*sizes.answer_tokens))
            trial = replace(conv, turns=(*turns, turn))
            if trial.planned_context + turn.answer_tokens > max_context:
                break
            turns.append(turn)
            conv = trial
        if not turns:
            raise ValueError(f"--max-context {max_context} is too small for one turn of the "
                             f"{workload} workload (system {sizes.system_tokens} tokens, input "
                             f"{sizes.input_tokens[0]}+, answer {sizes.answer_tokens[0]}+)")
        convs.append(conv)
    return convs


def lognormal(rng: random.Random, average: int, maximum: int, sigma: float = 0.85) -> int:
    mu = math.log(average) - sigma * sigma / 2
    return min(maximum, max(1, round(rng.lognormvariate(mu, sigma))))


def load_file(path: Path, tok: Tokenizer, default_answer: int = 128) -> list[Conversation]:
    """Conversations from a JSON file: the texts are used as they are."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the conversations file {path}: {e}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: expected a non-empty JSON list of conversations")
    convs = []
    for i, item in enumerate(raw):
        msgs = item.get("messages") if isinstance(item, dict) else item
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "content" in m
                                                 for m in msgs):
            raise ValueError(f"{path}: conversation {i} has no list of messages with 'content'")
        system = "\n".join(m["content"] for m in msgs if m.get("role") == "system")
        turns: list[Turn] = []
        pending: list[str] = []
        for m in [m for m in msgs if m.get("role") != "system"] + [{"role": "assistant"}]:
            if m.get("role") != "assistant":
                pending.append(str(m["content"]))
                continue
            if pending:
                text = "\n\n".join(pending)
                answer = len(tok.encode(m["content"])) if m.get("content") else default_answer
                turns.append(Turn("user", len(tok.encode(text)), max(1, answer), text))
                pending = []
        if turns:
            cid = str(item.get("id", f"c{i}")) if isinstance(item, dict) else f"c{i}"
            convs.append(Conversation(cid, len(tok.encode(system)) if system else 0,
                                      tuple(turns), system))
    if not convs:
        raise ValueError(f"{path}: no conversation has a user message")
    return convs


class TextSource:
    """Token windows of a fixed corpus, decoded: `text(n)` re-tokenises to about n tokens."""

    def __init__(self, tok: Tokenizer, tokens_needed: int) -> None:
        from duplexkv.model.synth import stdlib_corpus  # imports torch: only when needed

        self.tok = tok
        chars = max(200_000, 6 * tokens_needed)
        self.ids = tok.encode("\n".join(stdlib_corpus(chars)))

    def text(self, rng: random.Random, n: int) -> str:
        n = max(0, min(n, len(self.ids) - 1))
        if n == 0:
            return ""
        start = rng.randrange(len(self.ids) - n)
        return self.tok.decode(self.ids[start:start + n])


def materialise(convs: list[Conversation], source: TextSource, seed: int,
                salt: str) -> list[Conversation]:
    """Fill planned conversations with text; the system prompt is shared by all of them."""
    rng = random.Random(f"{seed}/{salt}")
    system = ("You are a software agent. You read the tool output and the user's messages below "
              "and answer with your next step.\n\n")
    shared = system + source.text(rng, max(0, convs[0].system_tokens - 24))
    out = []
    for conv in convs:
        if conv.system or all(t.text for t in conv.turns):  # from a file: keep as it is
            out.append(conv)
            continue
        turns = tuple(replace(t, text=_frame(t.kind, source.text(rng, t.input_tokens - 12), k))
                      for k, t in enumerate(conv.turns))
        out.append(replace(conv, turns=turns, system=shared if conv.system_tokens else ""))
    return out


def _frame(kind: str, body: str, k: int) -> str:
    if kind == "tool":
        return f"[tool result {k}] cat module.py\n```\n{body}\n```"
    return f"Here is the next file to review (step {k}):\n{body}"


def total_tokens(convs: list[Conversation]) -> int:
    return sum(c.system_tokens + sum(t.input_tokens for t in c.turns) for c in convs)
