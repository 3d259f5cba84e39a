"""Tokenize long prompts piece by piece, reusing the ids of pieces seen before.

A multi-turn prompt repeats every earlier message; tokenizing 15k tokens of history costs
60-100 ms here, on P and again on D, every turn. The `tokenizers` library first cuts the text at
its added tokens (`<|im_start|>`, `<|im_end|>`, ...) and then normalizes, pre-tokenizes and
encodes each piece between them on its own. So the ids of the whole text are exactly the ids of
its pieces, each encoded alone, with the added tokens' ids between them, and a chat message's
piece can be cached across turns. This holds only when the cut points are plain: added tokens
that strip neighbouring whitespace (lstrip/rstrip), match single words, or are matched after
normalization move or hide the cuts, so such a tokenizer is not split (`splittable` is False and
every call encodes the whole text). A probe text checked at construction guards the rest.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer

MIN_CHARS = 4096  # shorter texts are encoded whole: the split is not worth it
MIN_PIECE_CHARS = 256  # shorter pieces are encoded each time, not cached
# ~1 M tokens of history (e.g. 64 conversations of 16k tokens), ~2 bytes a character with the
# ids as 4-byte arrays: ~8 MB. A 32 M-character bound kept a worker's RSS growing through a
# 10-minute soak of new conversations (2.3 MB/min) before the cache was full.
MAX_CACHED_CHARS = 4 << 20
LONG_TEXT = 1 << 15  # longer texts are encoded with the GIL released (encode_batch of one)


class TooManyTokens(ValueError):
    """The text has more tokens than the caller's limit (counted without building the list)."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least
_PROBE = ("Grüße, naïve café\u0301 — 12345 tokens;\n\n  indented\tline {0}\r\n"
          "it's  done 's {0}{0}\n😀 x")


@dataclass(frozen=True, slots=True)
class SegmentStats:
    entries: int
    chars: int


class SegmentCache:
    def __init__(self, tok: HFTokenizer, max_chars: int = MAX_CACHED_CHARS) -> None:
        self._tok = tok
        self.max_chars = max_chars
        # ids as 4-byte arrays: as lists of Python ints (~36 bytes per token) 6 M cached
        # characters took 32 MB of RSS here, and the cache grew through a whole 10-minute soak
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        added = tok.get_added_tokens_decoder()
        plain = all(not (a.lstrip or a.rstrip or a.single_word or a.normalized)
                    for a in added.values())
        self._ids = {a.content: i for i, a in added.items()}
        self.splittable = plain and bool(self._ids)
        if self.splittable:
            # leftmost match, longest first among those starting at the same place
            alts = sorted(self._ids, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, alts)) + ")")
            self.splittable = self._probe()
        self.hits = self.misses = 0

    def stats(self) -> SegmentStats:
        """Entries and characters cached now (read without the lock, for /debug/memory)."""
        return SegmentStats(len(self._cache), self._chars)

    def _probe(self) -> bool:
        specials = list(self._ids)
        text = "".join(_PROBE.format(s) + specials[i % len(specials)] + "\n"
                       for i, s in enumerate(specials * 2))
        return self._pieces(text, cache=False) == self._tok.encode(text).ids

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Ids of `text` (no special tokens added), equal to encoding it whole. TooManyTokens as
        soon as more than `limit` tokens are certain."""
        if not self.splittable or len(text) < MIN_CHARS:
            return self._encode(text, limit)
        return self._pieces(text, cache=True, limit=limit)

    def _encode(self, text: str, limit: int | None = None) -> list[int]:
        if len(text) < LONG_TEXT:
            return self._tok.encode(text).ids
        # a long text: let other threads (the server's event loop) run while it is encoded,
        # and do not build a huge id list only to refuse it
        enc = self._tok.encode_batch([text])[0]
        if limit is not None and len(enc) > limit:
            raise TooManyTokens(len(enc))
        return enc.ids

    def _pieces(self, text: str, cache: bool, limit: int | None = None) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token (odd positions of a split with one group)
                ids.append(self._ids[piece])
            elif piece:
                ids.extend(self._piece(piece) if cache else self._encode(piece))
            if limit is not None and len(ids) > limit:
                raise TooManyTokens(len(ids))
        return ids

    def _piece(self, piece: str) -> list[int] | array:
        if len(piece) < MIN_PIECE_CHARS:
            return self._tok.encode(piece).ids
        with self._lock:
            got = self._cache.get(piece)
            if got is not None:
                self._cache.move_to_end(piece)
                self.hits += 1
                return got
            self.misses += 1
        got = self._encode(piece)
        with self._lock:
            if piece not in self._cache and len(piece) <= self.max_chars:
                self._cache[piece] = array("i", got)
                self._chars += len(piece)
                while self._chars > self.max_chars:
                    old, _ = self._cache.popitem(last=False)
                    self._chars -= len(old)
        return got
