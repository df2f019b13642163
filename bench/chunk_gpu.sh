#!/usr/bin/env bash
# One device call (about 4 minutes) for the chunked matrix-linear path (#40): the whole calls against the
# peers and the torch path (bench/chunk_check.py: outputs, final states and every gradient checked before
# the times), one profiled call of each (bench/profile_families.py: the kernel table), then the GPU tests
# of the chunk path. Each step has a time limit, so a slow one leaves the others their turn.
#
#     bash bench/chunk_gpu.sh [OUT_DIR]        # OUT_DIR: $OUT, else ./chunk_gpu_out; carry peers/
#     CORES=1 bash bench/chunk_gpu.sh          # chunk_check's sweep of the cores alone too (per-kernel
#                                              # GB/s at chunks 64/128/256; several more minutes)
#
# Logs: machine.log, chunk_check.log (+ chunk.md), profile.log (+ profile.md), gpu_tests.log.
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-chunk_gpu_out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv; git log --oneline -1; } \
    > "$out/machine.log" 2>&1
cores="--no-cores"
[ "${CORES:-0}" = 1 ] && cores=""
{ timeout 120 python3 bench/chunk_check.py $cores --out "$out"; echo "exit $?"; } > "$out/chunk_check.log" 2>&1
{ timeout 40 python3 bench/profile_families.py --only ssd,retnet --out "$out"; echo "exit $?"; } \
    > "$out/profile.log" 2>&1
{ timeout 75 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_chunk_kernels.py tests/test_chunked.py
  echo "exit $?"; } > "$out/gpu_tests.log" 2>&1
tail -n 3 "$out/gpu_tests.log"
grep -E "FAILED|ok:|exit" "$out/chunk_check.log" | cut -c1-400
