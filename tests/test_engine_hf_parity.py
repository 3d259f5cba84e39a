"""The engine against HF transformers on the same weights (float32, greedy): Qwen3 (the `tiny`
preset), and Llama and Qwen2 variants of it (no q/k norm; Qwen2 with random non-zero q/k/v
biases), on short prompts and on a 1.1k-token prompt prefilled in several chunks."""

import pytest
import torch
from model_variants import step_logits, variant

from duplexkv import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

STEPS = 32


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def model(request, tiny_model_dir, tmp_path_factory):
    d = variant(tiny_model_dir, tmp_path_factory.mktemp(request.param) / "m", request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert type(hf).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                                 "qwen2": "Qwen2ForCausalLM"}[request.param]
    if request.param == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    return request.param, d, hf


@pytest.mark.parametrize("prompt_len, chunk", [(5, 4096), (16, 4096), (53, 4096), (1100, 256)])
def test_logits_and_tokens_match_transformers(model, prompt_len, chunk):
    """Token ids equal and logits within 1e-4 at every step; the 1100-token prompt is prefilled
    in five chunks of at most 256 tokens (chunked prefill over a cached prefix)."""
    arch, d, hf_model = model
    torch.manual_seed(prompt_len)
    vocab = hf_model.config.vocab_size
    prompt = torch.randint(3, vocab, (prompt_len,)).tolist()
    llm = LLM(str(d), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=chunk)
    assert llm.engine.model_config.architecture == arch
    outs, seen = step_logits(llm, [prompt], STEPS)
    tokens, logits = outs[0].token_ids, [step[0] for step in seen]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False,
                                output_logits=True, return_dict_in_generate=True,
                                min_new_tokens=STEPS, pad_token_id=0)
    ref_tokens = ref.sequences[0, prompt_len:].tolist()
    assert tokens == ref_tokens
    assert len(logits) == STEPS
    for step, (ours, theirs) in enumerate(zip(logits, ref.logits)):
        diff = (ours - theirs[0].float()).abs().max().item()
        assert diff < 1e-4, f"step {step}: max |logit diff| {diff}"
    llm.engine.check_integrity()


def test_chat_prompt_matches_transformers_template(tiny_model_dir):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "def add(a, b):"}]
    ref_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ref_ids, dict) or hasattr(ref_ids, "input_ids"):
        ref_ids = ref_ids["input_ids"]
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    out = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out.prompt_token_ids == list(ref_ids)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ref_ids]), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8, pad_token_id=0)
    assert out.token_ids == ref[0, len(ref_ids):].tolist()
