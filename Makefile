# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use, installs torch==2.13.0 (CPU) first, then duplexkv and NIXL.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/duplexkv demo

test: install
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
