"""duplexkv: prefill/decode disaggregated LLM serving with bidirectional KV-cache transfer."""

from duplexkv.version import __version__
from duplexkv.wire.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # lazy, so that the router and the CLI do not import torch
    if name == "LLM":
        from duplexkv.engine.llm import LLM
        return LLM
    raise AttributeError(name)
