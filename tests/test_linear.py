"""The linear layer's paths (layers/linear.py) against F.linear: few rows and float32 prefill
chunks (oneDNN) give the same values to float32 rounding, contiguous outputs that the layers can
view, bias added; bf16 chunks are F.linear bit for bit, the switches turn the paths off, and the
model's projections are built on it."""

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


@pytest.mark.parametrize("bias", [False, True])
def test_many_float32_rows_go_to_onednn_close_to_f_linear(bias):
    assert lin.ONEDNN_ROWS, "this torch has oneDNN's linear: a silent fallback would hide it"
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(lin.SMALL_ROWS + 1, 64, generator=g)
    got = lin.linear(x, w, b)
    assert got.shape == (lin.SMALL_ROWS + 1, 96) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_many_bf16_rows_are_f_linear_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(lin.SMALL_ROWS + 1, 64, generator=g).bfloat16()
    assert torch.equal(lin.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("var", ["DUPLEXKV_SMALL_GEMM", "DUPLEXKV_ONEDNN_LINEAR"])
def test_the_switches_restore_f_linear_for_many_rows(var):
    code = ("import torch, torch.nn.functional as F; from duplexkv.layers import linear as l; "
            "w = torch.randn(96, 64); x = torch.randn(l.SMALL_ROWS + 1, 64); "
            "assert torch.equal(l.linear(x, w), F.linear(x, w))")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, var: "0"})


def test_model_layers_use_it():
    from duplexkv.model.config import ModelConfig
    from duplexkv.model.presets import get_preset
    from duplexkv.model.qwen3 import CausalLM

    cfg: ModelConfig = get_preset("tiny")
    m = CausalLM(cfg)
    kinds = {type(mod) for name, mod in m.named_modules() if name.endswith("proj")}
    assert kinds == {lin.Linear}
