#!/usr/bin/env bash
# The prepared calls for a lent GPU (issue 72), headline rows first, each one command under the device's
# 10-minute limit with its own timeouts, every report (JSON) and log under $OUT (at most 8 files come
# back per call). Run through the device tool, in order, as device time allows:
# (estimated time; at most, by its timeouts)
#   bash scripts/gpu_contact.sh 1  # tests; int4 weights, B = 1, 32k: Llama-2-7B then Llama-3.1-8B,
#                                  # dense vs SparQ                                           ~420 s (580)
#   bash scripts/gpu_contact.sh 2  # Llama-3.1-8B 32k, B = 16 then 8: dense, SparQ, self-speculation  ~420-590 s (590)
#   bash scripts/gpu_contact.sh 3  # bf16 B = 1, --fixed-linears: Llama-2-7B 32k + 16k, Llama-3.1-8B   ~330 s (480)
#   bash scripts/gpu_contact.sh 4  # serving: Llama-3.1-8B shape, 16 clients, 16k prompts, 256 new tokens,
#                                  # SparQ then dense (4a / 4b: one server each, if a warm-up
#                                  # takes over ~190 s)                                        ~450-590 s (590)
#   bash scripts/gpu_contact.sh 5  # one layer's attention op: Table 4, B = 1 at 8k-128k, quantized cache  ~75 s (120)
#   bash scripts/gpu_contact.sh 6  # Llama-2-7B 16k, B = 4: dense, SparQ, self-speculation      ~340 s (480)
#   bash scripts/gpu_contact.sh 7  # the server over tensor parallel: torchrun, one rank per GPU lent
#                                  # (NCCL; gloo in the smoke), call 4's load with SparQ            ~300 s (590)
# A 15-minute contact (a fresh machine starts in ~30 s) runs 1 then 5; the next, 2 (then 5 if not run);
# then 3 + 6, then 4 (or 4a and 4b).
# Estimates from the contacts so far (H200, cold caches): the tests 45-65 s (70 of them); the
# attention section 53-69 s; gpu_check's start (imports, the 8 GiB read-rate check) ~10 s; a
# model's random weights ~5 s (quantizing them on the device: ~10 s, unmeasured); one policy's
# compile and capture of a model's decode step 60-90 s (dense 62-90, SparQ 58-97, int8 weights ~60
# each), and a second context of one command reuses them (0-1 s); self-speculation compiles a
# draft step and a verify pass of its own (~2 x 80 s, unmeasured); B = 8 after B = 16 should reuse
# their graphs (the batch is a dynamic dimension past 1: unmeasured). Fifth contact: the first call
# of its layout (tests, attention, both models' e2e) took 532 s. serve.py's warm-up compiles one
# step per row bucket (1, 2, 4, 8, 16) at two live lengths, never timed on a GPU: the estimate for
# call 4 is a guess (150-250 s a server), hence 4a / 4b. serve.py prefills a prompt in eager
# 128-token pieces (engine.PREFILL_CHUNK), so at 16k prompts and 256 new tokens the prefill takes most
# of a request's time and serve-load's tokens/s (generated tokens over wall time) understates the
# decode steps' ratio: read its ITL beside it.
# Each gpu_check command stops starting rows at its --budget-s (the third number below), so that
# the row in flight ends inside its timeout; its JSON is rewritten after every row.
# GPU_CONTACT_SMOKE=1 runs every call on this machine's CPU at tiny scale (gpu_check --device cpu
# --compile eager --steps 2 in the Triton interpreter; serve.py with smollm2-shaped random weights,
# eager, 2 clients, 64-token prompts): the same flags, so that a typo costs no device time.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu}
PY=${PYTHON:-python3}
SMOKE=${GPU_CONTACT_SMOKE:-0}
mkdir -p "$OUT"
if [ "$SMOKE" = 1 ]; then
    export TRITON_INTERPRET=1
    SMOKE_ARGS=(--device cpu --compile eager --steps 2)
    SHAPE=smollm2  # token ids up to 30000 (bench serve-load's): the tiny shape's 256 ids are too few
    CLIENTS=2 PROMPT=64 NEW=8 DURATION=3 SERVE_ARGS=(--device cpu --no-compile)
    RANKS=2  # tensor parallel over two CPU processes (gloo)
else
    SMOKE_ARGS=()
    SHAPE=llama-3.1-8b
    CLIENTS=16 PROMPT=16384 NEW=256 DURATION=45 SERVE_ARGS=()
    RANKS=$(nvidia-smi -L 2>/dev/null | wc -l)  # one rank per GPU lent (NCCL)
fi
LAUNCH=("$PY")  # how serve() starts serve.py: call 7 puts torchrun in front
SPARQ=(--sparq-r 32 --sparq-k 128)  # gpu_check's SparQ (r = 32, k = 128)

