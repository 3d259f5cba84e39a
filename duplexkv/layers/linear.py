"""A linear layer whose few-row products (decode steps, the logits of a step) avoid the slow
small-M path of the CPU BLAS, and whose float32 prefill chunks run on oneDNN.

`F.linear(x, W)` with x [M, in] and W [out, in] reaches the BLAS as a GEMM whose short side is
M. For a few rows (a decode step of 1-16 sequences, the last positions' logits) the MKL in
PyTorch's CPU wheel takes a path that on some CPUs is far slower than the same product asked for
the other way round, `(W @ x.T).T`, whose short side is N. On an AMD EPYC (Zen 3, AVX2, float32,
2 threads, the bench model's 8 layers + LM head, weights out of cache, one process), one decode
step's matmuls took 34.9 ms with F.linear and 21.6 ms this way at 1 row, 62.6 and 31.7 ms at 8
rows; a worker's time per output token at 4k context went from 42.6 to 34.8 ms (batch 1) and
from 131 to 103 ms (batch 8) (`duplexkv bench vs_vllm --servers duplexkv`, with
`DUPLEXKV_SMALL_GEMM=0` for the old path).
The product is the same sum of the same terms; the BLAS may add them in another order, so results
can differ from `F.linear` in the last bits, as they already do between two BLAS kernels (a
prefill and a decode step of the same tokens never ran the same kernel).

Float32 prefill chunks (more than `SMALL_ROWS` rows) go to oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, what inductor's CPU backend emits) instead of MKL's
sgemm: on the AMD EPYC (Zen 3, 2 threads) a 2048 x 512 by 512 x 3072 product took 50 ms against
72 ms, and a 2k/4k-token prefill of the bench model 0.92x the time (in-process A/B, greedy tokens
the same). `DUPLEXKV_ONEDNN_LINEAR=0` keeps F.linear there; bf16/fp16 chunks always do.

Float32 products of up to `NATIVE_ROWS` rows go to `native.linear` instead (each weight row read
once, no packing; faster still), where its kernels are built. Rows up to `SMALL_ROWS` take the
`(W @ x.T).T` path (one row is padded to two: a one-column GEMM is routed to the slow GEMV path
again); more rows (prefill chunks) take the oneDNN path above, or `F.linear`, where the large
GEMM needs no transpose. `DUPLEXKV_SMALL_GEMM=0` turns every path off (A/B measurements, or a
BLAS where they do not pay).

bf16 weights on a CPU with AMX or `avx512_bf16` (`amx.kernels()` not empty) are packed once
after loading (`Linear.pack`) and every product, whatever its row count, runs `amx.linear` (the
AMX kernel, else the AVX-512 BF16 one) on the kernels' own threads: one reduction order for a row
whatever M, so a decode step's rows round as a prefill's rows do (reuse keeps answers,
docs/engine.md), and no sleeping OpenMP team to wake per product. `DUPLEXKV_AMX_LINEAR=0` keeps
the paths above.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from duplexkv.layers import amx, native

SMALL_ROWS = 128  # bench model, 2 threads: (W @ x.T).T was faster at every M up to 256
NATIVE_ROWS = 16  # float32 products this short run native.linear (faster at 1-16 rows)
ENABLED = os.environ.get("DUPLEXKV_SMALL_GEMM", "1") != "0"


_ONEDNN = getattr(torch.ops.mkldnn, "_linear_pointwise", None) \
    if torch.backends.mkldnn.is_available() else None
ONEDNN_ROWS = os.environ.get("DUPLEXKV_ONEDNN_LINEAR", "1") != "0" and _ONEDNN is not None
AMX_LINEAR = os.environ.get("DUPLEXKV_AMX_LINEAR", "1") != "0"


def _onednn_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (ONEDNN_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.is_contiguous() and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [M, in]; few rows through `weight @ x.T`, float32
    prefill chunks through oneDNN."""
    m = x.shape[0]
    if not ENABLED or x.dim() != 2 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if m > SMALL_ROWS:
        if _onednn_ok(x, weight):
            return _ONEDNN(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)
    if m <= NATIVE_ROWS and native.linear_ok(x, weight):
        out = native.linear(x, weight)
    elif m == 1:
        out = torch.mm(weight, x.expand(2, -1).contiguous().t())[:, :1].t().contiguous()
    else:
        out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) computed by `linear` above, without
    the random initialisation: its weights always come from a checkpoint."""

    packed: torch.Tensor | None  # the weight in the packed kernels' layout, once `pack`ed
    bias32: torch.Tensor | None = None
    gate_up: bool = False  # packed as a fused gate/up weight: `silu_mul` (`pack(gate_up=True)`)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # a buffer (not saved): hugepages.move_parameters moves it with the weights
        self.register_buffer("packed", None, persistent=False)

    def reset_parameters(self) -> None:
        pass

    def pack(self, keep_weight: bool = False, gate_up: bool = False) -> bool:
        """Compute every product with the packed bf16 kernel (AMX or AVX-512 BF16, `amx.linear`)
        from now on, if one runs here and takes this weight (bf16, in_features a multiple of
        32). Unless `keep_weight` (a weight shared with another module, as a tied LM head's), the
        plain weight is released: the packed copy is the only one. With `gate_up` (a fused [gate; up] weight, no bias, out_features % 32 == 0) the
        module computes `silu_mul` instead of its product. Returns whether it packed."""
        w = self.weight
        if (not AMX_LINEAR or self.packed is not None or w.dtype != torch.bfloat16
                or self.in_features % amx.K_MULTIPLE or not amx.kernels()
                or (gate_up and (self.bias is not None or self.out_features % 32))):
            return False
        w = w.detach().contiguous()
        self.packed = amx.pack_gate_up(w) if gate_up else amx.pack(w)
        self.gate_up = gate_up
        if self.bias is not None:
            self.bias32 = self.bias.detach().float()
        if not keep_weight:
            self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
        return True

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused gate/up projection packed with `gate_up`, in one kernel
        (the product is never written out): the bits of the bf16 SiLU kernel on `forward(x)`."""
        assert self.gate_up, "silu_mul needs pack(gate_up=True)"
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = amx.linear(rows, self.packed, self.out_features, silu=True)
        return y.view(*shape[:-1], self.out_features // 2)

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """x . W^T (+ bias) in the weight's dtype, or with `float_out` widened to float32 (the
        bits of `forward(x).float()`). A packed weight's kernel writes the float32 values itself:
        torch's conversion of a [M, N] product opens an OpenMP region from 32k elements (a bf16
        decode step's LM head from batch 2 on), which woke a sleeping thread every step."""
        assert not self.gate_up, "a fused gate/up projection computes silu_mul, not its product"
        if self.packed is not None:
            shape = x.shape
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            y = amx.linear(rows, self.packed, self.out_features, self.bias32, float_out=float_out)
            return y.view(*shape[:-1], self.out_features)
        y = linear(x, self.weight, self.bias)
        return y.float() if float_out else y
