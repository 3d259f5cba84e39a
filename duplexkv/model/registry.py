"""MODEL arguments: a model directory, a preset name made once into the user's cache dir, or a
Hugging Face hub id found in the local HF cache (never downloaded; `hf_cache.py`)."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
from pathlib import Path

from duplexkv.model.config import ModelLoadError
from duplexkv.model.hf_cache import hub_cache_dir, is_repo_id, snapshot_dir
from duplexkv.model.presets import PRESETS, SYNTH_VERSION, get_preset
from duplexkv.paths import cache_dir


def preset_dir(preset: str, seed: int = 0) -> Path:
    """Named by the preset's content, not only its name: a cache made before a preset or the
    generator changed is never taken for the current model (a new directory is made beside it)."""
    content = json.dumps({"config": dataclasses.asdict(get_preset(preset)),
                          "synth_version": SYNTH_VERSION}, sort_keys=True)
    digest = hashlib.sha256(content.encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{preset}-seed{seed}-{digest}"


def resolve_model(name_or_dir: str | Path, revision: str | None = None) -> Path:
    """An existing directory as-is; a preset name -> its cached directory, made on first use;
    a hub id -> its snapshot at `revision` (default main) in the local HF cache."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_dir)
    if name not in PRESETS:
        if is_repo_id(name):
            try:
                return snapshot_dir(name, revision)
            except ModelLoadError as e:
                raise ModelLoadError(
                    f"model {name!r} is not a directory (one holding config.json, "
                    f"model.safetensors and tokenizer.json) nor a preset "
                    f"({', '.join(sorted(PRESETS))}); as a Hugging Face repo id: {e}") from None
        raise ModelLoadError(
            f"model {name!r} is neither a directory (one holding config.json, model.safetensors "
            f"and tokenizer.json), a preset ({', '.join(sorted(PRESETS))}), nor a Hugging Face "
            f"repo id (ORG/NAME, looked up in the local cache {hub_cache_dir()})"
        )
    target = preset_dir(name)
    if (target / "config.json").is_file():  # made by an atomic rename: complete
        return target
    from duplexkv.model.synth import make_model  # training a tokenizer: import only when needed

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one maker per machine; the others wait, then reuse
        if not (target / "config.json").is_file():
            make_model(target, name, seed=0)
    return target
