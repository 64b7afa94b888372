#!/usr/bin/env bash
# The GPU checks the open issues still owe, in priority order, in device calls of at most
# 10 minutes each (run from the repo root there; pytest/hypothesis wheels carried in .whl/):
#   bash benchmarks/gpu_checks.sh one    # nvidia-h200: speed (issue 5) and the GPU test suite
#   bash benchmarks/gpu_checks.sh tp     # nvidia-h200-x2: tensor parallelism (issue 6), 0.6B and 8B
# An engine start on a fresh machine takes 25-35 s (layer compile, kernel warm-up, 19 graph
# captures); Triton's and inductor's caches make later starts in the same call faster. Logs go
# to $OUT; keep the number of files there small (the device returns a limited count).
set -u
OUT=${OUT:-/tmp/minivllm-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 MINIVLLM_LOG_LEVEL=INFO NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
LOGS=/tmp/minivllm-logs
mkdir -p "$LOGS"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "   exit $? in $(( $(date +%s) - t0 )) s"
  grep -E "tok/s|started|passed|failed|FAILED|agreement|Error" "$LOGS/$name.log" | tail -8
}
case "${1:-one}" in
one)
  # 1. Where the throughput run's time goes, step by step (issue 5), and the single stream.
  step bench 100 python3 -m minivllm bench --shape qwen3-0.6b --json "$OUT/bench.json" \
    --step-times "$OUT/steps.json" --trace /tmp/trace.json && gzip -c /tmp/trace.json > "$OUT/trace.json.gz"
  MINIVLLM_COMPILE_PREFILL=1 step bench_compiled_prefill 100 python3 -m minivllm bench \
    --shape qwen3-0.6b --json "$OUT/bench_compiled_prefill.json"
  step latency 60 python3 -m minivllm bench --shape qwen3-0.6b --latency --json "$OUT/latency.json" \
    --trace /tmp/latency_trace.json && gzip -c /tmp/latency_trace.json > "$OUT/latency_trace.json.gz"
  # 2. The suite on CUDA: fast paths against eager, the sampler kernel for real, the engine.
  step tests 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" --tb=short \
    tests/test_gpu_graphs.py tests/test_sample_kernel.py tests/test_sampling.py tests/test_warmup.py \
    tests/test_engine.py tests/test_engine_bad_input.py tests/test_decode_graphs.py tests/test_model.py
  ;;
tp)
  # 3. TP=2 against TP=1 (teacher-forced agreement and engine greedy), then the benches at the
  #    0.6B and 8B shapes, TP=1 on GPU 0 and TP=2 on GPUs 0 and 1, in one call (<= 580 s).
  step tp_check 200 python3 benchmarks/tp_check.py --json "$OUT/tp_check.json"
  CUDA_VISIBLE_DEVICES=0 step bench_tp1 80 python3 -m minivllm bench --shape qwen3-0.6b \
    --json "$OUT/bench_tp1.json"
  step bench_tp2 90 python3 -m minivllm bench --shape qwen3-0.6b -tp 2 --json "$OUT/bench_tp2.json"
  CUDA_VISIBLE_DEVICES=0 step bench_8b_tp1 100 python3 -m minivllm bench --shape qwen3-8b \
    --json "$OUT/bench_8b_tp1.json"
  step bench_8b_tp2 110 python3 -m minivllm bench --shape qwen3-8b -tp 2 --json "$OUT/bench_8b_tp2.json"
  ;;
esac
cat "$LOGS"/*.log > "$OUT/logs.txt"
