"""Tests' helpers for comparing the engine with HF or with itself: the tiny Qwen3 checkpoint
rewritten as other architectures the engine runs, and the logits of every step of a generation."""

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from duplexkv import LLM, SamplingParams


def variant(tiny_model_dir, out, arch: str):
    """The tiny Qwen3 model rewritten as a Llama or Qwen2 checkpoint HF loads as such."""
    if arch == "qwen3":
        return tiny_model_dir
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(out / "model.safetensors")
    w = {k: v for k, v in w.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    if arch == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                   mlp_bias=False)
        cfg.pop("head_dim")  # hidden_size / num_heads, as in Llama
    else:
        cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
        cfg.pop("attention_bias")
        cfg.pop("head_dim")
        g = torch.Generator().manual_seed(7)
        for k in [k for k in w if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
            w[k.replace(".weight", ".bias")] = torch.randn(w[k].shape[0], generator=g) * 0.5
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def step_logits(llm: LLM, prompts: list[list[int]], steps: int):
    """Greedy-generate `steps` tokens for every prompt at once -> (the outputs, the logits the
    sampler saw at each step, [sampling rows, vocab] each)."""
    seen: list[torch.Tensor] = []
    runner = llm.engine.runner
    orig = runner.run

    def run(batch):
        out = orig(batch)
        if out is not None:
            seen.append(out.clone())
        return out

    runner.run = run
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0,
                                                    ignore_eos=True))
    finally:
        runner.run = orig
    return outs, seen
