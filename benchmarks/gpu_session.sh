#!/usr/bin/env bash
# One call on a lent GPU (the device allows 10 minutes a call, 15 a session): the prepared GPU
# checks in order of what they decide, each under its own time limit so that a slow compile
# costs only its own part. Results land under $OUT; run from the repository root:
#
#   OUT=/some/dir [CAL_S=0] [BENCH_S=360] [PROBE_S=150] [SUSTAIN_S=0] [CP_S=0] bash benchmarks/gpu_session.sh [gpt2-124m|llama3.2-1b] [tight|loose]
#
# CAL_S, BENCH_S, PROBE_S, SUSTAIN_S and CP_S bound the parts in seconds (0 skips a part). Each of bench_gpu's runs is
# a process of its own (a run that runs out of memory leaves the next one its GPU); on one H200,
# GPT-2 124M's ten runs took 350 s, and Llama 3.2 1B's joint plan compiled for 275 s.
#
# 0. (CAL_S > 0) coplan calibrate on this GPU (benchmarks/data/gpu_calibrate.py): a profile that
#    prices each of the runs below a second time (calibration.json, profile_cuda.json).
# 1. bench_gpu.py all for one model at one batch: eager, torch.compile, torch.compile with the
#    joint plan's activation budget, coplan's joint and sequential plans (bench_gpu.json). At the
#    tight batch every run takes the whole batch in one microbatch, held to the H100's 80 GiB on a
#    larger GPU, so a baseline that needs more is recorded as out of memory (benchmarks/gpu_all.py).
# 2. The step probe: per-kernel-class time, GPU idle time and host issue time of a LLaMA-3 8B-shaped
#    stack, eager and with compiled blocks, beside coplan's prices (the eager-step gap).
# 3. (SUSTAIN_S > 0) The sustained-load probe: bf16 GEMMs back to back for SUSTAIN_S - 15 seconds,
#    the GEMM rate per half second beside nvidia-smi's SM clock, power and temperature: whether a
#    short measurement's GEMM rate holds under minutes of load (sustained.json).
# 4. (CP_S > 0) The ring-attention probe: one rank's flash-attention calls and fp32 merges of
#    PyTorch's context parallelism at 262,144 tokens over CP 8, beside coplan's price of them
#    (cp_ring_probe.json): whether torchtitan's CP rows' excess is in the kernels or the ring.
# 5. Always (seconds): which ATen ops nn.RMSNorm dispatches to on this GPU, fused or composite, for
#    the runner's fp32 norm under autocast, bf16 and mixed dtypes (rmsnorm_dispatch.json): whether
#    the coplan preset's fused_rmsnorm is what ran.
set -u
OUT="${OUT:?set OUT to the folder results go to}"
MODEL="${1:-gpt2-124m}"
BATCH="${2:-tight}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv > "$OUT/gpu.csv" 2>&1
CAL_S="${CAL_S:-0}"
BENCH_S="${BENCH_S:-360}"
PROBE_S="${PROBE_S:-150}"
PROFILE=()
if [ "$CAL_S" -gt 0 ]; then
    timeout "$CAL_S" "$PY" benchmarks/data/gpu_calibrate.py "$OUT/profile_cuda.json" \
        > "$OUT/calibration.json" 2> "$OUT/calibration.log"
    echo "calibrate exit $?" >> "$OUT/calibration.log"
    tail -n 3 "$OUT/calibration.log"
    [ -s "$OUT/profile_cuda.json" ] && PROFILE=(--profile "$OUT/profile_cuda.json")
fi
if [ "$BENCH_S" -gt 0 ]; then
    # Inductor's autotuning prints a table per GEMM: the log keeps them, the reply does not
    timeout "$BENCH_S" "$PY" benchmarks/bench_gpu.py all --model "$MODEL" --batches "$BATCH" --out "$OUT" \
        "${PROFILE[@]}" > "$OUT/bench_gpu.log" 2>&1
    echo "bench_gpu exit $?" >> "$OUT/bench_gpu.log"
    grep -v -i "autotune\|triton_mm\|warnings.warn\|TritonTemplateCaller\|^  mm\|strides:\|dtypes:\|^{" \
        "$OUT/bench_gpu.log" | tail -n 30
fi
if [ "$PROBE_S" -gt 0 ]; then
    (cd benchmarks/data && timeout "$PROBE_S" "$PY" h100_step_probe.py --layers 4 --seq 4096 \
        > "$OUT/step_probe.json" 2> "$OUT/step_probe.txt")
    echo "step probe exit $?" >> "$OUT/step_probe.txt"
    tail -n 14 "$OUT/step_probe.txt"
fi
SUSTAIN_S="${SUSTAIN_S:-0}"
if [ "$SUSTAIN_S" -gt 15 ]; then
    timeout "$SUSTAIN_S" "$PY" benchmarks/data/gpu_sustained_probe.py --seconds "$((SUSTAIN_S - 15))" \
        > "$OUT/sustained.json" 2> "$OUT/sustained.txt"
    echo "sustained probe exit $?" >> "$OUT/sustained.txt"
    tail -n 2 "$OUT/sustained.txt"
fi
CP_S="${CP_S:-0}"
if [ "$CP_S" -gt 0 ]; then
    (cd benchmarks/data && timeout "$CP_S" "$PY" cp_ring_probe.py --seq 262144 --cp 8 \
        > "$OUT/cp_ring_probe.json" 2> "$OUT/cp_ring_probe.txt")
    echo "cp ring probe exit $?" >> "$OUT/cp_ring_probe.txt"
    tail -n 2 "$OUT/cp_ring_probe.txt"
fi
timeout 60 "$PY" benchmarks/data/rmsnorm_dispatch.py > "$OUT/rmsnorm_dispatch.json" 2> "$OUT/rmsnorm_dispatch.log"
echo "rmsnorm dispatch exit $?" >> "$OUT/rmsnorm_dispatch.log"
grep -o '"fused": [a-z]*' "$OUT/rmsnorm_dispatch.json" | tr '\n' ' '; echo
