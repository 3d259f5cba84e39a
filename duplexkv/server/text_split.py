"""Splitting streamed text at tags (`<think>`, `</tool_call>`, ...) that may arrive cut between
deltas: what is safe to pass on now, and the tail held back because it may begin a tag."""

from __future__ import annotations


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """(where, which) of the earliest tag in `text`, or None."""
    found = [(i, t) for t in tags if (i := text.find(t)) >= 0]
    return min(found) if found else None


__all__ = ["find_first", "held_back"]
