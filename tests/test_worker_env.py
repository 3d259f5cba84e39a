"""Issue 32, flat memory wherever a worker starts: a worker started by hand (`duplexkv serve`,
not through `duplexkv up` or the launcher) sets the OpenMP/oneDNN defaults itself, before torch
loads; a variable the user set wins. Before, only the launcher set them: hand-started workers
under 40 conversations for 240 s grew +77 MB/min (P) and +121 MB/min (D), +5 and +9 with them."""

from __future__ import annotations

import os
import subprocess
import sys

from test_router import ARGS

from duplexkv.engine.process_env import WORKER_ENV_DEFAULTS, apply_worker_env
from duplexkv.launch import start, wait_ready, worker_args


def test_defaults_fill_what_is_missing_and_the_user_wins():
    env = {"OMP_WAIT_POLICY": "ACTIVE", "LRU_CACHE_CAPACITY": ""}
    if "torch" in sys.modules:  # other tests of this session may have imported it
        env.update(WORKER_ENV_DEFAULTS, OMP_WAIT_POLICY="ACTIVE", LRU_CACHE_CAPACITY="")
    set_now = apply_worker_env(env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's
    assert "LRU_CACHE_CAPACITY" not in env  # empty: the library's own default
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
    assert "OMP_WAIT_POLICY" not in set_now


def test_the_serve_command_does_not_import_torch_before_setting_them():
    code = ("import sys\nfrom duplexkv.cli import build_parser\n"
            "build_parser()[0].parse_args(['serve', 'tiny'])\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_hand_started_worker_sets_the_caps(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in WORKER_ENV_DEFAULTS}
    env.update(OMP_WAIT_POLICY="PASSIVE")  # one set by the user: kept, not logged as set
    p = start("worker", [sys.executable, "-m", "duplexkv.cli",
                         *worker_args(str(tiny_model_dir), None, "--dtype", "float32", *ARGS)],
              tmp_path, env)
    try:
        wait_ready([p], 120)
        line = next(x for x in p.log.read_text().splitlines()
                    if "environment defaults set" in x)
        assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY=256" in line and "LRU_CACHE_CAPACITY=256" in line
        assert "OMP_WAIT_POLICY" not in line
    finally:
        p.stop()
