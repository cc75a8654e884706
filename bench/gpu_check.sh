#!/usr/bin/env bash
# The GPU check in one command (`make gpu-check`): finds or installs a CUDA torch and the
# runtime dependencies, runs `pytest -m cuda` and bench/gpu.py, within GPU_CHECK_BUDGET_S
# (default 570 s: under 10 minutes with the install). Exit status: 0 all passed, 2 no CUDA,
# else the first failure's.
#
# Which Python (see docs/gpu.md):
# * GPU_PYTHON, if set, is used as it is (it must import a torch that sees CUDA);
# * else the first of .venv-gpu/bin/python, python3 whose torch sees CUDA (a GPU image's
#   preinstalled torch: used as is, never replaced; missing runtime and test dependencies
#   are pip-installed into that Python's environment);
# * else .venv-gpu is created and `pip install -c constraints.txt -e ".[dev]"` runs in it:
#   constraints.txt pins torch==2.13.0, which from PyPI on Linux x86_64 is the CUDA build
#   (on the CPU machines pip's config points at a local CPU wheel instead). TORCH_INDEX_URL
#   picks another wheel index (e.g. https://download.pytorch.org/whl/cu128). Needs network.
# The package itself is not installed: PYTHONPATH is the checkout (elasticpipe/ links the
# service folders), which the stage processes LocalCluster starts inherit.
# A GPU machine with no network: GPU_WHEELS names a folder of wheels (pip download
# --only-binary=:all: of the dependencies below, for that machine's Python), installed from
# with --no-index. matplotlib is left out: neither the CUDA tests nor bench/gpu.py draw.
set -uo pipefail
if [ -n "${GPU_WHEELS:-}" ]; then  # (a path relative to where it was given)
    GPU_WHEELS=$(cd "$GPU_WHEELS" && pwd) || exit 1
fi
cd "$(dirname "$0")/.."
root=$PWD
budget=${GPU_CHECK_BUDGET_S:-570}
deadline=$((SECONDS + budget))
left() { echo $((deadline - SECONDS > 10 ? deadline - SECONDS : 10)); }
sees_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
needs=(grpc grpc_health grpc_status grpc_reflection cryptography google.protobuf msgpack blake3
       safetensors numpy structlog prometheus_client rich pytest pytest_timeout hypothesis)
offline=()
if [ -n "${GPU_WHEELS:-}" ]; then
    offline=(--no-index --find-links "$GPU_WHEELS")
fi
has_deps() { "$1" -c "import $(IFS=,; echo "${needs[*]}")" 2>/dev/null; }

dry=${GPU_CHECK_DRY_RUN:-}  # 1: check this script on a CPU machine (GPU_PYTHON required)
if [ -z "${GPU_PYTHON:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L fails); nothing to check" >&2
    exit 2
fi
py=""
if [ -n "${GPU_PYTHON:-}" ]; then
    py=$GPU_PYTHON
else
    for candidate in .venv-gpu/bin/python "$(command -v python3 || true)"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ] && sees_cuda "$candidate"; then
            py=$candidate
            break
        fi
    done
fi
if [ -z "$py" ]; then
    echo "gpu-check: no Python with a CUDA torch found; installing into .venv-gpu (torch from constraints.txt)"
    [ -x .venv-gpu/bin/python ] || python3 -m venv --system-site-packages .venv-gpu
    index=()
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        index=(--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple)
    fi
    .venv-gpu/bin/python -m pip install -q ${index[@]+"${index[@]}"} -c constraints.txt -e ".[dev]" \
        || exit 1
    py=.venv-gpu/bin/python
fi
if ! has_deps "$py"; then
    # Into the environment of the Python whose torch sees CUDA (a venv's own packages would
    # not be visible from a new venv). torch is not named: the CUDA torch there stays.
    echo "gpu-check: installing the runtime and test dependencies next to $py's torch"
    "$py" -m pip install -q ${offline[@]+"${offline[@]}"} "grpcio>=1.85.1" \
        "grpcio-health-checking>=1.85.1" "grpcio-status>=1.85.1" "grpcio-reflection>=1.85.1" \
        "cryptography>=42" "protobuf>=6.31,<8" "msgpack>=1.0" "blake3>=1.0" "safetensors>=0.4" \
        "numpy>=1.24" "structlog>=24.1" "prometheus-client>=0.20" "rich>=13" "pytest>=8" \
        "pytest-timeout>=2.3" "hypothesis>=6.100" \
        || exit 1
fi
if [ -z "$dry" ] && ! sees_cuda "$py"; then
    "$py" -c 'import torch; print(f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")'
    exit 2
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c 'import torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (dry run)"
print(f"gpu-check: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}")'

mapfile -t files < <(grep -rl --include='test_*.py' 'mark.cuda' tests | sort)
echo "gpu-check: pytest -m cuda ${files[*]}"
timeout "$(left)" "$py" -m pytest -q -p no:cacheprovider -m cuda "${files[@]}"
tests=$?
echo "gpu-check: bench/gpu.py --quick${dry:+ --dry-run-cpu}"
timeout "$(left)" "$py" bench/gpu.py --quick ${dry:+--dry-run-cpu}
bench=$?
echo "gpu-check: pytest exit $tests, bench exit $bench, $SECONDS s"
[ "$tests" -ne 0 ] && exit "$tests"
exit "$bench"
