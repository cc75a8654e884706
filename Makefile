# The two commands of the README's quick start: `make demo` and `make test`.
# Both set up a virtual environment first (torch pinned to its CPU build by constraints.txt).

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/elasticpipe demo

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q

bench: setup
	$(PY) bench/overhead.py
	$(PY) bench/planner.py
	$(PY) bench/straggler.py

# On a CUDA machine: the cuda tests and bench/gpu.py, in under 10 minutes (docs/gpu.md).
gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) .venv-gpu .pytest_cache .mypy_cache .ruff_cache .hypothesis
