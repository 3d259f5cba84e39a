"""Where duplexkv keeps what it makes on first use (preset models, compiled kernels):
`$DUPLEXKV_CACHE_DIR`, else `$XDG_CACHE_HOME/duplexkv`, else `~/.cache/duplexkv`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if env := os.environ.get("DUPLEXKV_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "duplexkv"
