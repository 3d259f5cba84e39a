"""A decode step opens no OpenMP parallel region.

The kernels' own thread pool runs a decode step (`native_pool.h`); a torch op that opens an OpenMP
region in between wakes libgomp's team, whose thread then competes with the pool's helper for the
other core (with libgomp's default wait policy it spins there through the LM head that follows).
Selecting the sampling rows with `hidden[rows]` did that from 8 rows of width 512 on, and RoPE's
cos/sin from 128 elements on: an in-process 4k x 8 step took 17.6 ms instead of 13.8 (AMD EPYC Zen
4, 2 threads, float32; docs/engine.md). The count comes from a shim preloaded into a child process
that wraps libgomp's `GOMP_parallel`, which torch's `at::parallel_for` calls for every region.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from duplexkv.layers import native
from duplexkv.model.presets import get_preset
from duplexkv.model.qwen3 import Rotary
from duplexkv.model.synth import config_json, init_weights

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
static long count;
long dkv_test_gomp_count(void) { return count; }
void GOMP_parallel(void (*fn)(void *), void *data, unsigned n, unsigned flags) {
    static void (*real)(void (*)(void *), void *, unsigned, unsigned);
    if (!real) real = dlsym(RTLD_NEXT, "GOMP_parallel");
    count++;
    real(fn, data, n, flags);
}
"""

CHILD = r"""
import ctypes, sys, torch
from duplexkv import LLM, SamplingParams
count = ctypes.CDLL(None).dkv_test_gomp_count
count.restype = ctypes.c_long
torch.set_num_threads(2)
c = count()
torch.randn(8, 512)[list(range(8))]  # the old row selection: the shim must see its region
probe = count() - c
llm = LLM(sys.argv[1], dtype="float32", enable_prefix_caching=False, num_kv_blocks=64)
eng = llm.engine
for i in range(8):
    eng.add_request([5 + i + j for j in range(40)],
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
sched = eng.scheduler
while sched.waiting or any(s.in_prefill for s in sched.running):
    eng.step()
c = count()
for _ in range(4):
    eng.step()
print(probe, count() - c, len(sched.running))
"""


def wide_model(tiny_model_dir, out):
    """tiny with hidden size 512 (the bench model's): `hidden[rows]` opens a region at 8 rows of
    512 (4096 floats), not at tiny's 8 rows of 64."""
    shutil.copytree(tiny_model_dir, out)
    cfg = dataclasses.replace(get_preset("tiny"), hidden_size=512)
    save_file(init_weights(cfg, 0), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json(cfg)))
    return out


def test_decode_step_opens_no_openmp_region(tiny_model_dir, tmp_path):
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler for the libgomp shim")
    (tmp_path / "shim.c").write_text(SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", str(tmp_path / "shim.c"), "-o", str(shim),
                    "-ldl"], check=True)
    model = wide_model(tiny_model_dir, tmp_path / "wide")
    env = {**os.environ, "LD_PRELOAD": str(shim)}
    r = subprocess.run([sys.executable, "-c", CHILD, str(model)], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    probe, regions, running = map(int, r.stdout.split()[-3:])
    assert probe >= 1, "the shim saw no region where torch opens one: it counts nothing here"
    assert running == 8
    assert regions == 0, f"{regions} OpenMP regions in 4 decode steps of 8 sequences"


def test_rope_tables_hold_the_bits_computed_per_step():
    """The tables grow as positions rise and give what cos/sin of the positions give directly."""
    for head_dim in (32, 64, 80, 128):
        rope = Rotary(head_dim, 1e6, 40960)
        gen = torch.Generator().manual_seed(head_dim)
        for rows in (1, 8, 300, 5000):
            positions = torch.randint(0, 40960, (rows,), generator=gen)
            cos, sin = rope(positions, torch.float32)
            freqs = positions.float()[:, None] * rope.inv_freq[None, :]
            assert torch.equal(cos[:, 0], freqs.cos()) and torch.equal(sin[:, 0], freqs.sin())
        assert 40000 <= rope.cos_table.shape[0] <= 40960  # doubling stops at max_pos
        bf = rope(torch.tensor([3, 7]), torch.bfloat16)[0]
        assert bf.dtype == torch.bfloat16 and bf.shape == (2, 1, head_dim // 2)
