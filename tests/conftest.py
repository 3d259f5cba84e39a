"""Shared fixtures: the tiny synthetic model, made once per test session."""

from pathlib import Path

import pytest

from duplexkv.model.synth import make_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
