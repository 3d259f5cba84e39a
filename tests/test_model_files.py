"""duplexkv.model: synthetic model files, loader, tokenizer, registry, `make-model` CLI."""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from duplexkv.cli import main
from duplexkv.model.config import ModelLoadError
from duplexkv.model.loader import expected_weight_shapes, load_config, load_weights
from duplexkv.model.presets import PRESETS
from duplexkv.model import registry
from duplexkv.model.registry import cache_dir, preset_dir, resolve_model
from duplexkv.model.synth import make_model, stdlib_corpus
from duplexkv.model.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")
CHAT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Héllo! What is 2+2?"},
    {"role": "assistant", "content": "4 — obviously."},
    {"role": "user",
     "content": [{"type": "text", "text": "And 日本語? "}, {"type": "text", "text": "🤖"}]},
]
TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🤖👍🏽, e\u0301 (NFC)",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "  two spaces\n\n\ttab, don't I'LL we're 1234567",
]


def copy_model(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


# files: determinism, atomic creation


def test_make_model_deterministic_and_concurrent(tiny_model_dir: Path, tmp_path: Path) -> None:
    target, results, errors = tmp_path / "same", [], []

    def make() -> None:
        try:
            results.append(make_model(target, "tiny", seed=0))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=make) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [target, target]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same"]  # no temp dirs left
    for name in FILES:  # digests: a failure's message stays short (no diff of megabytes)
        assert digest(target / name) == digest(tiny_model_dir / name), name
    other = make_model(tmp_path / "seed1", "tiny", seed=1)
    assert digest(other / "model.safetensors") != digest(target / "model.safetensors")
    assert digest(other / "config.json") == digest(target / "config.json")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


WEIGHTS_DIGEST = """
import hashlib, sys
from duplexkv.model.presets import get_preset
from duplexkv.model.synth import init_weights
w = init_weights(get_preset(sys.argv[1]), 0)
print(hashlib.sha256(b"".join(v.numpy().tobytes() for v in w.values())).hexdigest())
"""


