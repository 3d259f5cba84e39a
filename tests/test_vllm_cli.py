"""`duplexkv serve` named and configured like `vllm serve`: served names (the model argument as
given, or several), `--config FILE.yaml`, HF hub ids from the local HF cache (`--revision`),
`--tokenizer`, `--chat-template`, `--generation-config` (sampling defaults for what a request
omits), and the router in front of workers with several names.

The HF cache is a fake one in tmp laid out as huggingface_hub lays it (refs/, snapshots/ of
symlinks into blobs/), holding the tiny synthetic model's files."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from duplexkv import LLM, config_file
from duplexkv.cli import build_parser
from duplexkv.engine.config import EngineConfig
from duplexkv.engine.llm_engine import LLMEngine
from duplexkv.model.config import ModelLoadError
from duplexkv.model.generation_config import sampling_defaults
from duplexkv.model.hf_cache import snapshot_dir
from duplexkv.model.registry import resolve_model
from duplexkv.model.tokenizer import Tokenizer
from test_router import ARGS as ROUTER_ARGS
from test_router import start_router
from workers import DUPLEXKV, start_p_and_d, start_worker

REPO = "acme/tiny-chat"
MAIN, V1 = "a" * 40, "b" * 40
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _add_snapshot(repo: Path, commit: str, files: dict[str, bytes]) -> None:
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(data)
        (snap / name).symlink_to(Path("../../blobs") / blob.name)


@pytest.fixture(scope="module")
def hub(tiny_model_dir, tmp_path_factory) -> Path:
    """An HF cache with REPO at main (greedy, 5 new tokens by default) and at tag v1 (3)."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    gen = json.loads(files["generation_config.json"])
    for commit, new_tokens in ((MAIN, 5), (V1, 3)):
        cfg = {**gen, "temperature": 0.0, "top_p": 0.9, "max_new_tokens": new_tokens}
        _add_snapshot(repo, commit, {**files, "generation_config.json": json.dumps(cfg).encode()})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    return cache


def test_hub_ids_resolve_offline_from_the_cache(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    repo = hub / "models--acme--tiny-chat"
    assert resolve_model(REPO) == repo / "snapshots" / MAIN
    assert resolve_model(REPO, "v1") == repo / "snapshots" / V1
    assert resolve_model(REPO, V1) == repo / "snapshots" / V1  # a commit directly
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(hub.parent))  # $HF_HOME/hub
    assert snapshot_dir(REPO) == repo / "snapshots" / MAIN
    with pytest.raises(ModelLoadError) as e:
        resolve_model("acme/absent")
    assert str(hub) in str(e.value) and "hf download acme/absent" in str(e.value)
    with pytest.raises(ModelLoadError, match="revision 'v9' is not in the local"):
        resolve_model(REPO, "v9")
    for bad in ("../etc", "refs/../../x"):
        with pytest.raises(ModelLoadError):
            resolve_model(REPO, bad)
    with pytest.raises(ModelLoadError, match=r"a preset \(bench, tiny\), nor a Hugging Face"):
        resolve_model("not a/repo id/at all")


def test_generation_config_modes(hub, tiny_model_dir, tmp_path):
    main = hub / "models--acme--tiny-chat" / "snapshots" / MAIN
    want = {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    assert sampling_defaults("auto", main) == want
    assert sampling_defaults("vllm", main) == {}
    assert sampling_defaults("auto", tiny_model_dir) == {}  # eos ids only: nothing to default
    assert sampling_defaults(str(main), tiny_model_dir) == want  # a folder
    llm = LLM(str(main), dtype="float32", num_kv_blocks=16)  # offline: the same defaults
    out = llm.generate([[5, 6, 7, 8]])[0]  # no SamplingParams: greedy, 5 tokens
    assert len(out.token_ids) == 5 and llm.default_sampling_params().top_p == 0.9
    with pytest.raises(ModelLoadError, match="not found"):
        sampling_defaults(str(tmp_path), tiny_model_dir)
    (tmp_path / "generation_config.json").write_text('{"top_k": 2.5}')
    with pytest.raises(ModelLoadError, match="top_k must be a finite integer"):
        sampling_defaults(str(tmp_path), tiny_model_dir)
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ModelLoadError, match="temperature"):  # checked when the engine loads
        LLMEngine(EngineConfig(model=str(tiny_model_dir), generation_config=str(tmp_path),
                               num_kv_blocks=8))


def test_tokenizer_and_chat_template(tiny_model_dir, tmp_path):
    chat = [{"role": "user", "content": "hello"}]
    tok = Tokenizer.from_dir(tiny_model_dir)
    # --tokenizer: another directory's tokenizer files (here: the same vocabulary, its own
    # template)
    other = tmp_path / "tok"
    other.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", other)
    tcfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": TEMPLATE}))
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), tokenizer=str(other),
                                 dtype="float32", num_kv_blocks=8))
    assert eng.tokenize(chat) == tok.encode("[user] hello\n")
    # --chat-template inline (escapes decoded as vLLM does) and from a file
    inline = "{% for m in messages %}<{{ m['content'] }}>\\n{% endfor %}"
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), chat_template=inline,
                                 dtype="float32", num_kv_blocks=8))
    assert eng.tokenize(chat) == tok.encode("<hello>\n")
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), chat_template=str(tmp_path / "t.jinja"),
                                 dtype="float32", num_kv_blocks=8))
    assert eng.tokenize(chat) == tok.encode("[user] hello\n")
    with pytest.raises(ModelLoadError, match="looks like a file path"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), chat_template="no_such.jinja",
                               num_kv_blocks=8))


