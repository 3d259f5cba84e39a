"""Offline generation on one engine: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from duplexkv.engine.config import EngineConfig
from duplexkv.engine.llm_engine import LLMEngine, Prompt, RequestOutput
from duplexkv.wire.sampling import SamplingParams


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict)):
        return [prompts]  # one token-id list or one chat
    return list(prompts)


class LLM:
    def __init__(self, model: str = "bench", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults, as vLLM's."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None
                 = None) -> list[RequestOutput]:
        plist = _as_prompt_list(prompts)
        if not isinstance(sampling_params, list):  # none: the model's generation config's
            sampling_params = [sampling_params or self.default_sampling_params()] * len(plist)
        if len(sampling_params) != len(plist):
            raise ValueError("give one SamplingParams, or one per prompt")
        if any(sp.n != 1 for sp in sampling_params):
            raise ValueError("LLM.generate returns one output per prompt: n must be 1 (the "
                             "server, `duplexkv serve`, answers n choices)")
        ids = [self.engine.add_request(p, sp).request_id for p, sp in zip(plist, sampling_params)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None
             ) -> RequestOutput:
        return self.generate([messages], sampling_params)[0]
