#!/usr/bin/env bash
# The generation figures on a lent GPU, as one script: device time is short (15 minutes a
# session, start-up included), so every run is prepared and rehearsed on CPU first, and each part
# is bounded so that a slow one cannot take the others' time.
#
#   bash bench/gpu_session.sh OUT_DIR [PART ...]
#
# Needs the engine's wheels in .whl/ (docs/benchmarks.md, "On a GPU": the GPU image lacks
# sglang-jax and has other versions of its dependencies), installed here into /tmp/site.
# Parts (by default "1.5b", 400 s at most; times measured on an H200, 2026-11-29):
#   1.5b     bench.generate_bench at the Qwen2.5-1.5B shape, full depth, decode_steps=16, 64
#            and 256 rows, a profiler trace of a 64-row call, then PyTorch compiled on the
#            64-row batch (took 201 s with Triton's GEMMs off, when the engine compiled one decode
#            chunk per batch size; its static chunks compile 6 a batch size: 3 draws x 2 walks)
#   graphs   the 64-row batch, decode_steps=16, with XLA's CUDA graphs taking in while loops
#            and conditionals (GRAPHS below): the engine's start-up alone took over 90 s (since
#            2026-11-30 a chunk's only such loop is its steps: the prefills' walks remain)
#   fixed    bench.step_cost_bench (a nearly free model: the fixed cost of a step), 1 and 16
#            decode steps per dispatch, then the same under GRAPHS (the first took over 50 s)
#   1.5b-one the 64-row batch with one decode step per dispatch, a profiler trace
#   3b       the Qwen2.5-3B shape, full depth, decode_steps=16, 64 rows
# Everything printed goes to OUT_DIR/log too; the traces are copied to OUT_DIR.
set -u -o pipefail
out=${1:?usage: bash bench/gpu_session.sh OUT_DIR [1.5b 3b graphs fixed 1.5b-one]}
shift
parts=${*:-1.5b}
mkdir -p "$out"

# No persistent compilation cache: on an H200 with jax 0.11.2 (2026-11-29) XLA's GEMM autotuner
# crashed every process that had one (CUDA_ERROR_ILLEGAL_INSTRUCTION while it timed Triton
# configurations of the engine's bf16 extend forward; jax then also keeps XLA's per-fusion
# autotune results), where a process without one went past that point. Should it crash anyway,
# run with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (cuBLAS runs every dot), as that run did.
export XLA_FLAGS=${XLA_FLAGS:-}
# XLA's default command buffer kinds plus while loops and conditionals: a loop of data-dependent
# trip count is otherwise driven from the host, which reads its predicate back after every
# iteration (896 reads in a 16-step chunk of the 1.5B shape on 2026-11-29, from the paged
# attention's walks over KV chunks; a chunk's walks have had a static trip count since
# 2026-11-30, the prefill forwards' still have none).
GRAPHS="$XLA_FLAGS --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"

run() { # run LIMIT_SECONDS COMMAND...: bounded and timed; a failure does not stop the parts after it
    local limit=$1
    shift
    echo "== $(date +%T) (at most ${limit} s) $*"
    timeout --kill-after=5 "$limit" "$@"
    local status=$?
    echo "== $(date +%T) exit $status"
}

main() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
    # The engine asserts that its device's platform equals JAX_PLATFORMS when that is set.
    unset JAX_PLATFORMS
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    python3 -c 'import jax, torch; print("jax", jax.__version__, jax.devices(), "torch", torch.__version__)'
    echo "XLA_FLAGS=$XLA_FLAGS"

    local generate=(python3 -m bench.generate_bench --dummy-weights --repeats 2 --shapes 1.5b --layers 28)
    for part in $parts; do
        case $part in
        1.5b)
            run 400 "${generate[@]}" --variants steps:16 --batches decode,decode256 --trace /tmp/traces \
                --torch-python python3 --torch-modes compiled
            ;;
        graphs) run 180 env XLA_FLAGS="$GRAPHS" "${generate[@]}" --variants steps:16 --batches decode ;;
        fixed)
            run 90 python3 -m bench.step_cost_bench --decode-steps 1 16 --repeats 1
            run 90 env XLA_FLAGS="$GRAPHS" python3 -m bench.step_cost_bench --decode-steps 1 16 --repeats 1
            ;;
        1.5b-one) run 150 "${generate[@]}" --variants new --batches decode --trace /tmp/traces ;;
        3b) run 240 "${generate[@]/1.5b/3b}" --layers 36 --variants steps:16 --batches decode ;;
        *) echo "unknown part $part" ;;
        esac
    done
    local count=0
    for trace in $(find /tmp/traces -name '*perfetto_trace.json.gz' 2>/dev/null); do
        count=$((count + 1))
        local variant=${trace#/tmp/traces/}
        cp "$trace" "$out/trace-$count-${variant%%/*}.json.gz"
    done
    ls -la "$out"
}

main 2>&1 | tee -a "$out/log"
