# The two commands of the README's quick start: `make demo` and `make test`.
# Both set up a virtual environment first (constraints.txt pins every package the `dev`
# extra resolves to, torch to its CPU build).

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-numerics lint bench gpu-check clean

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

# Byte-compiled first: the suite starts hundreds of processes, and where the environment
# sets PYTHONDONTWRITEBYTECODE each would compile the project's modules again (~0.5 s each).
test: lint
	$(PY) -m compileall -q elasticpipe stage_server client coordinator tests bench > /dev/null
	$(VENV)/bin/pytest -q

# The tests marked `numerics` (comparisons with a reference: precision, fp16/bf16, Hugging
# Face, transparency, recomputation, several tensors) again under other CPU kernels and
# thread counts, as CAPABILITY:THREADS (ATEN_CPU_CAPABILITY, OMP_NUM_THREADS; "own" leaves
# the machine's kernels). `make test` ran them with the machine's own kernels and torch's
# default threads; this run adds the scalar kernels with one thread: other kernels and
# another thread count than that run's on any x86-64 CPU (1.7 to 4.8 minutes, measured on 2
# shared cores). More runs, e.g. `make test-numerics NUMERICS_RUNS="default:1 avx2:2 own:1"`.
NUMERICS_RUNS ?= default:1

test-numerics: setup
	$(PY) -m compileall -q elasticpipe stage_server client coordinator tests > /dev/null
	@set -e; for run in $(NUMERICS_RUNS); do \
	  cap=$${run%%:*}; threads=$${run##*:}; \
	  echo "test-numerics: ATEN_CPU_CAPABILITY=$$cap OMP_NUM_THREADS=$$threads"; \
	  if [ "$$cap" = own ]; then \
	    env -u ATEN_CPU_CAPABILITY OMP_NUM_THREADS=$$threads $(VENV)/bin/pytest -q -m numerics; \
	  else \
	    ATEN_CPU_CAPABILITY=$$cap OMP_NUM_THREADS=$$threads $(VENV)/bin/pytest -q -m numerics; \
	  fi; \
	done

bench: setup
	$(PY) bench/overhead.py
	$(PY) bench/planner.py
	$(PY) bench/straggler.py

# On a CUDA machine: the cuda tests and bench/gpu.py, in under 10 minutes (docs/gpu.md).
gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) .venv-gpu .pytest_cache .mypy_cache .ruff_cache .hypothesis
