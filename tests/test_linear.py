"""The few-row linear path (layers/linear.py) against F.linear: same values to float32 rounding,
contiguous outputs that the layers can view, bias added, large products left to F.linear
bit for bit, the switch that turns it off, and the model's projections built on it."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from duplexkv.layers import linear as lin


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, lin.SMALL_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_equal_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(768, 512, generator=g)
    b = torch.randn(768, generator=g) if bias else None
    x = torch.randn(rows, 512, generator=g)
    got = lin.linear(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.is_contiguous()  # the attention layer views its qkv output per head
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_strided_input_row_is_taken_as_it_is():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    x = torch.randn(5, 32, generator=g)[2:3]  # a view of one row
    torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_many_rows_are_f_linear_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(lin.SMALL_ROWS + 1, 64, generator=g)
    assert torch.equal(lin.linear(x, w), F.linear(x, w))


def test_the_switch_restores_f_linear():
    code = ("import torch, torch.nn.functional as F; from duplexkv.layers import linear as l; "
            "w = torch.randn(300, 40); x = torch.randn(3, 40); "
            "assert not l.ENABLED and torch.equal(l.linear(x, w), F.linear(x, w))")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "DUPLEXKV_SMALL_GEMM": "0"})


def test_model_layers_use_it():
    from duplexkv.model.config import ModelConfig
    from duplexkv.model.presets import get_preset
    from duplexkv.model.qwen3 import CausalLM

    cfg: ModelConfig = get_preset("tiny")
    m = CausalLM(cfg)
    kinds = {type(mod) for name, mod in m.named_modules() if name.endswith("proj")}
    assert kinds == {lin.Linear}
