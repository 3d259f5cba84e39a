"""Bad requests and configurations give clear errors, never a hang or a wrong answer."""

import pytest

from duplexkv import LLM, SamplingParams
from duplexkv.engine.config import EngineConfig
from duplexkv.engine.llm_engine import RequestRejected


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=8, max_model_len=512)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(RequestRejected, match="maximum context length is 512"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=4))


def test_prompt_that_can_never_fit_the_pool_is_rejected(llm):
    with pytest.raises(RequestRejected, match="KV blocks"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"top_k": -5}, "top_k"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts(llm):
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        llm.generate([[10**9]], SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejected, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=2))


def test_bad_engine_options(tiny_model_dir):
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8_e4m3fn")  # float16 is accepted since --dtype auto
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(str(tiny_model_dir), num_kv_blocksz=3)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(tiny_model_dir), max_model_len=10**7)


def test_stop_strings_and_max_tokens(llm):
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = llm.generate(["def main():"], sp)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    text = full.text
    if len(text) > 6:
        stop = text[3:6]
        out = llm.generate(["def main():"], SamplingParams(max_tokens=20, temperature=0,
                                                           ignore_eos=True, stop=[stop]))[0]
        assert out.finish_reason == "stop"
        assert out.text == text[: text.find(stop)]
