#!/usr/bin/env bash
# Save latency with CUDA tensors: pitstop (pinned staging buffers, D2H on a side stream) vs
# torch.save vs DCP save / async_save (pinned, cached stager) vs the floors (one D2H copy_ into
# pinned buffers; write+fsync of the same bytes) — benchmarks/save_latency.py --device cuda.
#
# Usage, from the repository root, on a machine with one GPU (sized for one H100/H200):
#
#     bash benchmarks/gpu.sh [RESULTS_DIR]        # default: results/gpu-<date>
#
# Environment: PYTHON (default .venv/bin/python, else python3; torch with CUDA and pitstop
# importable — src/ is put on PYTHONPATH), SIZES (MiB, run in this order, default
# "1024 4096 8192"), REPEATS (default 5), BUDGET_S (default 290: the whole script stays under
# 5 minutes; a size that would start with under 30 s left is skipped, and a size still running
# when the budget ends is stopped — the sizes already done keep their results), WORK_DIR
# (where the checkpoints are written; default a temp dir on the disk under test — needs about
# 3x the largest size free; host RAM needs about 8x the largest size).
#
# Writes to RESULTS_DIR: machine.txt (GPU, CPU, disk, versions), save_latency_<MiB>.md (the
# tables as printed), save_latency_<MiB>.json (rows: system, mode, size_bytes, blocking_s,
# durable_s, peak_rss_extra_bytes, ...), save_latency_<MiB>.png when matplotlib is installed.
set -euo pipefail

cd "$(dirname "$0")/.."
RESULTS=${1:-results/gpu-$(date +%Y%m%d-%H%M%S)}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
SIZES=${SIZES:-"1024 4096 8192"}
REPEATS=${REPEATS:-5}
BUDGET_S=${BUDGET_S:-290}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RESULTS"
WORK=${WORK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/pitstop-gpu-XXXXXX")}
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" - <<'EOF' || { echo "gpu.sh: torch with CUDA is needed" >&2; exit 2; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
EOF

{
    echo "date: $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
        --format=csv 2>/dev/null || echo "nvidia-smi: unavailable"
    echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
    echo "RAM: $(free -g | awk '/Mem:/ {print $2 " GiB"}')"
    echo "disk under test: $(df -h "$WORK" | tail -1)"
    "$PYTHON" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)'
    echo "sizes (MiB): $SIZES; repeats: $REPEATS; budget: ${BUDGET_S}s"
} | tee "$RESULTS/machine.txt"

started=$SECONDS
for size in $SIZES; do
    left=$((BUDGET_S - (SECONDS - started)))
    if ((left < 30)); then
        echo "gpu.sh: ${size} MiB skipped: ${left}s left of the ${BUDGET_S}s budget" | tee -a "$RESULTS/machine.txt"
        continue
    fi
    echo "== ${size} MiB (at most ${left}s)"
    status=0
    timeout --signal=TERM --kill-after=5 "$left" "$PYTHON" benchmarks/save_latency.py \
        --device cuda --sizes-mib "$size" --repeats "$REPEATS" --dir "$WORK/run" \
        --json "$RESULTS/save_latency_${size}.json" --plot "$RESULTS/save_latency_${size}.png" \
        | tee "$RESULTS/save_latency_${size}.md" || status=$?
    rm -rf "$WORK/run"
    if ((status != 0)); then
        echo "gpu.sh: ${size} MiB stopped (exit ${status}); larger sizes skipped" | tee -a "$RESULTS/machine.txt"
        break
    fi
done
echo "results in $RESULTS"
