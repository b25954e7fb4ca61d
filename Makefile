# Two commands do all setup on a fresh machine: `make serve` and `make test`.
# Both create (or reuse) .venv. TORCH is what pip installs for torch (pip arguments, e.g. an index
# URL for a CPU-only or CUDA build); a torch already in .venv is kept (see README).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
CONFIG ?= configs/embedded.yaml
PORT   ?=

.PHONY: install serve test test-quick test-gpu lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(PY) serve_app.py --config $(CONFIG) $(if $(PORT),--port $(PORT))

test: $(VENV)/.installed
	$(PY) -m pytest -q

# Without the tests that need the Ray Serve app or a live Prometheus (marker `slow`).
test-quick: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

# The GPU tier: engine, Triton kernels at Mixtral shapes and one HTTP request on CUDA.
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
