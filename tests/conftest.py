"""Shared fixtures: the tiny synthetic model, made once per test session, and the oracle engine."""

from pathlib import Path

import pytest

import process_leaks
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


# processes a module leaves running (tests/process_leaks.py) --------------------------------
_RUN_MARK = process_leaks.mark_this_run()
_LEAKS: list[process_leaks.Leak] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield  # the module's fixtures are torn down by now when the next test is elsewhere
    if nextitem is None or nextitem.module is not item.module:
        _LEAKS.extend(process_leaks.reap(_RUN_MARK, item.module.__name__))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _LEAKS:
        terminalreporter.section("processes left running (killed)")
        for leak in _LEAKS:
            terminalreporter.line(f"{leak.module}: pid {leak.pid}: {leak.cmd}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _LEAKS and exitstatus == 0:
        session.exitstatus = 1  # a leaked process slows every later test: a bug to fix