@pytest.mark.parametrize("preset", ["tiny", "bench"])
def test_weights_are_the_same_on_every_cpu_kind(preset: str) -> None:
    """PyTorch picks its SIMD code by the CPU (ATEN_CPU_CAPABILITY forces a kind): float32 normals
    and exp gave other bits on AVX2 than on the portable path, so a model made on one machine
    kind differed from one made on another (and torch's exp varied between processes on one)."""
    digests = set()
    for kind in ("default", "avx2"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": kind}
        out = subprocess.run([sys.executable, "-c", WEIGHTS_DIGEST, preset], env=env,
                             capture_output=True, text=True, timeout=120, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests


def test_make_model_refuses_a_directory_with_other_files(tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="already exists"):
        make_model(tmp_path / "busy", "tiny")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    with pytest.raises(ModelLoadError, match="bench, tiny"):
        make_model(tmp_path / "x", "huge")


def test_corpus_is_sorted_stdlib_text() -> None:
    first = next(stdlib_corpus(1))
    assert "__future__" in first or "import" in first


# transformers compatibility


def test_transformers_loads_the_same_weights(tiny_model_dir: Path) -> None:
    cfg = load_config(tiny_model_dir)
    assert cfg == PRESETS["tiny"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert hf.config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ours = load_weights(tiny_model_dir, cfg, torch.float32)
    theirs = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert ours.keys() == theirs.keys()
    for k, v in ours.items():
        assert torch.equal(v, theirs[k]), k
    assert sum(v.numel() for v in ours.values()) == hf.num_parameters()
    gen = transformers.GenerationConfig.from_pretrained(tiny_model_dir)
    assert gen.eos_token_id == [2, 0]


def test_transformers_tokenizer_and_chat_template_match(tiny_model_dir: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tok = Tokenizer.from_dir(tiny_model_dir)
    code = next(stdlib_corpus(1))[:4000]
    for text in [*TEXTS, code]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text[:40]
    for gen_prompt in (True, False):
        ours = tok.apply_chat_template(CHAT, add_generation_prompt=gen_prompt)
        theirs = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen_prompt)
        assert ours == theirs
    assert ours.startswith("<|im_start|>system\nYou answer in one line.<|im_end|>\n")
    assert tok.apply_chat_template(CHAT[:2]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(ours).count(tok.token_to_id("<|im_start|>")) == 4


# tokenizer


def test_tokenizer_roundtrip_and_specials(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    assert tok.vocab_size == 4096 and tok.eos_token_ids == (2, 0)
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user<|im_end|>")[-1] == 2
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text.replace("e\u0301", "\u00e9")
    assert tok.decode(tok.encode("<|im_end|>ok")) == "ok"


def test_incremental_detokenizer_holds_back_partial_utf8(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    text = "naïve 日本語 🤖👍🏽 done"
    ids = tok.encode(text) + [2]
    assert len(ids) > len(text.split())  # multibyte characters span several tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]  # something was held back mid-character
    assert detok.flush() == ""
    # a stream that ends mid-character: flush() releases the replacement character
    emoji = tok.encode("🤖")
    tail = IncrementalDetokenizer(tok)
    assert tail.push(emoji[:-1]) == ""
    assert tail.flush() == tail.text and tail.text.endswith("\ufffd")


def test_tokenizer_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_model_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(d)
    d2 = copy_model(tiny_model_dir, tmp_path / "m2")
    cfg = json.loads((d2 / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d2 / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="chat_template"):
        Tokenizer.from_dir(d2).apply_chat_template(CHAT)


# loader


def write_config(d: Path, **changes: object) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_load_config_variants(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_model_dir, tmp_path / "m")
    # transformers 5 style
    write_config(d, rope_theta=None, rope_scaling=None, torch_dtype=None, dtype="bfloat16",
                 rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    c = load_config(d)
    assert (c.rope_theta, c.torch_dtype, c.qk_norm) == (5e5, "bfloat16", True)
    write_config(d, architectures=["LlamaForCausalLM"], model_type="llama", head_dim=None,
                 rope_parameters=None, rope_theta=1e4)
    c = load_config(d)
    assert (c.architecture, c.head_dim, c.qk_norm, c.attention_bias) == ("llama", 32, False, False)
    assert "model.layers.0.self_attn.q_norm.weight" not in expected_weight_shapes(c)
    write_config(d, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    c = load_config(d)
    assert c.attention_bias and not c.qk_norm
    assert expected_weight_shapes(c)["model.layers.1.self_attn.k_proj.bias"] == (32,)
    untied = write_config(d, tie_word_embeddings=False)
    assert expected_weight_shapes(load_config(untied))["lm_head.weight"] == (4096, 64)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"architectures": ["GPT2LMHeadModel"]},
         "GPT2LMHeadModel.*Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "'llama3'"),
        ({"hidden_size": None}, "'hidden_size' must be a positive integer"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ],
)
def test_load_config_errors(tiny_model_dir: Path, tmp_path: Path, changes: dict, match: str):
    d = write_config(copy_model(tiny_model_dir, tmp_path / "m"), **changes)
    with pytest.raises(ModelLoadError, match=match) as e:
        load_config(d)
    assert "config.json" in str(e.value)


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        load_config(tmp_path)


def rewrite_weights(d: Path, edit) -> Path:
    path = d / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return d


def test_load_weights_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = PRESETS["tiny"]
    name = "model.layers.1.mlp.up_proj.weight"
    d = rewrite_weights(copy_model(tiny_model_dir, tmp_path / "shape"),
                        lambda t: t.__setitem__(name, torch.zeros(191, 64)))
    with pytest.raises(ModelLoadError) as e:
        load_weights(d, cfg)
    msg = str(e.value)
    assert name in msg and "model.safetensors" in msg and "(191, 64)" in msg and "(192, 64)" in msg
    d = rewrite_weights(copy_model(tiny_model_dir, tmp_path / "missing"), lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=rf"1 tensor\(s\) missing.*{name}"):
        load_weights(d, cfg)
    d = rewrite_weights(copy_model(tiny_model_dir, tmp_path / "extra"),
                        lambda t: t.__setitem__("model.extra.weight", torch.zeros(2)))
    with pytest.raises(ModelLoadError, match="unexpected.*model.extra.weight"):
        load_weights(d, cfg)
    # a tied lm_head copy and rotary buffers are tolerated
    d = rewrite_weights(copy_model(tiny_model_dir, tmp_path / "tied"), lambda t: t.update({
        "lm_head.weight": t["model.embed_tokens.weight"].clone(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}))
    assert "lm_head.weight" not in load_weights(d, cfg)
    d = copy_model(tiny_model_dir, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: file not found"):
        load_weights(d, cfg)


def test_load_sharded_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = PRESETS["tiny"]
    single = load_weights(tiny_model_dir, cfg, torch.float32)
    d = copy_model(tiny_model_dir, tmp_path / "sharded")
    (d / "model.safetensors").unlink()
    names = sorted(single)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for fname, group in shards.items():
        save_file({n: single[n] for n in group}, str(d / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, g in shards.items() for n in g}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_weights(d, cfg, torch.bfloat16)
    assert loaded.keys() == single.keys()
    assert all(loaded[k].dtype == torch.bfloat16 for k in loaded)
    assert all(torch.equal(loaded[k], single[k].to(torch.bfloat16)) for k in single)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors.*not found"):
        load_weights(d, cfg)


# registry and CLI


def test_resolve_model(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv("DUPLEXKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "duplexkv"
    monkeypatch.setenv("DUPLEXKV_CACHE_DIR", str(tmp_path / "cache"))
    assert resolve_model(tiny_model_dir) == tiny_model_dir
    made = resolve_model("tiny")
    assert made == preset_dir("tiny") and made.parent == tmp_path / "cache" / "models"
    assert digest(made / "model.safetensors") == digest(tiny_model_dir / "model.safetensors")
    assert resolve_model("tiny") == made
    with pytest.raises(ModelLoadError, match=r"bench, tiny.*|config\.json") as e:
        resolve_model("no-such-model")
    assert "config.json" in str(e.value) and "bench, tiny" in str(e.value)


# vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend.get_supported_head_sizes (0.32.0)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def test_presets_are_loadable_by_vllms_cpu_attention() -> None:
    """tiny was 4 heads x 16, which vLLM's CPU attention refuses; scripts/vllm_interop.sh serves
    it with real vLLM. GQA stays (query heads > KV heads), as the engine's folded path needs."""
    for name, cfg in PRESETS.items():
        assert cfg.head_dim in VLLM_CPU_HEAD_SIZES, name
        assert cfg.num_heads > cfg.num_kv_heads, name


def test_a_preset_cached_by_an_older_version_is_never_loaded(tmp_path: Path, tiny_model_dir: Path,
                                                             monkeypatch) -> None:
    """An upgrade that changes a preset (tiny was 4 heads x 16) must not load the model an older
    version left in the cache under the same preset name: the directory is named by content."""
    monkeypatch.setenv("DUPLEXKV_CACHE_DIR", str(tmp_path))
    old_cfg = dataclasses.replace(PRESETS["tiny"], num_heads=4, num_kv_heads=2, head_dim=16)
    stale = copy_model(tiny_model_dir, tmp_path / "models" / "tiny-seed0")  # the old name
    cfg = json.loads((stale / "config.json").read_text())
    cfg.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    (stale / "config.json").write_text(json.dumps(cfg))
    assert load_config(stale) == old_cfg
    made = resolve_model("tiny")
    assert load_config(made) == PRESETS["tiny"]
    assert digest(made / "model.safetensors") == digest(tiny_model_dir / "model.safetensors")
    # another config or generator version is another directory; the same content the same one
    assert preset_dir("tiny") == made and preset_dir("tiny", seed=1) != made
    monkeypatch.setitem(PRESETS, "tiny", old_cfg)
    assert preset_dir("tiny") != made
    monkeypatch.undo()
    monkeypatch.setenv("DUPLEXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(registry, "SYNTH_VERSION", registry.SYNTH_VERSION + 1)
    assert preset_dir("tiny") != made


def test_cli_make_model(tmp_path: Path, capsys) -> None:
    assert main(["make-model", str(tmp_path / "m"), "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "m") in out and "360,896 parameters" in out
    assert load_config(tmp_path / "m") == PRESETS["tiny"]
    with pytest.raises(SystemExit) as e:
        main(["make-model", str(tmp_path / "x"), "--preset", "huge"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("duplexkv: error: ") and "'tiny'" in err and "'bench'" in err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["make-model", str(tmp_path / "busy"), "--preset", "tiny"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("duplexkv: error: ") and err.count("\n") == 1


# the tiny model's outputs: clear margins, and they depend on the context through attention


@torch.no_grad()
def test_tiny_model_has_clear_margins_and_uses_context(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    # one thread: HF's generate on a 0.4 M-parameter model is all per-op overhead, which a
    # second OpenMP thread only adds to (the margins are far above any summation-order change)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_margins_and_context(tiny_model_dir)
    finally:
        torch.set_num_threads(threads)


def _check_margins_and_context(tiny_model_dir: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf.eval()
    vocab = hf.config.vocab_size
    rng = torch.Generator().manual_seed(0)

    def greedy(ids: list[int]) -> tuple[list[int], torch.Tensor]:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                          pad_token_id=0)
        top2 = torch.stack(out.logits)[:, 0].topk(2, dim=-1).values
        return out.sequences[0, len(ids):].tolist(), top2[:, 0] - top2[:, 1]

    gaps, distinct, changed = [], [], 0
    for _ in range(20):
        ids = torch.randint(3, vocab, (24,), generator=rng).tolist()
        toks, gap = greedy(ids)
        gaps.append(gap)
        distinct.append(len(set(toks)))
        assert not {0, 2} & set(toks[:1])  # no eos at once
        ids[2] = 3 + (ids[2] + 100) % (vocab - 3)
        changed += greedy(ids)[0] != toks
    gaps = torch.cat(gaps)
    assert (gaps < 0.05).float().mean() < 0.02 and gaps.median() > 1.0
    assert min(distinct) >= 4 and sum(distinct) / len(distinct) >= 12
    assert changed >= 18

    # broken RoPE / a lost KV block change the next token; a uniform position shift does not
    cfg = hf.config
    cfg_bad = type(cfg).from_dict({**cfg.to_dict(), "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4}})
    bad_theta = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, config=cfg_bad, dtype=torch.float32).eval()

    def next_tok(model, ids, pos) -> int:
        return model(ids, position_ids=pos).logits[0, -1].argmax().item()

    diffs = {"shift": 0, "zero_pos": 0, "theta": 0, "drop16": 0}
    for _ in range(30):
        ids, pos = torch.randint(3, vocab, (1, 40), generator=rng), torch.arange(40)[None]
        ref = next_tok(hf, ids, pos)
        diffs["shift"] += next_tok(hf, ids, pos + 1000) != ref
        diffs["zero_pos"] += next_tok(hf, ids, pos * 0) != ref
        diffs["theta"] += next_tok(bad_theta, ids, pos) != ref
        diffs["drop16"] += next_tok(hf, ids[:, 16:], pos[:, 16:]) != ref
    assert diffs["shift"] <= 1, diffs
    assert min(diffs["zero_pos"], diffs["theta"], diffs["drop16"]) >= 20, diffs
