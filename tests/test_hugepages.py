"""The engine's weights on transparent huge pages (layers/hugepages.py): aligned, zeroed, really
backed by 2 MiB pages where the kernel gives them, tied weights still tied, the same tokens as with
plain allocations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from duplexkv import LLM, SamplingParams
from duplexkv.layers import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    try:
        text = THP.read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1 : text.index("]")]


needs_thp = pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                               reason=f"transparent huge pages: {thp_mode()}")


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's first byte (/proc/self/smaps)."""
    addr, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_zeros_are_aligned_zeroed_and_small_ones_plain():
    t = hugepages.zeros((3, 1 << 20), torch.float32)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert not t.any()
    small = hugepages.zeros((1000,), torch.bfloat16)
    assert small.dtype == torch.bfloat16 and not small.any()


@needs_thp
def test_zeros_get_huge_pages_once_touched():
    t = hugepages.zeros((4 << 20,), torch.float32)  # 16 MiB
    t.fill_(1.0)
    assert huge_kib(t) >= 2048


def test_switch_off_gives_plain_tensors(monkeypatch):
    monkeypatch.setattr(hugepages, "ENABLED", False)
    t = hugepages.zeros((4 << 20,), torch.float32)
    assert not t.any()
    m = torch.nn.Linear(1024, 1024)
    assert hugepages.move_parameters(m) == 0


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 512)
        self.mid = torch.nn.Linear(512, 300)  # its bias, 1,200 bytes, is no multiple of 64
        self.head = torch.nn.Linear(512, 1000, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(7, dtype=torch.float32))


@needs_thp
def test_move_parameters_keeps_values_ties_and_order():
    torch.manual_seed(0)
    m = Tied()
    before = {n: p.clone() for n, p in m.state_dict().items()}
    x = torch.randint(0, 1000, (5,))
    want = m.head(m.mid.weight.t().sum(1) + m.embed(x))
    moved = hugepages.move_parameters(m)
    sizes = [1000 * 512 * 4, 300 * 512 * 4, 300 * 4, 7 * 4]
    assert moved == sum(-(-n // hugepages.ALIGN) * hugepages.ALIGN for n in sizes)
    assert m.head.weight is m.embed.weight
    ptrs = [m.embed.weight.data_ptr(), m.mid.weight.data_ptr(), m.mid.bias.data_ptr(),
            m.table.data_ptr()]
    assert ptrs == sorted(ptrs) and ptrs[0] % hugepages.HUGE_PAGE == 0
    assert all(p % hugepages.ALIGN == 0 for p in ptrs) and ptrs[-1] - ptrs[0] < moved
    for n, p in m.state_dict().items():
        assert torch.equal(p, before[n]), n
    assert torch.equal(m.head(m.mid.weight.t().sum(1) + m.embed(x)), want)
    assert huge_kib(m.embed.weight) >= 2048


def test_views_of_one_storage_are_refused():
    m = torch.nn.Module()
    whole = torch.zeros(8, 16)
    m.a, m.b = torch.nn.Parameter(whole[:4]), torch.nn.Parameter(whole[4:])
    with pytest.raises(ValueError, match="views of one storage"):
        hugepages.move_parameters(m)


def test_an_engine_keeps_its_weights_in_one_arena_and_answers_the_same(monkeypatch):
    prompts = [[5 + i for i in range(200)], [9 + 3 * i for i in range(300)]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run() -> tuple[list[list[int]], LLM]:
        llm = LLM("tiny")
        return [o.token_ids for o in llm.generate(prompts, params)], llm

    tokens, llm = run()
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.embed_tokens.weight
    # the packed bf16 kernels' weights (AMX or avx512_bf16, where bf16 is auto's pick) are
    # buffers; the plain weights they packed were released (empty: data_ptr 0, left out)
    weights = sorted(t.data_ptr() for t in [*model.parameters(), *model.buffers()] if t.numel())
    assert weights[0] % hugepages.HUGE_PAGE == 0  # the arena's start
    assert weights[-1] - weights[0] < hugepages.HUGE_PAGE  # all of tiny's 1.6 MB in it
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    assert all(weights[0] <= t.data_ptr() <= weights[-1] for t in packed)
    monkeypatch.setattr(hugepages, "ENABLED", False)
    plain, _ = run()
    assert tokens == plain


def test_the_weights_move_after_the_amx_packs_release_theirs_and_before_the_stack(monkeypatch):
    """On AMX, `pack_linears` releases each packed weight's plain copy; moved before it, the copies
    would stay resident in the arena (the embedding and norms keep the mapping alive)."""
    from duplexkv.model.qwen3 import CausalLM

    calls = []
    for name in ("pack_linears", "build_decode_stack"):
        real = getattr(CausalLM, name)
        monkeypatch.setattr(CausalLM, name,
                            lambda self, _r=real, _n=name: calls.append(_n) or _r(self))
    real_move = hugepages.move_parameters
    monkeypatch.setattr(hugepages, "move_parameters",
                        lambda m: calls.append("move_parameters") or real_move(m))
    LLM("tiny")
    assert calls == ["pack_linears", "move_parameters", "build_decode_stack"]
