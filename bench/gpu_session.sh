#!/usr/bin/env bash
# One device call: the peers harness over every family, then the GPU tests, logs into one folder.
#
#     bash bench/gpu_session.sh [OUT_DIR]              # both; OUT_DIR: $OUT, else ./gpu_session_out
#     PART=bench bash bench/gpu_session.sh [OUT_DIR]   # the harness alone
#     PART=tests bash bench/gpu_session.sh [OUT_DIR]   # pytest -m gpu alone (about 5 minutes)
#     FAMILIES="matrix rnn" ...                        # some families (default: all four)
#
# Carry the git-ignored peers/ (pip download --no-deps of mamba-ssm's sdist, fla-core, accelerated-scan,
# einops): bench/harness.py installs the wheels and builds mamba-ssm's CUDA extension from it. The
# device tool allows 10 minutes a command, so a whole session is three calls (H100, 2026-11-27):
#     PART=bench FAMILIES="diagonal attention rnn"     # about 7 minutes (the mamba-ssm build: 140 s)
#     PART=bench FAMILIES=matrix                       # about 4 minutes (the peers' Triton autotuning)
#     PART=tests
#
# Logs: machine.log, harness.log, harness-<family>.md (one table per family: copy it into
# bench/results/<date>-<device>-peers.md and the current rows into docs/performance.md), gpu_tests.log.
# Each step has a time limit, so a slow one leaves the others their turn.
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_session_out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv; git log --oneline -1; } \
    > "$out/machine.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$out/machine.log" 2>&1

part="${PART:-all}"
if [ "$part" = bench ] || [ "$part" = all ]; then
  for family in ${FAMILIES:-diagonal matrix attention rnn}; do
    # each family's time limit in seconds; the LSTM and GRU take seconds a call in ssmc, so no op rows
    case "$family" in
      diagonal) limit=280 flags="" ;; matrix) limit=300 flags="" ;; attention) limit=60 flags="" ;;
      *) limit=200 flags="--no-op" ;;
    esac
    { echo "== $family $(date -u +%H:%M:%S)"
      # shellcheck disable=SC2086
      timeout "$limit" python3 bench/harness.py --family "$family" $flags --out "$out/harness-$family.md"
      echo "exit $?"; } >> "$out/harness.log" 2>&1
  done
fi
if [ "$part" = tests ] || [ "$part" = all ]; then
  timeout 540 python3 -m pytest -m gpu -q -n 14 -p no:cacheprovider --durations=10 tests/ > "$out/gpu_tests.log" 2>&1
  echo "pytest exit $?" >> "$out/gpu_tests.log"
fi
