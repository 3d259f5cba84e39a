"""duplexkv: prefill/decode disaggregated LLM serving with bidirectional KV-cache transfer."""

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy, so that the router and the CLI do not import torch
    if name == "LLM":
        from duplexkv.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from duplexkv.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
