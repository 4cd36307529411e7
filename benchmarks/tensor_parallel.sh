#!/usr/bin/env bash
# Tensor parallelism on a machine with two GPUs: the TP=2 parity test (multiproc and Ray against
# one GPU, Llama-3.1-8B random weights), then workload (c) of `pagoda bench throughput` at TP=2
# (multiproc), TP=1 and TP=2 (Ray). Results go to $RESULTS (default benchmarks/results); a table
# of output tokens/s comes last. Run from the project root: benchmarks/tensor_parallel.sh
set -u
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
RESULTS=${RESULTS:-benchmarks/results}
BUDGET_S=${BUDGET_S:-3600}  # stop starting new steps once this much time has passed
commit=${PAGODA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$RESULTS"
t0=$(date +%s)
cap() { local left=$((BUDGET_S - ($(date +%s) - t0))); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
say() { echo "[tensor_parallel +$(($(date +%s) - t0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "$(cap 300)" python3 -m pytest -x -q -s -p no:cacheprovider \
  tests/gpu/test_tensor_parallel_gpu.py > "$RESULTS/pytest-tensor-parallel-gpu-$commit.txt" 2>&1
grep -E "identical|passed|failed|Error" "$RESULTS/pytest-tensor-parallel-gpu-$commit.txt" | tail -6
say "parity tests done"
for run in "2 multiproc" "1 uniproc" "2 ray"; do
  set -- $run
  out="$RESULTS/throughput-c-llama-3.1-8b-h200-tp$1-$2-$commit.json"
  timeout "$(cap 180)" python3 -m pagoda.entrypoints.cli bench throughput --workload c --skip-hf \
    --tensor-parallel-size "$1" --executor "$2" --output-json "$out" > "${out%.json}.log" 2>&1
  tail -3 "${out%.json}.log"
  say "workload c at TP=$1 ($2) done"
done
python3 - "$RESULTS" "$commit" <<'PY'
import glob, json, os, sys
rows = []
for f in sorted(glob.glob(f"{sys.argv[1]}/throughput-c-*-tp*-{sys.argv[2]}.json")):
    d = json.load(open(f))
    r, dec = d["results"]["pagoda"], d.get("decode_at_full_batch") or {}
    rows.append((os.path.basename(f), r["output_tokens_per_s"], r["elapsed_s"], dec.get("step_ms")))
print("| run | output tok/s | elapsed s | decode step ms (batch 256) |")
print("|---|---|---|---|")
for name, tps, el, step in rows:
    print(f"| {name} | {tps} | {el} | {step} |")
by = {n.split("-tp")[1].split("-")[0] + n.split("-tp")[1].split("-")[1]: t for n, t, _, _ in rows}
if "1uniproc" in by and "2multiproc" in by:
    print(f"TP=2 multiproc over TP=1: {by['2multiproc'] / by['1uniproc']:.2f}x")
if "2ray" in by and "2multiproc" in by:
    print(f"Ray over multiproc at TP=2: {by['2ray'] / by['2multiproc']:.3f}")
PY