device() {  # the device line at the top of a call's first log
    if [ "$SMOKE" = 1 ]; then echo "smoke: $(uname -m) CPU, GPU_CONTACT_SMOKE=1" >> "$OUT/$1.log"
    else nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$OUT/$1.log" 2>&1; fi
}

check() {  # name, timeout s, budget s (no new row after it), gpu_check arguments...
    local name=$1 limit=$2 budget=$3
    shift 3
    timeout "$limit" "$PY" -m bench.gpu_check "$@" ${SMOKE_ARGS[@]+"${SMOKE_ARGS[@]}"} --budget-s "$budget" --json "$OUT/$name.json" \
        >> "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $SECONDS s"
}

serve() {  # name, timeout s, serve.py flags...: a server of random weights, then bench serve-load against it
    # The server is started here rather than by serve-load's --server-args: its log (warm-up, errors)
    # then lands in $OUT/<name>.log, where serve-load keeps a server's stderr in a pipe it never reads.
    local name=$1 limit=$2
    shift 2
    local log="$OUT/$name.log" start=$SECONDS url="" load=$((DURATION + 60))
    "${LAUNCH[@]}" serve.py --random-weights "$SHAPE" --port 0 --max-batch-size "$CLIENTS" \
        --max-seq-length $((PROMPT + NEW + 64)) ${SERVE_ARGS[@]+"${SERVE_ARGS[@]}"} "$@" >> "$log" 2>&1 &
    local server=$!
    while [ -z "$url" ] && kill -0 "$server" 2>/dev/null && [ $((SECONDS - start)) -lt $((limit - load)) ]; do
        sleep 2
        url=$(sed -n 's/.*listening on \(http[^ ]*\).*/\1/p' "$log" | tail -n 1)
    done
    if [ -n "$url" ]; then
        echo "$name: serve.py listening after $((SECONDS - start)) s" | tee -a "$log"
        timeout $((limit - (SECONDS - start))) "$PY" -m bench serve-load --url "$url" --clients "$CLIENTS" \
            --prompt-tokens "$PROMPT" --new-tokens "$NEW" --duration "$DURATION" --json "$OUT/$name.json" >> "$log" 2>&1
        echo "$name: serve-load exit $? after $SECONDS s"
    else
        echo "$name: serve.py not listening after $((SECONDS - start)) s (see $log)" | tee -a "$log"
    fi
    kill "$server" 2>/dev/null  # SIGTERM: serve.py ends what is in flight and exits
    for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -9 "$server" 2>/dev/null
    wait "$server" 2>/dev/null
}

case "${1:-1}" in
1)
    device tests
    check tests 110 100 --sections tests
    check e2e_int4 470 340 --sections e2e --weights int4 --models llama-2-7b,llama-3.1-8b --batches 1 --contexts 32768
    tail -n 40 "$OUT/e2e_int4.log"
    ;;
2)
    device e2e_batch
    check e2e_batch 590 450 --sections e2e --models llama-3.1-8b --batches 16,8 --contexts 32768 --speculate-k 2
    tail -n 45 "$OUT/e2e_batch.log"
    ;;
3)
    device e2e_fixed
    check e2e_fixed 480 380 --sections e2e --fixed-linears --models llama-2-7b,llama-3.1-8b --batches 1 \
        --contexts 32768,16384
    tail -n 40 "$OUT/e2e_fixed.log"
    ;;
4 | 4a | 4b)
    case $1 in 4b) device serve_dense ;; *) device serve_sparq ;; esac
    case $1 in
    4) serve serve_sparq 295 "${SPARQ[@]}"; serve serve_dense $((590 - SECONDS)) ;;
    4a) serve serve_sparq 590 "${SPARQ[@]}" ;;
    4b) serve serve_dense 590 ;;
    esac
    tail -n 12 "$OUT"/serve_*.log
    ;;
5)
    device attention
    check attention 120 100 --sections attention
    tail -n 60 "$OUT/attention.log"
    ;;
6)
    device e2e_l2_b4
    check e2e_l2_b4 480 330 --sections e2e --models llama-2-7b --batches 4 --contexts 16384 --speculate-k 2
    tail -n 40 "$OUT/e2e_l2_b4.log"
    ;;
7)
    device serve_tp
    LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc_per_node "${RANKS:-1}")
    serve serve_tp 590 "${SPARQ[@]}"
    tail -n 12 "$OUT/serve_tp.log"
    ;;
*)
    echo "gpu_contact.sh: give the call: 1, 2, 3, 4 (or 4a, 4b), 5, 6 or 7, not '$1'" >&2
    exit 2
    ;;
esac
