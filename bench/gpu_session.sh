#!/usr/bin/env bash
# Everything a session needs measured on a lent GPU machine, into one folder of logs.
#
#     PART=tests bash bench/gpu_session.sh [OUT_DIR]   # the GPU tests (about 5.5 minutes on an H100)
#     PART=bench bash bench/gpu_session.sh [OUT_DIR]   # the rest (about 9 minutes)
#     bash bench/gpu_session.sh [OUT_DIR]              # both; OUT_DIR: $OUT, else ./gpu_session_out
#
# The device tool allows 10 minutes a command, so a session runs the two parts as two calls.
# tests: pytest -m gpu on 14 workers (399 tests, 314 s on an H100 on 2026-11-25)
# bench: 1. the build of mamba-ssm's CUDA extension (CPU work, about 100 s)
#        2. bench/gpu_peers.py: ssmc (and its torch op) against accelerated-scan, fla and mamba-ssm
#           (peers/ as its docstring says)
#        3. bench/lanes_backward_probe.py (every variant) at the two Mamba-1 shapes, bench/block_scan.py,
#           bench/host_profile.py (host time of a small step; the scan's training step and torch op)
#        4. ncu of the lanes forward, the fused backward and the probe's variants (first launch of each)
#
# Logs: gpu_tests.log, peers.log, probes.log, host_profile.log, ncu.log, and the machine in machine.log.
# Each step has a time limit, so a slow step leaves the others their turn.
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_session_out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv; git log --oneline -1; } \
    > "$out/machine.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$out/machine.log" 2>&1

part="${PART:-all}"
if [ "$part" = tests ] || [ "$part" = all ]; then
  timeout 540 python3 -m pytest -m gpu -q -n 14 -p no:cacheprovider --durations=10 tests/ > "$out/gpu_tests.log" 2>&1
  echo "pytest exit $?" >> "$out/gpu_tests.log"
fi
[ "$part" = tests ] && exit 0
timeout 200 python3 bench/gpu_peers.py --build-mamba --quick --only mamba1_small --no-warp --no-variants \
    --out /tmp/gpu_session_prebuild > /tmp/gpu_session_prebuild.log 2>&1

{ date -u; timeout 200 python3 bench/gpu_peers.py --build-mamba --no-warp --no-variants --out /tmp/gpu_session_peers;
  cat /tmp/gpu_session_peers/gpu_peers.md; } > "$out/peers.log" 2>&1

{ date -u; timeout 120 python3 bench/lanes_backward_probe.py; echo "exit $?";
  timeout 90 python3 bench/lanes_backward_probe.py --batch 32 --dim 512 --length 192; echo "exit $?";
  timeout 60 python3 bench/block_scan.py --out /tmp/gpu_session_block_scan; echo "exit $?"; } > "$out/probes.log" 2>&1

{ timeout 100 python3 bench/host_profile.py; timeout 60 python3 bench/host_profile.py --scan; } \
    > "$out/host_profile.log" 2>&1

cat > /tmp/gpu_session_step.py <<'PY'
import numpy as np, torch, ssmc
from ssmc.examples import mamba1 as ex
x = ex.make_inputs(np.random.default_rng(0), 2048, batch=8, dim=1536, state=16)
x = {k: torch.tensor(v, device="cuda", dtype=torch.float32) for k, v in x.items()}
dy = torch.randn(8, 1536, 2048, device="cuda")
ssmc.compile(ex.SPEC, "cuda", layout=ex.LAYOUT)(**x)
ssmc.grad(ex.SPEC, "cuda", layout=ex.LAYOUT)(**x, grad_outputs=dy)
torch.cuda.synchronize()
PY
sections="--section SpeedOfLight --section WarpStateStats --section InstructionStats --section Occupancy
          --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
# shellcheck disable=SC2086
{ timeout 90 ncu --clock-control none $sections -k 'regex:mamba1_fused$|mamba1_fused_backward' -c 2 \
      python3 /tmp/gpu_session_step.py;
  timeout 120 ncu --clock-control none $sections -k mamba1_lanes_backward -c 7 \
      python3 bench/lanes_backward_probe.py; date -u; } > "$out/ncu.log" 2>&1
