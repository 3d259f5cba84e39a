"""`--generation-config`: the model's recommended sampling defaults, as vLLM applies them.

`auto` (the default) reads `generation_config.json` from the model directory, `vllm` ignores it,
any other value is a directory holding one. The keys vLLM takes (`temperature`, `top_p`, `top_k`,
`min_p`, `repetition_penalty`, `max_new_tokens` as the default `max_tokens`) become the defaults
of every request that omits them; a request's own values always win. HF's `do_sample` is ignored,
as in vLLM.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from duplexkv.model.config import ModelLoadError
from duplexkv.model.loader import read_json

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
INTEGER_KEYS = ("top_k", "max_new_tokens")


def sampling_defaults(source: str, model_dir: Path) -> dict[str, Any]:
    """SamplingParams field -> default, from the generation config `source` names."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else Path(source).expanduser()
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        if source == "auto":
            return {}  # a model without one: plain defaults, as vLLM
        raise ModelLoadError(f"--generation-config {source}: {path} not found (give 'auto', "
                             "'vllm' or a directory holding generation_config.json)")
    raw = read_json(path)
    out: dict[str, Any] = {}
    for key, field in KEYS.items():
        v = raw.get(key)
        if v is None:
            continue
        ok = (isinstance(v, int) if key in INTEGER_KEYS else isinstance(v, (int, float))) \
            and not isinstance(v, bool) and math.isfinite(v)
        if not ok:
            raise ModelLoadError(f"{path}: {key} must be a finite "
                                 f"{'integer' if key in INTEGER_KEYS else 'number'}, got {v!r}")
        out[field] = v
    return out
