"""Shared fixtures: the tiny synthetic model, made once per test session, and the oracle engine."""

from pathlib import Path

import pytest

from duplexkv import LLM, SamplingParams
from duplexkv.model.synth import make_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def oracle(tiny_model_dir):
    """One float32 engine computing every prompt from scratch (no prefix cache): what P/D and
    reuse must reproduce token for token under greedy decoding."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128,
              enable_prefix_caching=False)

    def run(prompt, max_tokens=16):
        return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                     ignore_eos=True))[0]
    return run


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.option.markexpr == "not vllm_interop":  # pyproject's default
        return ("vllm_interop deselected (installs vLLM in its own venv, ~3.5 GB, minutes): "
                "pytest -m vllm_interop runs it")
    return None
