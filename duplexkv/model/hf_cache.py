"""Hugging Face hub ids (`Qwen/Qwen3-0.6B`) resolved from the local HF cache, offline.

duplexkv never downloads: a hub id must already be in the cache (`hf download ID`, or any
earlier transformers/vLLM run), as with `HF_HUB_OFFLINE=1`. The cache layout is huggingface_hub's
documented one (https://huggingface.co/docs/huggingface_hub/guides/manage-cache):

    $HF_HUB_CACHE/models--ORG--NAME/refs/REVISION     the commit a branch or tag points to
    $HF_HUB_CACHE/models--ORG--NAME/snapshots/COMMIT/ the files (symlinks into blobs/)

with HF_HUB_CACHE defaulting to $HF_HOME/hub, HF_HOME to $XDG_CACHE_HOME/huggingface or
~/.cache/huggingface.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from duplexkv.model.config import ModelLoadError

DEFAULT_REVISION = "main"
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REVISION = re.compile(r"^[\w.-]+(?:/[\w.-]+)*$")


def hub_cache_dir() -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if value := os.environ.get(var):
            return Path(value).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def is_repo_id(name: str) -> bool:
    """`ORG/NAME` or `NAME` as the hub spells them (no `..`, `--`, or path separators beyond one)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and "--" not in name


def snapshot_dir(repo_id: str, revision: str | None = None,
                 cache: Path | None = None) -> Path:
    """The cached snapshot of `repo_id` at `revision` (a branch, tag or commit; default main);
    ModelLoadError naming the cache path and the command that fills it when it is absent."""
    cache = hub_cache_dir() if cache is None else cache
    revision = revision or DEFAULT_REVISION
    if not is_repo_id(repo_id):
        raise ModelLoadError(f"{repo_id!r} is not a Hugging Face repo id (ORG/NAME)")
    if not _REVISION.match(revision) or ".." in revision.split("/"):
        raise ModelLoadError(f"revision {revision!r} is not a branch, tag or commit name")
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    hint = (f"duplexkv does not download models: fetch it first (`hf download {repo_id}"
            f"{'' if revision == DEFAULT_REVISION else ' --revision ' + revision}`), or set "
            "HF_HUB_CACHE / HF_HOME to the cache that holds it")
    if not repo.is_dir():
        raise ModelLoadError(f"{repo_id!r} is not in the local Hugging Face cache {cache} (no "
                             f"{repo.name}/); {hint}")
    commit = revision
    if not _COMMIT.match(revision):
        ref = repo / "refs" / revision
        try:
            commit = ref.read_text().strip()
        except OSError:
            raise ModelLoadError(f"model {repo_id!r}: revision {revision!r} is not in the local "
                                 f"Hugging Face cache {cache} (no {ref.relative_to(cache)}); "
                                 f"{hint}") from None
        if not _COMMIT.match(commit):
            raise ModelLoadError(f"{ref}: not a commit hash ({commit[:60]!r})")
    snap = repo / "snapshots" / commit
    if not snap.is_dir():
        raise ModelLoadError(f"model {repo_id!r} at {revision!r}: snapshot {commit} is not in the "
                             f"local Hugging Face cache {cache}; {hint}")
    return snap
