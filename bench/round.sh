#!/usr/bin/env bash
# One device call for the new kernel families: GPU tests, then their check-and-time scripts, logs into $OUT.
#
#     bash bench/round.sh                                   # every GPU test (about 8 minutes), then the scripts
#     TESTS="tests/test_chunk_kernels.py" BENCH=chunk bash bench/round.sh
#     BENCH="flash chunk persistent decode"                 # bench/<name>_check.py, each --out $OUT; BENCH= runs none
#
# Carry the git-ignored peers/ (bench/chunk_check.py loads mamba-ssm and fla from it). The tests stop with
# SIGINT at TEST_S seconds, so pytest still prints the failures it has seen (a plain timeout kills it first).
set -u
out="${OUT:-round_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name --format=csv; git log --oneline -1; } > "$out/machine.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$out/machine.log" 2>&1
# shellcheck disable=SC2086
timeout -s INT "${TEST_S:-400}" python3 -m pytest -m gpu -q -n "${WORKERS:-10}" -p no:cacheprovider \
  --hypothesis-profile=no-shrink -rf --durations=15 ${TESTS:-tests/} > "$out/gpu_tests.txt" 2>&1
echo "pytest exit $?" >> "$out/gpu_tests.txt"
for s in ${BENCH-flash chunk persistent}; do
  timeout "${BENCH_S:-90}" python3 "bench/${s}_check.py" --out "$out" > "$out/${s}.log" 2>&1; echo "exit $?" >> "$out/${s}.log"
done
grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_tests.txt" | tail -30
for s in ${BENCH-flash chunk persistent}; do tail -20 "$out/${s}.log"; done
