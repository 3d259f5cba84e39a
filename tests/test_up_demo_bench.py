"""`duplexkv up`, `demo` and `bench multiturn` end to end on the tiny model with tiny settings:
real processes, real timings, and nothing left running afterwards (checked through /proc and
by connecting to the ports)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from duplexkv_bench.client import Result
from duplexkv_bench.report import bucket_of, summarize
from duplexkv.cli import main
from duplexkv.http.auth import API_KEY_ENV
from duplexkv.launch import Cluster, ClusterSpec, LaunchError
from duplexkv.launch.client_key import KeyFileError, key_file, own_client_key

DUPLEXKV = str(Path(sys.executable).parent / "duplexkv")
# the tiny model recomputes these short histories faster than a loopback round trip, so its
# measured cost model would decline most pulls: these tests of the machinery use the fixed rule
TINY_TURNS = ["--kv-recompute-threshold", "64", "--max-context", "520", "--system-tokens", "64", "--input-tokens", "80", "120",
              "--answer-tokens", "8", "12", "--dtype", "float32"]


def live_children() -> list[int]:
    """Our child processes that are still running (not yet exited or reaped)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def refuses(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture(autouse=True)
def no_leftovers():
    before = set(live_children())
    yield
    deadline = time.monotonic() + 10
    while set(live_children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(live_children()) - before == set()


def worker_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


@pytest.mark.parametrize("stop, omp", [(signal.SIGINT, None), (signal.SIGTERM, "ACTIVE")],
                         ids=["ctrl-c", "sigterm"])
def test_up_serves_then_stops_cleanly(tiny_model_dir: Path, tmp_path: Path, stop, omp) -> None:
    """`up` serves, its workers run with OMP_WAIT_POLICY=PASSIVE unless the environment sets it,
    and Ctrl-C (SIGINT to the terminal's process group) or SIGTERM stops everything."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", API_KEY_ENV)}
    if omp is not None:
        env["OMP_WAIT_POLICY"] = omp
    # its own process group, as in a terminal: Ctrl-C signals the group
    proc = subprocess.Popen([DUPLEXKV, "up", "--model", str(tiny_model_dir), "--port", "0",
                             "--dtype", "float32", "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Press Ctrl-C" in line:
                break
        out = "".join(lines)
        assert proc.poll() is None, out
        router = re.search(r"router (http://\S+)", out).group(1)
        procs = re.findall(r"^\s+(\S+)\s+(http://\S+)\s+pid (\d+)$", out, re.M)
        assert sorted(name for name, _, _ in procs) == ["decode-0", "prefill-0", "router"]
        assert "curl " + router in out and "OpenAI(base_url=" in out
        assert (tmp_path / "logs" / "prefill-0.log").is_file()
        for name, _, pid in procs:
            if name != "router":
                assert worker_environ(int(pid)).get("OMP_WAIT_POLICY") == (omp or "PASSIVE")

        body = {"model": str(tiny_model_dir), "max_tokens": 4, "ignore_eos": True,
                "messages": [{"role": "user", "content": "print('hello world') " * 40}]}
        # no key given: the router requires the one `up` keeps in a file only its owner reads
        key_path = Path(re.search(r"API key required: the one in (\S+) ", out).group(1))
        assert key_path == key_file() and key_path.stat().st_mode & 0o777 == 0o600
        assert key_path.read_text().strip() not in out  # the key itself is never printed
        r0 = httpx.post(router + "/v1/chat/completions", json=body, timeout=60)
        assert r0.status_code == 401, r0.text
        auth = {"authorization": f"Bearer {key_path.read_text().strip()}", "X-Session-ID": "t"}
        r1 = httpx.post(router + "/v1/chat/completions", json=body, timeout=60, headers=auth)
        assert r1.status_code == 200, r1.text
        body["messages"] += [r1.json()["choices"][0]["message"],
                             {"role": "user", "content": "and again " * 10}]
        r2 = httpx.post(router + "/v1/chat/completions", json=body, timeout=60, headers=auth)
        stats = r2.json()["kv_stats"]  # `up`'s default placement: turn 2 prefills on its D
        assert stats["conversation"] == "hit", stats
        assert stats["placement"] == "decode_local" and stats["prefill"] is None, stats
        assert stats["decode"]["decode_local"]["reused_tokens"] > 300, stats

        if stop == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(stop)
        rest = proc.communicate(timeout=40)[0]
        assert proc.returncode == 0, rest
        assert "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for name, url, pid in procs:
        assert gone(int(pid)), f"{name} (pid {pid}) still running"
        assert refuses(url), f"{name}'s port still open: {url}"


def test_failed_worker_stops_the_launch(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = ClusterSpec(model=str(tiny_model_dir), worker_args=("--dtype", "float32"),
                       decode_args=("--num-kv-blocks", "0"), log_dir=tmp_path)
    cluster = Cluster(spec)
    with pytest.raises(LaunchError, match=r"(?s)decode-0 exited .*num_kv_blocks"):
        cluster.start()
    assert cluster.router is None
    assert [w.name for w in cluster.workers] == ["prefill-0", "decode-0"]
    assert all(not w.alive() for w in cluster.workers)


def test_up_reports_a_worker_that_cannot_start(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    r = subprocess.run([DUPLEXKV, "up", "--model", str(empty), "--port", "0", "--log-dir",
                        str(tmp_path / "logs")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "exited with code" in r.stderr and "config.json" in r.stderr, r.stderr
    for pid in re.findall(r"\(pid (\d+),", r.stdout):
        assert gone(int(pid))


def test_bench_multiturn_end_to_end(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench"
    code = main(["bench", "multiturn", "--model", str(tiny_model_dir), *TINY_TURNS,
                 "--conversations", "2", "--clients", "2", "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "TTFT by context bucket" in printed and "Per turn" in printed
    doc = json.loads((out / "results.json").read_text())
    reqs = doc["requests"]
    assert {r["mode"] for r in reqs} == {"off", "on", "ideal"}
    assert not [r for r in reqs if r["error"]]
    turns = {r["turn"] for r in reqs}
    assert max(turns) >= 3
    for r in reqs:  # real client timings, and the server's token counts
        assert 0 < r["ttft_ms"] <= r["latency_ms"]
        assert r["context_tokens"] > 0 and r["answer_tokens"] >= 8
    on = [r for r in reqs if r["mode"] == "on"]
    # the default placement (auto): a later turn prefills on its D over the history D kept, or
    # (D busy) P pulls that history
    assert any(r["placement"] == "decode_local" for r in on), on
    assert all(r["pulled_tokens"] > 0 if r["placement"] == "prefill_pull" else
               r["placement"] == "decode_local" and r["local_hit_tokens"] > 0
               for r in on if r["turn"] >= 2), on
    assert all(r["pulled_tokens"] == 0 for r in on if r["turn"] == 1)
    assert all(r["pulled_tokens"] == 0 and r["local_hit_tokens"] == 0
               for r in reqs if r["mode"] == "off")
    ideal = [r for r in reqs if r["mode"] == "ideal" and r["turn"] >= 2]
    assert all(r["local_hit_tokens"] > 0 for r in ideal)
    for row in doc["summary"]["by_bucket"]:  # the ratio is off's p50 over on's, from the requests
        for m in ("off", "on"):
            ttfts = [r["ttft_ms"] for r in reqs
                     if r["mode"] == m and bucket_of(r["context_tokens"]) == row["bucket"]]
            assert min(ttfts) <= row[m]["ttft_p50"] <= max(ttfts), (m, row)
        assert row["speedup_on_off"] == pytest.approx(
            row["off"]["ttft_p50"] / row["on"]["ttft_p50"], rel=1e-3)
    assert (out / "ttft_vs_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| context |" in (out / "results.md").read_text()


def test_demo_end_to_end(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    code = main(["demo", "--model", str(tiny_model_dir), *TINY_TURNS,
                 "--log-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for col in ("context tokens", "TTFT reuse off", "TTFT reuse on", "speed-up", "prefill on",
                "history reused", "tokens computed"):
        assert col in printed
    assert re.search(r"reuse cut the time to first token from [\d.]+ s to [\d.]+ s", printed)
    # the per-turn table: turn 1 reuses nothing; under the default placement every later turn
    # (one conversation: its D is idle) prefills its suffix on D over the history D kept
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in printed.splitlines()
            if re.match(r"^│\s+\d+\s+│", line)]
    assert len(rows) >= 3, printed
    where = {int(r[0]): r[5] for r in rows}
    reused = {int(r[0]): int(r[6].replace(",", "")) for r in rows}
    assert where[1] == "P" and all(where[t] == "D" for t in where if t >= 2), where
    assert reused[1] == 0 and all(reused[t] > 0 for t in reused if t >= 2), reused
    m = re.search(r"D prefilled only ([\d,]+) new tokens over the ([\d,]+) tokens", printed)
    assert m and int(m.group(2).replace(",", "")) > int(m.group(1).replace(",", "")), printed


def test_bench_unreachable_router(tiny_model_dir: Path, capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit) as e:
        main(["bench", "multiturn", "--url", f"http://127.0.0.1:{port}", "--model",
              str(tiny_model_dir)])
    assert e.value.code == 2
    assert "cannot reach the router" in capsys.readouterr().err


def test_buckets_and_speedup() -> None:
    assert [bucket_of(n) for n in (1, 2048, 2049, 12289, 16384, 16385, 40000)] == \
        [2048, 2048, 4096, 16384, 16384, 24576, 49152]
    rs = [Result("off", "c0", 1, context_tokens=15000, ttft_ms=5000, prefill_ms=4800),
          Result("on", "c0", 1, context_tokens=15010, ttft_ms=500, prefill_ms=400),
          Result("ideal", "c0", 1, context_tokens=15010, ttft_ms=400),
          Result("on", "c0", 2, context_tokens=17000, error="HTTP 500")]
    s = summarize(rs)
    (row,) = s["by_bucket"]
    assert row["label"] == "16k"
    assert row["speedup_on_off"] == pytest.approx(10) and row["on_vs_ideal"] == \
        pytest.approx(1.25)
    assert row["ceiling_off_ideal"] == pytest.approx(12.5)
    assert row["compute_off_on"] == pytest.approx(12)
    assert s["per_mode"]["on"]["failed"] == 1


def test_workloads(tiny_model_dir: Path, tmp_path: Path) -> None:
    from duplexkv_bench.workload import DEFAULT_SIZES, load_file, plan
    from duplexkv.model.tokenizer import Tokenizer

    convs = plan("agentic", DEFAULT_SIZES["agentic"], 3, 16384, seed=0)
    assert convs == plan("agentic", DEFAULT_SIZES["agentic"], 3, 16384, seed=0)
    for c in convs:
        assert 12288 < c.planned_context + c.turns[-1].answer_tokens <= 16384
        assert all(1024 <= t.input_tokens <= 2048 and 128 <= t.answer_tokens <= 256
                   for t in c.turns)
    chat = plan("chat", DEFAULT_SIZES["chat"], 4, 32768, seed=1)
    assert all(6 <= len(c.turns) <= 9 and c.system_tokens == 500 for c in chat)
    path = tmp_path / "convs.json"
    path.write_text(json.dumps([
        {"id": "a", "messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "hello there"},
                                 {"role": "assistant", "content": "hi " * 20},
                                 {"role": "user", "content": "tool output"},
                                 {"role": "user", "content": "and a question"}]},
        [{"role": "user", "content": "only one message"}]]))
    tok = Tokenizer.from_dir(tiny_model_dir)
    a, b = load_file(path, tok)
    assert (a.id, a.system, len(a.turns)) == ("a", "Be brief.", 2)
    assert a.turns[0].answer_tokens == len(tok.encode("hi " * 20))
    assert a.turns[1].text == "tool output\n\nand a question"
    assert a.turns[1].answer_tokens == 128 and len(b.turns) == 1


def test_cluster_with_api_keys_passes_them_by_environment(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """`up`/`demo`/`bench` launch through Cluster: with client keys the router requires one, the
    workers require a random key of their own that only the router holds, and no key is on a
    command line or in a log."""
    key = "sk-cluster-client-3c9d"
    spec = ClusterSpec(model=str(tiny_model_dir), worker_args=("--dtype", "float32"),
                       log_dir=tmp_path, api_keys=(key,))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with Cluster(spec) as cluster:
        chat = cluster.url + "/v1/chat/completions"
        assert httpx.post(chat, json=body, timeout=60).status_code == 401
        ok = httpx.post(chat, json=body, timeout=60, headers={"authorization": f"Bearer {key}"})
        assert ok.status_code == 200, ok.text
        for w in cluster.workers:
            assert httpx.get(w.url + "/health", timeout=30).status_code == 200
            for auth in ({}, {"authorization": f"Bearer {key}"}):
                assert httpx.get(w.url + "/v1/models", headers=auth,
                                 timeout=30).status_code == 401
        for p in cluster.procs:
            assert key not in Path(f"/proc/{p.proc.pid}/cmdline").read_text()
    for log in tmp_path.glob("*.log"):
        assert key not in log.read_text(errors="replace"), log


def test_up_key_file_is_private_and_refused_when_others_can_read_it(tmp_path: Path) -> None:
    """The key `up` makes when none is given: 0600 in a 0700 directory, the same key next time;
    a file other users can read, a symlink or an empty file is refused with the fix named."""
    path = tmp_path / "cache" / "api-key"
    key = own_client_key(path)
    assert len(key) >= 32 and own_client_key(path) == key
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        own_client_key(path)
    link = tmp_path / "cache" / "link"
    link.symlink_to(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        own_client_key(link)
    path.chmod(0o600)
    path.write_text("\n")
    with pytest.raises(KeyFileError, match="no usable key"):
        own_client_key(path)


def test_up_no_api_key_with_a_key_is_a_usage_error() -> None:
    r = subprocess.run([DUPLEXKV, "up", "--no-api-key", "--api-key", "k1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "choose one" in r.stderr, r.stderr
