#!/usr/bin/env bash
# Everything that needs a GPU, as one script for a GPU machine lent for a few minutes: the CUDA
# tests (tests/shell/test_cuda.py and the CUDA tests of the file format and load_weights, FSDP2
# on NCCL with one rank), then the benchmarks that a GPU machine can measure and this project's
# 2-core CI machine cannot — save latency from the GPU (benchmarks/gpu.sh), resume onto the GPU
# and on the host (benchmarks/resume_speed.py), sharded saves with more ranks
# (benchmarks/sharded_save.py). Each part has a time limit; a part that fails or runs out of
# time leaves the parts after it to run, and everything printed is kept.
#
# Usage, from the repository root, on a machine with one GPU:
#
#     bash benchmarks/device_check.sh [RESULTS_DIR]      # default: results/device-<date>
#
# Environment: PYTHON (default python3: the one with torch and CUDA); wheels under WHEELS
# (default .whl/: the project's runtime dependencies missing there, e.g. cattrs) are installed
# into a temp dir first. The limits in seconds: TESTS_S (150), SAVE_S (100), RESUME_GPU_S (110),
# SHARDED_S (60), RESUME_HOST_S (60). The sizes: RESUME_MIB (256), SHARDED_MIB (256) with
# SHARDED_RANKS (4), and BENCH_REPEATS (3) rounds of each benchmark but the save latency's
# (REPEATS, SIZES: gpu.sh's). tests/test_benchmarks_smoke.py runs it on the CPU, tiny. RESULTS_DIR gets one log per part (and gpu.sh's files
# under save/); the JSON rows of each benchmark are beside its log.
set -uo pipefail

cd "$(dirname "$0")/.."
RESULTS=${1:-results/device-$(date +%Y%m%d-%H%M%S)}
PYTHON=${PYTHON:-python3}
mkdir -p "$RESULTS"
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    site=$(mktemp -d "${TMPDIR:-/tmp}/pitstop-site-XXXXXX")
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

part() {  # part NAME SECONDS COMMAND...: run it under a limit, its output into NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s, from $(date -u +%T))"
    timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.txt"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status"
}

{
    echo "date: $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null ||
        echo "nvidia-smi: unavailable"
    echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
    echo "disk: $(df -h "${TMPDIR:-/tmp}" | tail -1)"
    "$PYTHON" -c 'import platform, torch; print("python", platform.python_version(), "torch",
        torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} | tee "$RESULTS/machine.txt"

# The plugins installed beside that python are left out: only this project's config applies.
# Warnings are shown, not raised: that torch may be another release than the pinned one.
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 part cuda_tests "${TESTS_S:-150}" "$PYTHON" -m pytest \
    -p no:cacheprovider -W default -rA -q -o faulthandler_timeout=60 tests/shell/test_cuda.py \
    tests/shell/test_fileformat.py::test_cuda_tensors_are_written_from_the_device_and_load_on_the_cpu \
    tests/shell/test_weights.py::test_map_location_cuda_puts_the_weights_on_the_device

SIZES=${SIZES:-"1024 4096"} REPEATS=${REPEATS:-3} BUDGET_S=${SAVE_S:-100} PYTHON=$PYTHON \
    part save_latency "$((${SAVE_S:-100} + 20))" bash benchmarks/gpu.sh "$RESULTS/save"

part resume_gpu "${RESUME_GPU_S:-110}" "$PYTHON" benchmarks/resume_speed.py --device cuda \
    --sizes-mib "${RESUME_MIB:-256}" --repeats "${BENCH_REPEATS:-3}" --warmups 0 \
    --json "$RESULTS/resume_gpu.json"

part sharded_save "${SHARDED_S:-60}" "$PYTHON" benchmarks/sharded_save.py \
    --ranks "${SHARDED_RANKS:-4}" --mib "${SHARDED_MIB:-256}" --repeats "${BENCH_REPEATS:-3}" \
    --json "$RESULTS/sharded_save.json"

part resume_host "${RESUME_HOST_S:-60}" "$PYTHON" benchmarks/resume_speed.py \
    --sizes-mib "${RESUME_MIB:-256}" --repeats "${BENCH_REPEATS:-3}" --warmups 0 \
    --json "$RESULTS/resume_host.json"
echo "results in $RESULTS"
