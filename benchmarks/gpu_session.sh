#!/usr/bin/env bash
# One call on a lent GPU (the device allows 10 minutes a call, 15 a session): the prepared GPU
# checks in order of what they decide, each under its own time limit so that a slow compile
# costs only its own part. Results land under $OUT; run from the repository root:
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh [gpt2-124m|llama3.2-1b] [tight|loose]
#
# 1. bench_gpu.py all for one model at one batch: eager, torch.compile, torch.compile with the
#    joint plan's activation budget, coplan's joint and sequential plans (bench_gpu.json).
# 2. The step probe: per-kernel-class time, GPU idle time and host issue time of a LLaMA-3 8B-shaped
#    stack, eager and with compiled blocks, beside coplan's prices (the eager-step gap).
set -u
OUT="${OUT:?set OUT to the folder results go to}"
MODEL="${1:-gpt2-124m}"
BATCH="${2:-tight}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv > "$OUT/gpu.csv" 2>&1
timeout 360 "$PY" benchmarks/bench_gpu.py all --model "$MODEL" --batches "$BATCH" --out "$OUT" \
    > "$OUT/bench_gpu.log" 2>&1
echo "bench_gpu exit $?" >> "$OUT/bench_gpu.log"
(cd benchmarks/data && timeout 150 "$PY" h100_step_probe.py --layers 4 --seq 4096 \
    > "$OUT/step_probe.json" 2> "$OUT/step_probe.txt")
echo "step probe exit $?" >> "$OUT/step_probe.txt"
tail -n 20 "$OUT/bench_gpu.log"
tail -n 14 "$OUT/step_probe.txt"