def _expand(argv: list[str], path: Path) -> list[str]:
    _, commands = build_parser()
    return config_file.expand(argv, commands[argv[0]], path)


def test_config_file_keys_are_the_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": "tiny", "served_model_name": ["a", "b"], "dtype": "float16", "port": 9000,
        "enable-prefix-caching": False, "kv_transfer_config": {"kv_connector": "TcpConnector"},
        "api-key": ["k1", "k2"], "num_kv_blocks": 64, "revision": None}))
    parser, _ = build_parser()
    args = parser.parse_args(_expand(["serve", "--dtype", "float32", "--kv-cache-memory", "2"],
                                     cfg))
    assert args.model == "tiny" and args.served_model_name == ["a", "b"]
    assert args.dtype == "float32" and args.port == 9000  # the command line wins over the file
    assert args.enable_prefix_caching is False and args.api_key == ["k1", "k2"]
    assert args.kv_transfer_config == {"kv_connector": "TcpConnector"}
    # --kv-cache-memory on the command line silences the file's exclusive --num-kv-blocks
    assert args.num_kv_blocks is None and args.kv_cache_memory == 2.0
    args = parser.parse_args(_expand(["serve", "other", "--api-key", "k3"], cfg))
    assert args.model == "other" and args.api_key == ["k3"]  # not appended to the file's
    cfg.write_text("prefill: [http://127.0.0.1:1]\ndecode: [http://127.0.0.1:2]\n"
                   "rewrite_remote_host: false\n")
    args = parser.parse_args(_expand(["router"], cfg))
    assert args.prefill == ["http://127.0.0.1:1"] and args.rewrite_remote_host is False


@pytest.mark.parametrize("text,message", [
    ("max-modle-len: 5\n", "has no flag --max-modle-len"),
    ("- a\n- b\n", "must be a mapping"),
    ("port: [1, 2\n", "not valid YAML"),
    ("enable-prefix-caching: maybe\n", "must be true or false"),
    ("port: [1, 2]\n", "takes one value"),
])
def test_config_file_mistakes_are_one_error_line(tmp_path, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    r = subprocess.run([DUPLEXKV, "serve", "tiny", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("duplexkv: error: --config ") and message in r.stderr, r.stderr
    assert str(cfg) in r.stderr
    r = subprocess.run([DUPLEXKV, "serve", "tiny", "--config", str(tmp_path / "none.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot be read" in r.stderr


def test_worker_from_a_config_file_serves_a_hub_id_with_its_defaults(hub, tiny_model_dir,
                                                                      tmp_path, oracle):
    """`duplexkv serve --config c.yaml` with the hub id, names, template and limits in the file;
    generation_config.json's temperature 0 and max_new_tokens 5 apply to a request without them,
    a request's own max_tokens wins; the command line's --dtype beats the file's."""
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": REPO, "served-model-name": [REPO, "chat"], "dtype": "float16",
        "max-model-len": 256, "num-kv-blocks": 48, "chat-template": str(tmp_path / "t.jinja")}))
    w = start_worker(REPO, tmp_path / "w.log", "--config", str(cfg),
                     env={"HF_HUB_CACHE": str(hub)})  # start_worker adds --dtype float32
    try:
        cards = w.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == [REPO, "chat"]
        assert {c["max_model_len"] for c in cards} == {256}
        assert w.get("/debug/engine").json()["dtype"] == "float32"
        prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 3
        for name in (REPO, "chat"):
            r = w.post("/v1/completions", {"model": name, "prompt": prompt, "ignore_eos": True})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["model"] == REPO  # responses carry the first name, as vLLM's
            assert out["usage"]["completion_tokens"] == 5
            assert out["choices"][0]["text"] == oracle(prompt, 5).text  # greedy by default
        r = w.post("/v1/completions", {"model": "chat", "prompt": prompt, "max_tokens": 7,
                                       "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 7
        r = w.post("/v1/completions", {"model": str(tiny_model_dir), "prompt": prompt})
        assert r.status_code == 404, r.text
        r = w.post("/v1/chat/completions", {"model": "chat", "max_tokens": 1,
                                            "messages": [{"role": "user", "content": "hello"}]})
        want = Tokenizer.from_dir(tiny_model_dir).encode("[user] hello\n")
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        assert "sampling defaults from the model's generation config" in w.log.read_text()
    finally:
        w.stop()


def test_router_routes_every_served_name(tiny_model_dir, tmp_path):
    kv = {"kv_connector": "TcpConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"bidirectional_kv_xfer": True}}
    p, d = start_p_and_d(tiny_model_dir, tmp_path, *ROUTER_ARGS, "--served-model-name",
                         "tiny-a", "tiny-b", kv=kv)
    r = start_router(tmp_path / "router.log", [p.url], [d.url])
    try:
        assert [m["id"] for m in r.get("/v1/models").json()["data"]] == ["tiny-a", "tiny-b"]
        messages = [{"role": "user", "content": "print('hello world') " * 30}]
        for turn, name in enumerate(("tiny-b", "tiny-a")):
            body = {"model": name, "messages": messages, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True}
            out = r.post("/v1/chat/completions", body, **{"X-Session-ID": "names"})
            assert out.status_code == 200, out.text
            assert out.json()["kv_stats"]["conversation"] == ("miss" if turn == 0 else "hit")
            messages = messages + [out.json()["choices"][0]["message"],
                                   {"role": "user", "content": "again " * 10}]
        out = r.post("/v1/chat/completions", {**body, "model": "tiny"})
        assert out.status_code == 404, out.text
    finally:
        r.stop()
        p.stop()
        d.stop()
