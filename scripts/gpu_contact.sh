#!/usr/bin/env bash
# One prepared 10-minute command for a lent GPU (issue "The H100 figures"): the GPU check section by
# section, each with its own timeout and JSON, every report and log under $OUT (8 files at most come
# back). Run through the device tool as: bash scripts/gpu_contact.sh
# Sized from the third contact (H200, 2026-11-27, cold caches): tests 63 s, attention 50 s (now
# more: the select and quantized-cache rows), one model's e2e at one context 140-170 s (dense's
# compile 80-90 s, SparQ's 25-50). Contexts of one command share the caches sized for the largest,
# so 16k after 32k reuses the compiled steps (warm-up 0 s at the second contact); a command per
# context would recompile for each cache size. Fourth contact (H200, cold): tests 58 s, attention
# 59 s, Llama-2's two contexts 149 s, Llama-3's dense row alone 100 s (the 130 s limit took SparQ's).
# Fifth contact (H200, cold): the tests took over 63 s (70 now; 50 s warm), attention 69 s, Llama-2's
# two contexts 181 s, Llama-3's 183 s; the whole command 532 s.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/tests.log" 2>&1
check() {  # name, timeout s, gpu_check arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 -m bench.gpu_check "$@" --budget-s $((limit - 15)) --json "$OUT/$name.json" \
        >> "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $SECONDS s"
}
check tests 110 --sections tests
check attention 90 --sections attention
check e2e 200 --sections e2e --models llama-2-7b --batches 1 --contexts 32768,16384
check e2e_llama3 195 --sections e2e --models llama-3.1-8b --batches 1 --contexts 32768
tail -n 40 "$OUT/attention.log" "$OUT/e2e.log" "$OUT/e2e_llama3.log"
