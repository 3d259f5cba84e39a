"""Command-line list flags that accumulate, below every layer.

`--decode A --decode B` means both workers, as users type it: argparse's plain `nargs="+"` keeps
only the last occurrence, and its `action="extend"` appends to a non-empty default instead of
replacing it. `Accumulate` does neither: the first occurrence replaces the default, every later
one adds to it (`--decode A B --decode C` is [A, B, C]).
"""

from __future__ import annotations

import argparse


class Accumulate(argparse.Action):
    """nargs="+" values that add up over repeated flags (the default only if none is given)."""

    def __init__(self, option_strings, dest, nargs="+", **kwargs) -> None:
        if nargs not in ("+", "*"):
            raise ValueError("Accumulate takes nargs '+' or '*'")
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        # still the default object (or None): this is the first occurrence, which replaces it
        base = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, base + list(values))
