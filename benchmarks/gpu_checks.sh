#!/usr/bin/env bash
# The GPU checks the open issues still owe, in one device call each of at most 10 minutes (run
# from the repo root there; pytest/hypothesis wheels carried in .whl/, which
# benchmarks/gpu_wheels.sh downloads; compile caches carried in dbg/cache/ when an earlier call
# returned them, see below):
#   bash benchmarks/gpu_checks.sh speed  # nvidia-h200: issue 5's figures and the GPU test suite
#   bash benchmarks/gpu_checks.sh figures  # nvidia-h200: issue 5's two figures only
#   bash benchmarks/gpu_checks.sh moe  # nvidia-h200: test_moe.py's bf16 GPU tests, then
#       throughput and single stream at the Qwen3-30B-A3B shape (mixture of experts)
#   bash benchmarks/gpu_checks.sh moe_profile  # nvidia-h200: that shape's traced decode steps,
#       single stream and ~256 sequences, summarized by kernel
#   bash benchmarks/gpu_checks.sh lora  # nvidia-h200 or nvidia-h100-x1: the LoRA engine's GPU tests
#       (decode graphs and compiled forward with adapters against the eager LoRA engine), then
#       plain sampling's tok/s with LoRA enabled and without (LORA_TESTS=0: the speed only;
#       OLD=dir: that tree's LoRA engine too)
#   bash benchmarks/gpu_checks.sh load_weights  # nvidia-h200 or nvidia-h100-x1: LLM.load_weights
#       on a compiled engine with decode graphs (no recapture) against a fresh engine, bf16 and fp32
#   bash benchmarks/gpu_checks.sh sleep  # nvidia-h200 or nvidia-h100-x1: LLM.sleep / wake_up on a
#       compiled engine with decode graphs (memory freed, graphs captured again, same tokens),
#       with a draft model too
#   bash benchmarks/gpu_checks.sh embeds  # nvidia-h200 or nvidia-h100-x1: the pooling engine and
#       prompt embeddings on the GPU (test_embed.py, test_prompt_embeds.py, test_decode_graphs.py)
#   bash benchmarks/gpu_checks.sh awq  # nvidia-h200 or nvidia-h100-x1: AWQ checkpoints' GPU tests
#   bash benchmarks/gpu_checks.sh fp8w  # nvidia-h200 or nvidia-h100-x1: block-fp8 weights kept in fp8
#       (the Triton AWQ GEMM in bf16/fp16, compiled and in a CUDA graph; the engine's graphs)
#   bash benchmarks/gpu_checks.sh moe_probe  # nvidia-h200 or nvidia-h100-x1: one sparse layer's
#       MoE MLP both ways (grouped GEMMs, Triton kernels) at 1-256 tokens (benchmarks/moe_probe.py)
#   bash benchmarks/gpu_checks.sh moe_launch  # nvidia-h200 or nvidia-h100-x1: the MoE kernels'
#       launch choices: align at 1-256 tokens, the expert GEMMs at 1-32 (moe_launch_probe.py;
#       OLD=dir: that tree's align kernel first)
#   bash benchmarks/gpu_checks.sh moe_kernel  # nvidia-h200 or nvidia-h100-x1: kernels/fused_moe.py
#       (MINIVLLM_MOE_KERNEL=triton, the experts as Triton kernels at <= 256 tokens a step): its
#       GPU tests, then that shape's single stream with and without, alternating, then the
#       throughput run with and without, while time is left (LAT_RUNS, TPUT_RUNS pick the runs,
#       each name ending in the MINIVLLM_MOE_KERNEL it runs: _triton or _kernel, _grouped or
#       _base, _auto, the default; MOE_KERNEL_TESTS=0 skips the tests)
#   bash benchmarks/gpu_checks.sh features  # nvidia-h200 or nvidia-h100-x1: each sampling feature's
#       tok/s beside plain sampling's on one engine (feature_speed.py)
#   bash benchmarks/gpu_checks.sh sampler_stages  # nvidia-h200 or nvidia-h100-x1: each sampling
#       feature's stages at 64 and 256 rows of Qwen3's vocabulary (sampler_stages.py)
#   bash benchmarks/gpu_checks.sh sampling_tests  # nvidia-h200 or nvidia-h100-x1: the sampling,
#       truncated-draw, top-candidates, structured-output and graph tests (asynchronous
#       scheduling with penalised rows;
#       SAMPLING_TESTS=0 skips the first, GRAPH_TESTS=EXPR picks graph tests by -k)
#   bash benchmarks/gpu_checks.sh quant_probe  # nvidia-h200 or nvidia-h100-x1: the 8B shape's
#       decode linears dense, fp8 and AWQ (its tiles, its cheaper dequantizations):
#       quant_gemm_probe.py, bf16 and fp16
#   bash benchmarks/gpu_checks.sh quant_speed  # nvidia-h200 or nvidia-h100-x1: the Qwen3-8B
#       shape's single stream, then its throughput run, with dense bf16 linears, block-fp8 ones
#       (--quantization fp8, MINIVLLM_FP8_WEIGHTS=fp8) and AWQ 4-bit ones (--quantization awq),
#       alternating, while time is left (LAT_RUNS, TPUT_RUNS pick the runs, each name ending in
#       _dense, _fp8 or _awq; _awq16 and _dense16 run in fp16, AWQ checkpoints' dtype)
#   bash benchmarks/gpu_checks.sh spec  # nvidia-h200 or nvidia-h100-x1: speculative decoding's
#       GPU tests (draft model in bf16 with graphs; n-gram's verification graphs in fp32;
#       processed logprobs in bf16), then the 0.6B
#       shape's single stream without speculation, with a draft of its own random weights (every
#       draft accepted: the best case) and with n-gram (random weights: mostly the
#       overhead), k=4, while time is left; then the 8B shape with a random 0.6B draft and
#       without (LAT_RUNS picks the runs, each name ending in _base, _self, _ngram, _8b_draft or
#       _8b_base; SPEC_TESTS=0 skips the tests; SPEC_TRACE=1 traces each run and summarizes it)
#   bash benchmarks/gpu_checks.sh wide  # nvidia-h200 or nvidia-h100-x1: why wider dense models'
#       single stream runs far from its floor (8B at ~57% on the H100, session 56): the decode
#       GEMMs of the 1.7B, 4B and 8B shapes at 1-2 rows, cuBLAS, the skinny GEMM's default and
#       its tile and split-K sweep (bench_linear.py), then the 8B shape's traced single stream
#       summarized by kernel
#   bash benchmarks/gpu_checks.sh suite  # nvidia-h200: the whole test suite, six groups at once
#   bash benchmarks/gpu_checks.sh prefill_graph  # nvidia-h200: the prefill CUDA graphs (steps with
#       prompt tokens replayed; on by default since session 28) on (MINIVLLM_PREFILL_GRAPH=1)
#       against off (=0): their GPU test, then throughput on/off alternating
#   bash benchmarks/gpu_checks.sh prefill_default  # nvidia-h200: the engine-level GPU tests with
#       the prefill graphs on by default
#   bash benchmarks/gpu_checks.sh kv_budget  # nvidia-h200: an engine sized from free memory at
#       utilization 0.3 stays under it, prefill graphs on and off (session 29's call 3 also ran
#       the throughput run with an fp8 cache: in 9968491)
#   bash benchmarks/gpu_checks.sh fp8_ab  # nvidia-h200: throughput, bf16 and fp8 cache alternating
#   bash benchmarks/gpu_checks.sh fp8_cache  # nvidia-h200 or nvidia-h100-x1: the fp8 KV cache's GPU
#       tests (session 59: every token before a query read from the cache)
#   bash benchmarks/gpu_checks.sh sync  # nvidia-h200: decode steps never synchronize but to read
#       their tokens (sync debug mode), bf16 and fp8 caches
#   bash benchmarks/gpu_checks.sh sync engine_tests  # modes given together run in turn, in one
#       budget (BUDGET_S) and one packing of the compile caches
#   bash benchmarks/gpu_checks.sh mlp_probe  # nvidia-h200: kernels/decode_mlp.py (a layer's o_proj
#       to down as one persistent kernel) against the engine's compiled kernels, 32-256 rows
#   bash benchmarks/gpu_checks.sh mlp_engine  # nvidia-h200: the engine with it (MINIVLLM_FUSED_MLP):
#       the graph tests, then throughput against without, alternating
#   bash benchmarks/gpu_checks.sh block_size  # nvidia-h200: throughput at KV pages of 16 tokens
#       against 32-256 (--block-size), alternating (session 36: no gain)
#   bash benchmarks/gpu_checks.sh inductor_knobs  # nvidia-h200: throughput with Inductor's PDL
#       and its coordinate-descent tuning against its defaults, in turn
#   bash benchmarks/gpu_checks.sh profile  # nvidia-h200: traced decode steps (bf16 and fp8 cache,
#       ~256 and ~100 sequences), each summarized by kernel
#   OLD=dbg/old bash benchmarks/gpu_checks.sh host_ab  # nvidia-h200: throughput against OLD
#       (6d90a5a: before session 31's host cuts), bf16, steps timed; an fp8 run; test_engine.py
#   bash benchmarks/gpu_checks.sh graph_tests  # nvidia-h200: test_gpu_memory.py, test_gpu_graphs.py
#   bash benchmarks/gpu_checks.sh engine_tests  # nvidia-h200: test_engine.py on the GPU
#   bash benchmarks/gpu_checks.sh memory  # nvidia-h200: test_gpu_memory.py with the runner's
#       memory lines, then kv_budget_check.py with the prefill graphs on and off
#   bash benchmarks/gpu_checks.sh rounding  # nvidia-h200: session 26's rounding fix in _norm_rope
#       (norm_rope_probe, the kernels' GPU tests), then figures
#   bash benchmarks/gpu_checks.sh tp     # nvidia-h200-x2: issue 6, TP=2 against TP=1, 0.6B shape
#   bash benchmarks/gpu_checks.sh tp_engine  # nvidia-h200-x2: the same through the engines
#   bash benchmarks/gpu_checks.sh tp8b   # nvidia-h200-x2: the 8B shape at TP=2 and TP=1
#   bash benchmarks/gpu_checks.sh agreement  # nvidia-h200: agreement with transformers on a
#       checkpoint trained here (benchmarks/synthetic_lm.py), bf16 and fp8 cache, engine greedy
#   bash benchmarks/gpu_checks.sh tp_trained  # nvidia-h200-x2: TP=2 against TP=1 on such a
#       trained checkpoint, teacher-forced and through the engines
#   OLD=dbg/old bash benchmarks/gpu_checks.sh ab  # nvidia-h200: this tree against OLD (another
#       commit, unpacked there: git archive REV | tar -x -C dbg/old), alternating in one call
#       (AB_SHAPE: another shape; AB_SPEC: a --speculative-config for every run; AB_ARGS: more
#       bench options for every run, e.g. "--num-seqs 5"; RUNS: the order)
#   TP=2 OLD=dbg/old bash benchmarks/gpu_checks.sh ab  # nvidia-h200-x2: the same at TP=2
#   bash benchmarks/gpu_checks.sh green  # nvidia-h200: two_stream_probe.py's halves ping-pong on
#       two green contexts (GEMMs on G SMs, attention on the rest), then the attention sweep
#   bash benchmarks/gpu_checks.sh tma  # nvidia-h200: decode attention with TMA tile loads
#   bash benchmarks/gpu_checks.sh packed  # nvidia-h200: decode attention, a sequence's KV heads
#       in one program
#   bash benchmarks/gpu_checks.sh layout  # nvidia-h200: decode attention and a bare read over a
#       head-major KV cache against the engine's token-major one
#   bash benchmarks/gpu_checks.sh probes # nvidia-h200: the kernel sweeps and the head probe
#   bash benchmarks/gpu_checks.sh attention_tail  # nvidia-h200: decode attention's loss to the
#       read rate at 256 sequences, tail against fixed cost
#   bash benchmarks/gpu_checks.sh head_cast  # nvidia-h200: the logits' fp32 cast's cost, then
#       attention_tail and one throughput run
#   OLD=dbg/old bash benchmarks/gpu_checks.sh norm_rope  # nvidia-h200: the prefill norm + RoPE
#       + store kernel against the torch form, then throughput against OLD (cc86811; session 26:
#       kept, +0.5-2%)
# Modes of earlier calls are in the commits BENCHMARKS.md names (session 4's recheck, verify,
# final and last: in 04e96c7; session 5's s5: bb7f952, s5b: a95279f; session 6's fused: 0cb7b0a;
# session 21's startup, MINIVLLM_DYNAMIC_START=1 against 0, run in session 22's call 1: e2c4259;
# session 35's early_tile: 0437b02; session 36's flat_attention and flat_engine: 3b2847c).
# Every step's output streams into $OUT/logs.txt (the suite's into $OUT/tests.txt) and its JSON
# into $OUT/results.json, so a call cut short still returns what it did; a step past its limit
# gets SIGABRT first, and PYTHONFAULTHANDLER=1 makes every Python process print its stacks.
set -u
OUT=${OUT:-/tmp/minivllm-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 MINIVLLM_LOG_LEVEL=INFO HYPOTHESIS_PROFILE=gpu
# Seconds a mode's runs may use (SECONDS counts from this script's start): the caches' packing and
# a step's 15 s kill grace come after, inside the device's 600 s.
BUDGET_S=${BUDGET_S:-560}
# Inductor's and Triton's compile caches travel from call to call: on a fresh machine an engine's
# first start compiled for ~80 s more than a warm one's (119 s against 39 s, the kernel warm-up 62
# s against 16 s; session 32), out of a call's 600 s. They are kept under $CACHE, packed into
# $OUT/compile_cache.tar.gz.aa, .ab, ... (15 MiB pieces: a file comes back if under 16 MiB; the
# caches of session 33's profile mode, 144 MiB, packed into 20) as the outermost mode ends, and
# unpacked at the start when a call carries such pieces in dbg/cache/. Both caches
# key their entries by what was compiled (graph, kernel source, versions, GPU): a stale entry
# is a miss, never a wrong kernel.
CACHE=/tmp/minivllm-cache
export TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor TRITON_CACHE_DIR=$CACHE/triton
if [ -z "${MINIVLLM_CACHE_PACKED_BY:-}" ]; then
  export MINIVLLM_CACHE_PACKED_BY=$$
  if ls dbg/cache/compile_cache.tar.gz.* >/dev/null 2>&1; then
    if cat dbg/cache/compile_cache.tar.gz.* | tar -xz -C /; then
      echo "compile caches unpacked: $(du -sh $CACHE | cut -f1)"
    else  # a damaged archive: start cold rather than from half-written entries
      rm -rf "$CACHE"
    fi
  fi
  pack_caches() {
    # Nothing compiled (an early exit), or $OUT already holding the 8 files a call returns: the
    # results come back, the caches do not. Written aside and moved, so that a call cut short
    # never returns half an archive.
    [ -d "$CACHE" ] || return 0
    local tmp=/tmp/minivllm-cache-pack
    rm -rf "$tmp" && mkdir -p "$tmp"
    tar -czf "$tmp/all" -C / "${CACHE#/}" 2>/dev/null || return 0
    (cd "$tmp" && split -b 15M all compile_cache.tar.gz. && rm all)
    local pieces=$(ls "$tmp" | wc -l) held=$(find "$OUT" -type f | wc -l)
    if [ $(( pieces + held )) -gt 8 ] || [ $pieces -gt 3 ]; then
      echo "compile caches not packed: $pieces pieces of 15 MiB, \$OUT holds $held files"
      return 0
    fi
    mv "$tmp"/compile_cache.tar.gz.* "$OUT/"
    echo "compile caches packed: $(du -sh $CACHE | cut -f1) into $pieces pieces"
  }
  trap pack_caches EXIT
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOGS=/tmp/minivllm-logs
mkdir -p "$LOGS"
RESULTS=/tmp/minivllm-results
# A warm machine keeps /tmp from call to call: the outermost script starts an empty folder, so
# that results.json holds this call's steps only (session 75's calls returned earlier ones too)
[ "$MINIVLLM_CACHE_PACKED_BY" = $$ ] && rm -rf "$RESULTS"
mkdir -p "$RESULTS"
step() {  # step NAME SECONDS COMMAND...: its output is appended to $STEP_LOG as it comes
  local name=$1 limit=$2; shift 2
  local log=${STEP_LOG:-$OUT/logs.txt}
  echo "== $name" | tee -a "$log"
  local t0=$(date +%s)
  # SIGABRT first: with PYTHONFAULTHANDLER=1 every Python process of the group prints its stacks.
  # A Triton compile under way catches it instead (MLIR's crash recovery) and fails the test
  # ("PassManager::run failed"), and pytest goes on until the kill: STEP_DEADLINE lets
  # report_failures_now mark the failures that end after the signal.
  STEP_DEADLINE=$(( t0 + limit )) timeout -s ABRT -k 15 "$limit" "$@" 2>&1 | tee -a "$log" \
    > "$LOGS/$name.log"
  echo "   exit ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$log"
  grep -E "tok/s|started|passed|failed|FAILED|agreement|Error|took|captured" "$LOGS/$name.log" | tail -10
  merge_results
}
merge_results() {  # every result JSON so far, in one file (the device returns at most 8 files)
  python3 - "$RESULTS" "$OUT/results.json" <<'PY'
import json, os, pathlib, sys
res = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
tmp = f"{sys.argv[2]}.{os.getpid()}"
pathlib.Path(tmp).write_text(json.dumps(res, indent=1))
os.replace(tmp, sys.argv[2])
PY
}
# -v names each test as it ends and the plugin prints each failure at once: a suite cut short by
# its limit still says which tests failed and why.
PYTEST_ARGS="-p no:cacheprovider -p benchmarks.report_failures_now -v -o addopts= --tb=short"
# Several modes run in turn (`sync engine_tests`), sharing one budget: each step's limit is capped
# by what BUDGET_S leaves.
moe_choice() {  # moe_choice RUN: the MINIVLLM_MOE_KERNEL a moe_kernel run's name asks for
  case ${1#*_} in kernel|triton) echo triton ;; base|grouped) echo grouped ;; *) echo auto ;; esac
}
spec_flags() {  # spec_flags RUN: sets FLAGS, the bench arguments a spec run's name asks for
  local k4='"num_speculative_tokens": 4' draft='"model": "random:qwen3-0.6b"'
  case ${1#*_} in
    self) FLAGS=(--shape qwen3-0.6b --speculative-config "{$draft, $k4}") ;;
    ngram) FLAGS=(--shape qwen3-0.6b --speculative-config "{\"method\": \"ngram\", $k4}") ;;
    8b_draft) FLAGS=(--shape qwen3-8b --speculative-config "{$draft, $k4}") ;;
    8b_base) FLAGS=(--shape qwen3-8b) ;;
    *) FLAGS=(--shape qwen3-0.6b) ;;
  esac
}
quant_flags() {  # quant_flags RUN: the bench arguments a quant_speed run's name asks for
  case ${1##*_} in
    fp8) echo env MINIVLLM_FP8_WEIGHTS=fp8 python3 -m minivllm bench --quantization fp8 ;;
    awq) echo python3 -m minivllm bench --quantization awq ;;
    # fp16: the dtype Qwen's AWQ checkpoints run in (their config.json's)
    awq16) echo python3 -m minivllm bench --quantization awq --dtype float16 ;;
    dense16) echo python3 -m minivllm bench --dtype float16 ;;
    *) echo python3 -m minivllm bench ;;
  esac
}
left_or() {  # left_or SECONDS: SECONDS, or what the budget has left if less
  local left=$(( BUDGET_S - SECONDS ))
  echo $(( left < $1 ? left : $1 ))
}
for mode in "${@:-speed}"; do
[ $(( BUDGET_S - SECONDS )) -lt 30 ] && { echo "== $mode: no time left"; break; }
case "$mode" in
speed)
  # nvidia-h200 (<= 590 s): issue 5's figures (the throughput run's steps split into host work
  # and waiting by step_floor.py), the single stream's trace (summarized by trace_summary.py),
  # then the GPU tests of the decode path, as far as the limit lets them. Cold caches: an
  # engine start took 102-130 s the first time on a fresh machine, ~50 s after (2026-12-01).
  step latency 170 python3 -m minivllm bench --shape qwen3-0.6b --latency --json "$RESULTS/latency.json"
  step bench 150 python3 -m minivllm bench --shape qwen3-0.6b --json "$RESULTS/bench.json" \
    --step-times "$OUT/steps.json"
  python3 benchmarks/step_floor.py "$OUT/steps.json" | tee -a "$OUT/logs.txt"
  # the single stream's trace: steps 100-107 at one sequence
  step trace_latency 90 python3 -m minivllm bench --shape qwen3-0.6b --latency \
    --trace "$OUT/trace_latency.json" --json "$RESULTS/latency_trace.json"
  python3 benchmarks/trace_summary.py "$OUT/trace_latency.json" --top 40 | tee -a "$OUT/logs.txt"
  gzip -f "$OUT/trace_latency.json"
  STEP_LOG=$OUT/tests.txt step tests 170 python3 -m pytest $PYTEST_ARGS \
    "tests/test_gpu_graphs.py::test_graphs_and_async_scheduling_equal_eager[bfloat16]" \
    tests/test_gpu_graphs.py::test_plain_greedy_streams_take_the_graphs_pick \
    tests/test_decode_head.py tests/test_decode_stem.py tests/test_sample_kernel.py \
    tests/test_norm_rope_store.py \
    tests/test_kernels.py tests/test_kernels_model.py tests/test_skinny_gemm.py \
    "tests/test_gpu_graphs.py::test_graphs_and_async_scheduling_equal_eager[float32]" \
    tests/test_decode_graphs.py "tests/test_engine.py::test_triton_backend_gives_identical_outputs"
  ;;
tp)
  # nvidia-h200-x2 (<= 480 s): issue 6: TP=2 against TP=1 (teacher-forced agreement), then the
  # throughput bench at TP=2 and, on one of the two GPUs, at TP=1 in the same call.
  step tp_check 200 python3 benchmarks/tp_check.py --skip-engine --json "$RESULTS/tp_check.json"
  step bench_tp2 170 python3 -m minivllm bench --shape qwen3-0.6b -tp 2 --json "$RESULTS/bench_tp2.json"
  CUDA_VISIBLE_DEVICES=0 step bench_tp1 110 python3 -m minivllm bench --shape qwen3-0.6b \
    --json "$RESULTS/bench_tp1.json"
  ;;
tp_engine)
  # nvidia-h200-x2 (<= 560 s): tp_check with its engine part (greedy through
  # LLM(tensor_parallel_size=2) against 1): cold, its engines' compiles ran past 320 s.
  step tp_check_engine 560 python3 benchmarks/tp_check.py --prompts 4 --max-tokens 32 \
    --json "$RESULTS/tp_check_engine.json"
  ;;
agreement)
  # nvidia-h200 (<= 560 s): session 23's calls 2-3. Training takes ~95 s; an engine's first start
  # on a fresh machine ~100 s; the fp8 run (no engine) shares the GPU with the bf16 one.
  step train 140 python3 benchmarks/synthetic_lm.py --shape qwen3-0.6b --out /tmp/trained
  step agreement_fp8 120 python3 benchmarks/agreement.py --checkpoint /tmp/trained --positions 512 \
    --kv-cache-dtype fp8 --json "$RESULTS/agreement_trained_fp8.json" &
  step agreement 240 python3 benchmarks/agreement.py --checkpoint /tmp/trained --positions 512 \
    --engine-prompts 8 --json "$RESULTS/agreement_trained.json"
  wait
  ;;
tp_trained)
  # nvidia-h200-x2 (<= 580 s): issue 6's TP=2 check on a trained checkpoint (on random weights
  # it cannot agree above bf16's noise floor, ~95-97%): teacher-forced, then through the engines.
  step train 140 python3 benchmarks/synthetic_lm.py --shape qwen3-0.6b --out /tmp/trained
  step tp_check_trained 150 python3 benchmarks/tp_check.py --checkpoint /tmp/trained --skip-engine \
    --json "$RESULTS/tp_check_trained.json"
  step tp_check_trained_engine 290 python3 benchmarks/tp_check.py --checkpoint /tmp/trained \
    --prompts 4 --max-tokens 32 --json "$RESULTS/tp_check_trained_engine.json"
  ;;
tp8b)
  # nvidia-h200-x2 (<= 400 s): the Qwen3-8B shape at TP=2, and at TP=1 on one of the two GPUs.
  step bench_8b_tp2 180 python3 -m minivllm bench --shape qwen3-8b -tp 2 \
    --json "$RESULTS/bench_8b_tp2.json"
  CUDA_VISIBLE_DEVICES=0 step bench_8b_tp1 150 python3 -m minivllm bench --shape qwen3-8b \
    --json "$RESULTS/bench_8b_tp1.json"
  ;;
ab)
  # nvidia-h200 (<= 450 s): single stream new, old, new, then throughput new, old (session 7's
  # final A/B), at the 0.6B shape or AB_SHAPE's. The first engine start of a call compiles
  # everything (~100 s). TP=2 (on nvidia-h200-x2): throughput only, new, old, new, old, at
  # tensor-parallel size 2 (TP=2 ran 22,234 tok/s in session 21 against 23,945 in session 6's).
  if [ ! -d "${OLD:-}/minivllm" ]; then
    echo "ab: set OLD to an unpacked tree to compare against (OLD=dbg/old)" >&2
    exit 2
  fi
  OLD=$(cd "$OLD" && pwd) NEW=$PWD i=0
  runs="latency:new latency:old latency:new throughput:new throughput:old"
  [ "${TP:-1}" = 2 ] && runs="throughput:new throughput:old throughput:new throughput:old"
  runs=${RUNS:-$runs}  # RUNS="throughput:new throughput:old ...": an order of one's own
  for run in $runs; do
    kind=${run%:*} side=${run#*:} i=$((i + 1))
    flag=; [ "$kind" = latency ] && flag=--latency
    tree=$NEW; [ "$side" = old ] && tree=$OLD
    # PYTHONPATH's "." is the tree the run starts in: each side imports its own minivllm
    [ "$kind" = throughput ] && flag="-tp ${TP:-1}"
    # AB_SPEC: a --speculative-config for every run (a draft model's or n-gram's single stream)
    # A run's limit: 170 s, the first 260 (a cold start compiles everything: a Qwen3-30B-A3B
    # engine started in 156 s on a fresh H100, session 69, and its run was cut at 170).
    # AB_LIMIT_S / AB_FIRST_LIMIT_S: others (session 75: that shape's throughput run, ~46 s
    # after a cold start of 228 s, was cut at 260; the older tree's, compiling its own, at 170)
    limit=${AB_LIMIT_S:-170}; [ $i = 1 ] && limit=${AB_FIRST_LIMIT_S:-260}
    [ $(( BUDGET_S - SECONDS )) -lt 30 ] && { echo "== ${i}_${kind}_$side: no time left"; break; }
    (cd "$tree" && step "${i}_${kind}_$side" $(left_or $limit) python3 -m minivllm \
      bench --shape "${AB_SHAPE:-qwen3-0.6b}" $flag ${AB_SPEC:+--speculative-config "$AB_SPEC"} \
      ${AB_ARGS:-} --json "$RESULTS/${i}_${kind}_$side.json")
  done
  ;;
attention_tail)
  # nvidia-h200 (<= 300 s): where decode attention at 256 sequences loses to the read rate
  # (4.06 TB/s at contexts U[200, 1124], 4.28 at U[700, 1624], 4.66 for a plain read; session
  # 24). A fit of those two gives ~14 us a launch that does not scale with the contexts: equal
  # contexts separate the launch's tail (programs of unequal length ending unevenly) from each
  # program's fixed cost, and longest-first order tests the tail once more.
  step read_bandwidth 60 python3 benchmarks/read_bandwidth.py
  step sweep_equal_contexts 120 python3 benchmarks/sweep_decode_attention.py --default-only \
    --contexts 662-662,1162-1162,200-1124,700-1624,8000-8000 --order both
  step sweep_equal_contexts_128 90 python3 benchmarks/sweep_decode_attention.py --batch 128 \
    --default-only --contexts 662-662,200-1124 --order both
  ;;
head_cast)
  # nvidia-h200 (<= 540 s): session 25's first call: the head and sampler with and without the
  # logits' fp32 cast, attention_tail's steps, and one throughput run (bench's read-rate floor).
  step head_cast_probe 90 python3 benchmarks/head_cast_probe.py
  "$0" attention_tail
  step bench 170 python3 -m minivllm bench --shape qwen3-0.6b --json "$RESULTS/bench.json"
  ;;
norm_rope)
  # nvidia-h200 (<= 540 s): session 25's prefill kernel (kernels/norm_rope_store.py) against
  # the compiled torch form and store it replaced, then throughput against OLD (the tree before
  # it: git archive cc86811), alternating. Session 26's call 1: 532 s on a fresh machine.
  step norm_rope_probe 90 python3 benchmarks/norm_rope_probe.py
  RUNS=${RUNS:-"throughput:new throughput:old throughput:new throughput:old throughput:new throughput:old"} \
    "$0" ab
  ;;
moe)
  # nvidia-h200 or nvidia-h100-x1 (<= 560 s): session 53's Qwen3-MoE: tests/test_moe.py's GPU
  # tests (the compiled layers and CUDA graphs against eager in bf16, the bf16 MLP through
  # CUTLASS's grouped GEMM), then the throughput run at the Qwen3-30B-A3B shape (random weights:
  # 61 GB of bf16; 48 sparse layers of 128 experts, 8 per token, each expert GEMM one grouped
  # GEMM per step) and its single stream with what time is left.
  STEP_LOG=$OUT/tests.txt step moe_tests $(left_or 180) python3 -m pytest $PYTEST_ARGS \
    tests/test_moe.py -k "moe_mlp or graphs and bfloat16 or hopper"
  step bench_moe $(left_or 260) python3 -m minivllm bench --shape qwen3-30b-a3b \
    --json "$RESULTS/bench_moe.json"
  step latency_moe $(left_or 150) python3 -m minivllm bench --shape qwen3-30b-a3b --latency \
    --json "$RESULTS/latency_moe.json"
  ;;
moe_kernel)
  # nvidia-h200 or nvidia-h100-x1 (<= 560 s): kernels/fused_moe.py, opt-in by
  # MINIVLLM_MOE_KERNEL=triton: at <= 256 tokens a step the experts run as three Triton kernels
  # (the pairs' layout by expert; gate_up gathering h's rows itself, SiLU * up in its epilogue;
  # down times the routing weights) and a fixed-order sum, in place of the grouped-GEMM path's
  # ~10 kernels (session 53's single stream: 6.36 ms a step, ~32% of its floor). First its tests
  # on the GPU (bf16 included; the compiled layer traced and run), then `bench --latency` at the
  # Qwen3-30B-A3B shape with the kernels (kernel) and without (base), alternating, then the
  # throughput run once each, while time is left: a run needs >= 120 s (session 53: the
  # throughput run's engine started in 158 s, its run 54 s; the latency run took ~150 s). The
  # kernel runs compile their own layer graph (cold caches: the first costs more). Likely more
  # runs than one call holds: a second call with MOE_KERNEL_TESTS=0 LAT_RUNS= takes the
  # throughput pair.
  [ "${MOE_KERNEL_TESTS:-1}" = 1 ] && STEP_LOG=$OUT/tests.txt step moe_kernel_tests $(left_or 150) \
    python3 -m pytest $PYTEST_ARGS tests/test_fused_moe.py tests/test_moe_route.py
  # a run's name ends in its MINIVLLM_MOE_KERNEL: triton (kernel), grouped (base) or auto
  for run in ${LAT_RUNS-1_kernel 2_base 3_kernel 4_base}; do
    [ $(( BUDGET_S - SECONDS )) -lt 120 ] && break
    flag=(env MINIVLLM_MOE_KERNEL=$(moe_choice "$run"))
    step "latency_moe_$run" $(left_or 200) "${flag[@]}" python3 -m minivllm bench \
      --shape qwen3-30b-a3b --latency --json "$RESULTS/latency_moe_$run.json"
  done
  for run in ${TPUT_RUNS-1_kernel 2_base}; do
    [ $(( BUDGET_S - SECONDS )) -lt 120 ] && break
    flag=(env MINIVLLM_MOE_KERNEL=$(moe_choice "$run"))
    step "bench_moe_$run" $(left_or 260) "${flag[@]}" python3 -m minivllm bench \
      --shape qwen3-30b-a3b --json "$RESULTS/bench_moe_$run.json"
  done
  ;;
quant_speed)
  # nvidia-h200 or nvidia-h100-x1 (<= 560 s): what the quantized-weight paths cost and save at
  # the Qwen3-8B shape, on random weights (no quantized checkpoint can be downloaded there):
  # `bench --quantization fp8` holds the decoder linears as Fp8BlockWeight ([128, 128] blocks,
  # the Triton block-fp8 GEMM below 256 rows), `--quantization awq` as AwqWeight (group 128, the
  # Triton AWQ GEMM below 256 rows); both run without the persistent decode kernel and the fused
  # MLP, which multiply dense 16-bit weights. The dense bf16 run is the baseline. The single
  # stream first, then the throughput run, in turn, while time is left: a run needs >= 120 s
  # (an 8B engine's start compiles and captures for ~1-2 min; untimed here). Likely more runs
  # than one call holds: a second call with LAT_RUNS= takes the throughput runs. The floor each
  # throughput run prints counts the weights' real bytes (fp8: 1 byte + scales; AWQ: 0.5 byte +
  # zero points + scales).
  for run in ${LAT_RUNS-1_dense 2_fp8 3_awq}; do
    [ $(( BUDGET_S - SECONDS )) -lt 120 ] && break
    step "latency_8b_$run" $(left_or 200) $(quant_flags "$run") --shape qwen3-8b --latency \
      --json "$RESULTS/latency_8b_$run.json"
  done
  for run in ${TPUT_RUNS-1_dense 2_fp8 3_awq}; do
    [ $(( BUDGET_S - SECONDS )) -lt 120 ] && break
    step "bench_8b_$run" $(left_or 260) $(quant_flags "$run") --shape qwen3-8b \
      --json "$RESULTS/bench_8b_$run.json"
  done
  ;;
spec)
  # nvidia-h200 or nvidia-h100-x1 (<= 560 s; ran in sessions 58-59): what speculative decoding costs and
  # gains on the GPU. First its GPU tests: a tiny checkpoint as its own draft in bf16 with the
  # compiled forward and CUDA graphs (greedy outputs those without speculation, >= 90% of drafts
  # accepted: bf16 may flip near-ties), and processed_logprobs in bf16 against the reference
  # computed from the engine's own logits. Then `bench --latency` (greedy; speculation turns
  # asynchronous scheduling off) at the 0.6B shape: without
  # speculation (base), with a draft of random:qwen3-0.6b, the target's own weights (self: every
  # draft accepted, the best case) and with n-gram (ngram: random weights' greedy
  # continuations may repeat, so its acceptance is whatever they give; mostly its cost), k=4, each result with its acceptance; then,
  # while time is left, the 8B shape with a random 0.6B draft (~none accepted: the draft's cost)
  # and without. A run needs >= 120 s (an 8B engine's start compiles and captures for ~1-2 min).
  # (Session 59, a fresh H100: the tests 275 s in all (draft model 124, n-gram 113, logprobs 21);
  # a latency run's engine starts in 55-160 s, its compiles cold; a run needs its 200 s.)
  # SPEC_TEST_ARGS: other test files or ids (and -k) in place of the three files' GPU tests
  [ "${SPEC_TESTS:-1}" = 1 ] && STEP_LOG=$OUT/tests.txt step spec_tests $(left_or 330) \
    python3 -m pytest $PYTEST_ARGS ${SPEC_TEST_ARGS:-tests/test_draft_model.py \
    tests/test_spec_decode.py tests/test_logprobs_mode.py -k gpu}
  # SPEC_TRACE=1: each run traced (bench --trace: 8 of the last stream's steps, the profiler on,
  # so its tok/s is not comparable), the trace summarized into logs.txt by kernel and by the
  # host's named ranges and CUDA calls, then deleted.
  for run in ${LAT_RUNS-1_base 2_self 3_ngram 4_8b_draft 5_8b_base}; do
    [ $(( BUDGET_S - SECONDS )) -lt 120 ] && break
    spec_flags "$run"
    trace=(); [ "${SPEC_TRACE:-0}" = 1 ] && trace=(--trace "/tmp/trace_spec_$run.json")
    step "latency_spec_$run" $(left_or 200) python3 -m minivllm bench "${FLAGS[@]}" --latency \
      "${trace[@]}" --json "$RESULTS/latency_spec_$run.json"
    if [ -f "/tmp/trace_spec_$run.json" ]; then
      # --steps 8: bench's traced steps. The sampler's kernel, which counts steps otherwise,
      # runs once a forward, and a speculative step runs k + 2 (session 62's trace: 48 for 8).
      python3 benchmarks/trace_summary.py "/tmp/trace_spec_$run.json" --steps 8 --top 30 | \
        tee -a "$OUT/logs.txt"
      rm -f "/tmp/trace_spec_$run.json"
    fi
  done
  ;;
lora)
  # nvidia-h200 or nvidia-h100-x1 (~150 s): session 54's LoRA engine on the GPU: its decode CUDA
  # graphs (captured through the LoRA layer, a static slot per row) and compiled forward against
  # the eager LoRA engine, adapters and base rows mixed; fp32 against transformers with each
  # adapter merged too, and its base rows against a base engine's graphs.
  # Since session 66 its steps without adapter rows replay the base model's graphs: then plain
  # sampling on an engine without LoRA and on one with it, without an adapter and with one of
  # rank 16 (feature_speed.py, which prints each engine's start-up time; LORA_SPEED=0 skips
  # them), and with OLD=dir (another tree, unpacked there) the LoRA run of that tree too, run
  # from its directory (session 66's LoRA engine started in over 200 s on a cold H100; session
  # 67's, on an H200 after the tests, in 136 s against 72 without LoRA). Session 67's LoRA runs
  # were taken before feature_speed.py gave the KV cache room for both sets of prompts: their
  # plain-sampling and adapter figures include prefilling the prompts again.
  if [ "${LORA_TESTS:-1}" != 0 ]; then
    # 300 s: a cold machine compiles past 180 s (sessions 67 and 77 cut there).
    STEP_LOG=$OUT/tests.txt step lora_tests $(left_or 300) python3 -m pytest $PYTEST_ARGS \
      tests/test_lora.py -k gpu
  fi
  if [ "${LORA_SPEED:-1}" != 0 ]; then
    step feature_speed_plain $(left_or 150) python3 benchmarks/feature_speed.py \
      --features greedy --json "$RESULTS/feature_speed_plain.json"
    step feature_speed_lora $(left_or 300) python3 benchmarks/feature_speed.py --lora-rank 16 \
      --features greedy,lora --json "$RESULTS/feature_speed_lora.json"
    if [ -n "${OLD:-}" ]; then
      (cd "$OLD" && PYTHONPATH=/tmp/site:. step feature_speed_lora_old $(left_or 300) python3 \
        benchmarks/feature_speed.py --lora-rank 16 --features greedy,lora \
        --json "$RESULTS/feature_speed_lora_old.json")
    fi
  fi
  ;;
load_weights)
  # nvidia-h200 or nvidia-h100-x1 (passed, session 56): in-place weight updates (LLM.load_weights) on a
  # compiled engine with its decode CUDA graphs (the persistent decode at 1-2 rows, the prefill
  # graphs where it takes them), checkpoint A updated to B's weights against a fresh engine from
  # B: the same greedy tokens in bf16 and fp32, nothing captured again; then the CPU-side tests
  # of test_load_weights.py on the GPU machine.
  STEP_LOG=$OUT/tests.txt step load_weights_gpu_tests $(left_or 240) python3 -m pytest \
    $PYTEST_ARGS tests/test_load_weights.py -k gpu
  STEP_LOG=$OUT/tests.txt step load_weights_tests $(left_or 180) python3 -m pytest $PYTEST_ARGS \
    tests/test_load_weights.py -k "not gpu"
  ;;
sleep)
  # nvidia-h200 or nvidia-h100-x1 (passed, session 56): sleep mode on a compiled bf16 engine with its
  # decode CUDA graphs (the persistent decode at 1-2 rows, the prefill graphs where it takes them):
  # sleep(1) frees at least the weights' and the cache's bytes, wake_up captures the graphs again
  # (no compile) and they replay to the greedy tokens of before; then the CPU-side tests of
  # test_sleep.py on the GPU machine (the TP=2 one included: gloo ranks on the CPU).
  # Session 77: a draft model's weights and cache sleep with the target's (its GPU test: the
  # memory returns to the device, both sets of decode graphs captured again).
  STEP_LOG=$OUT/tests.txt step sleep_gpu_tests $(left_or 300) python3 -m pytest $PYTEST_ARGS \
    tests/test_sleep.py tests/test_audit_s77_sleep_draft.py -k gpu
  STEP_LOG=$OUT/tests.txt step sleep_tests $(left_or 180) python3 -m pytest $PYTEST_ARGS \
    tests/test_sleep.py -k "not gpu"
  ;;
embeds)
  # nvidia-h200 or nvidia-h100-x1 (passed, session 56): session 55's pooling engine without CUDA
  # graphs, and prompt embeddings (their steps skip the graphs; the stem's `where`) on a CUDA
  # engine against the token path and transformers; the decode-graph capture rules.
  STEP_LOG=$OUT/tests.txt step embeds_tests $(left_or 240) python3 -m pytest $PYTEST_ARGS \
    tests/test_embed.py tests/test_prompt_embeds.py tests/test_decode_graphs.py
  ;;
awq)
  # nvidia-h200 or nvidia-h100-x1: AWQ 4-bit checkpoints' GPU tests (passed, sessions 55-56): the Triton
  # AWQ GEMM in bf16 and fp16 at 1-300 rows and real sizes against the dequantized product,
  # compiled (inductor, fullgraph) and replayed in a CUDA graph; the engine's decode graphs on a
  # tiny fp16 AWQ checkpoint against its eager run, and in fp32 against transformers; then the
  # CPU-side tests of test_awq.py on the GPU (kernel cases, logits, engine, TP=1 pieces).
  STEP_LOG=$OUT/tests.txt step awq_gpu_tests $(left_or 300) python3 -m pytest $PYTEST_ARGS \
    tests/test_awq.py -k gpu
  STEP_LOG=$OUT/tests.txt step awq_tests $(left_or 240) python3 -m pytest $PYTEST_ARGS \
    tests/test_awq.py -k "not gpu and not tp2"
  ;;
fp8w)
  # nvidia-h200 or nvidia-h100-x1: block-fp8 checkpoints' weights kept in fp8 (passed, session
  # 56): the Triton block-fp8 GEMM in bf16 and fp16 at 1-300 rows and Qwen3-8B's layer sizes
  # against the dequantized product, compiled (inductor, fullgraph) and replayed in a CUDA graph;
  # the engine's decode graphs on a tiny bf16 fp8 checkpoint against its eager run, and fp8 vs
  # dequantized weights in fp32; then the CPU-side tests of test_fp8_weights.py on the GPU.
  STEP_LOG=$OUT/tests.txt step fp8w_gpu_tests $(left_or 300) python3 -m pytest $PYTEST_ARGS \
    tests/test_fp8_weights.py -k gpu
  STEP_LOG=$OUT/tests.txt step fp8w_tests $(left_or 240) python3 -m pytest $PYTEST_ARGS \
    tests/test_fp8_weights.py -k "not gpu and not tp2"
  ;;
moe_probe)
  # nvidia-h200 or nvidia-h100-x1 (~150 s on a fresh machine): where the MoE expert paths cross
  # (session 54: MINIVLLM_MOE_KERNEL=triton +13% on the single stream, -12% on the throughput
  # run): one Qwen3-30B-A3B sparse layer's moe_mlp, grouped GEMMs against the Triton kernels, at
  # 1-256 tokens in CUDA graphs, with each path's kernels at 1, 32 and 256 tokens.
  # MOE_PROBE_ARGS: other options (MOE_PROBE_ARGS="--compiled --tokens 1,8,64,256 --kernels
  # 1,64": the layer as the engine compiles it, what routing costs there; session 72)
  step moe_probe $(left_or 200) python3 benchmarks/moe_probe.py --json "$RESULTS/moe_probe.json" \
    ${MOE_PROBE_ARGS:-}
  ;;
moe_launch)
  # nvidia-h200 or nvidia-h100-x1 (<= 560 s): kernels/fused_moe.py's launch choices at the
  # Qwen3-30B-A3B shape, never made on a GPU (session 68's trace of the single stream: the align
  # kernel 13.4 us a layer, ~13% of the step; the expert GEMMs ~80% of their read): the align
  # kernel's pair chunk and warps (and its two forms) at 1-256 tokens, then the expert GEMMs'
  # tiles, warps and stages at 1, 2, 8 and 32 tokens, each checked against the default launch;
  # first the routing kernel's (kernels/moe_route.py) at 1-256 tokens
  # (benchmarks/moe_launch_probe.py; MOE_LAUNCH_ARGS: other options). OLD=dir (another tree,
  # unpacked there): that tree's align kernel first, from its own directory (session 69
  # rewrote the kernel: 33fb84b has the one before).
  if [ -n "${OLD:-}" ]; then
    (cd "$OLD" && step moe_launch_old_align $(left_or 150) python3 benchmarks/moe_launch_probe.py \
      --gemm-tokens "" --json "$RESULTS/moe_launch_old_align.json")
  fi
  step moe_launch $(left_or 560) python3 benchmarks/moe_launch_probe.py \
    --budget-s $(( $(left_or 560) - 150 )) --json "$RESULTS/moe_launch.json" ${MOE_LAUNCH_ARGS:-}
  ;;
features)
  # nvidia-h200 or nvidia-h100-x1 (~3 min on a fresh machine; session 62): each sampling feature's
  # tok/s beside plain sampling's on one 0.6B engine, 64 prompts of 256 random ids, 128 tokens
  # each (benchmarks/feature_speed.py; FEATURE_ARGS: other options); then an engine with LoRA
  # enabled, plain sampling without an adapter and with one of rank 16 (the plain figures of
  # the two engines: what enabling LoRA costs requests without one)
  step feature_speed $(left_or 300) python3 benchmarks/feature_speed.py ${FEATURE_ARGS:-} \
    --json "$RESULTS/feature_speed.json"
  step feature_speed_lora $(left_or 200) python3 benchmarks/feature_speed.py ${FEATURE_ARGS:-} \
    --lora-rank 16 --features greedy,lora --json "$RESULTS/feature_speed_lora.json"
  ;;
sampling_tests)
  # nvidia-h200 or nvidia-h100-x1 (~4 min; session 64): the sampling and structured-output tests
  # on the GPU after session 63's sparse penalties, top-k candidates and packed masks, then
  # test_gpu_graphs.py (its penalised / truncated / allowed-ids rows under graphs and
  # asynchronous scheduling against the synchronous eager engine).
  if [ "${SAMPLING_TESTS:-1}" != 0 ]; then
    STEP_LOG=$OUT/tests.txt step sampling_tests $(left_or 240) python3 -m pytest $PYTEST_ARGS \
      tests/test_sampling*.py tests/test_structured_outputs.py tests/test_sampler_stages.py \
      tests/test_truncated_sample.py tests/test_top_candidates.py tests/test_sample_kernel.py
  fi
  STEP_LOG=$OUT/tests.txt step graph_tests $(left_or 480) python3 -m pytest $PYTEST_ARGS \
    tests/test_gpu_graphs.py ${GRAPH_TESTS:+-k "$GRAPH_TESTS"}
  ;;
sampler_stages)
  # nvidia-h200 or nvidia-h100-x1 (~1-2 min; session 63): plain, top-k 20 / top-p 0.95, top-p,
  # min-p, penalised and allowed-ids rows: sample() and its stages, with the Gumbel kernel over
  # truncated logits beside softmax + inverse CDF (the lever after session 63's candidates);
  # since session 65 kernels.top_candidates ('candidates') beside torch.topk ('topk').
  step sampler_stages $(left_or 200) python3 benchmarks/sampler_stages.py \
    --json "$RESULTS/sampler_stages.json"
  ;;
quant_probe)
  # nvidia-h200 or nvidia-h100-x1 (~80 s on a fresh machine; session 62): the Qwen3-8B shape's
  # four decode linears at 1, 2 and 16 rows, in bf16 then fp16 (Qwen's AWQ checkpoints' dtype):
  # cuBLAS dense, block fp8, the AWQ kernel at its tiles and others (QUANT_PROBE_ROWS: other
  # row counts).
  for dtype in bfloat16 float16; do
    step "quant_probe_$dtype" $(left_or 150) python3 benchmarks/quant_gemm_probe.py \
      --rows "${QUANT_PROBE_ROWS:-1,2,16}" --dtype $dtype --json "$RESULTS/quant_probe_$dtype.json"
  done
  ;;
wide)
  # nvidia-h200 or nvidia-h100-x1 (<= 420 s): see the header.
  step linear_wide $(left_or 200) python3 benchmarks/bench_linear.py --models 1.7b,4b,8b --tp 1 \
    --rows 1,2 --sweep --sweep-split --sweep-rows 2 --layers qkv,o_proj,gate_up,down \
    --json "$RESULTS/linear_wide.json"
  step trace_8b_latency $(left_or 220) python3 -m minivllm bench --shape qwen3-8b --latency \
    --trace "$OUT/trace_8b_latency.json" --json "$RESULTS/trace_8b_latency.json"
  python3 benchmarks/trace_summary.py "$OUT/trace_8b_latency.json" --top 40 | tee -a "$OUT/logs.txt"
  rm -f "$OUT/trace_8b_latency.json"
  ;;
moe_profile)
  # nvidia-h200 or nvidia-h100-x1 (~450 s on a fresh machine): where a Qwen3-30B-A3B-shape
  # decode step's GPU time goes (session 53: single stream 6.36 ms a step, ~32% of its floor;
  # throughput 48%): traced single-stream steps, then 8 traced steps of the throughput run from
  # step 100 (~256 sequences), each summarized by kernel (trace_summary.py).
  step trace_moe_latency $(left_or 150) python3 -m minivllm bench --shape qwen3-30b-a3b --latency \
    --trace "$OUT/trace_moe_latency.json" --json "$RESULTS/trace_moe_latency.json"
  python3 benchmarks/trace_summary.py "$OUT/trace_moe_latency.json" --top 30 | tee -a "$OUT/logs.txt"
  rm -f "$OUT/trace_moe_latency.json"
  step trace_moe_100 $(left_or 280) python3 -m minivllm bench --shape qwen3-30b-a3b \
    --trace "$OUT/trace_moe_100.json" --trace-from 100 --json "$RESULTS/trace_moe_100.json"
  python3 benchmarks/trace_summary.py "$OUT/trace_moe_100.json" --top 30 | tee -a "$OUT/logs.txt"
  rm -f "$OUT/trace_moe_100.json"
  ;;
figures)
  # nvidia-h200 (<= 330 s on a fresh machine): issue 5's two figures for main as it is, without
  # the test suite: the single stream, the throughput run with its steps split by step_floor.py,
  # and the throughput run again without --step-times (session 26's call 4: 307 s).
  step latency 200 python3 -m minivllm bench --shape qwen3-0.6b --latency --json "$RESULTS/latency.json"
  step bench 170 python3 -m minivllm bench --shape qwen3-0.6b --json "$RESULTS/bench.json" \
    --step-times "$OUT/steps.json"
  python3 benchmarks/step_floor.py "$OUT/steps.json" | tee -a "$OUT/logs.txt"
  gzip -f "$OUT/steps.json"
  step bench_again 100 python3 -m minivllm bench --shape qwen3-0.6b --json "$RESULTS/bench_again.json"
  ;;
rounding)
  # nvidia-h200 (<= 570 s): session 26's fix (each RoPE product rounded before the sum, as
  # apply_rope does): the probe's share of values equal to the eager form (77% before), the
  # tests of every kernel that shares _norm_rope, then main's two figures.
  step norm_rope_probe 90 python3 benchmarks/norm_rope_probe.py
  STEP_LOG=$OUT/tests.txt step tests 150 python3 -m pytest $PYTEST_ARGS tests/test_norm_rope_store.py \
    tests/test_decode_layer.py tests/test_kernels.py
  "$0" figures
  ;;
prefill_graph)
  # nvidia-h200 (see below): session 27 found the steps with prompt tokens host-bound (they never
  # wait for the device); runtime/prefill_graph.py replays them from one CUDA graph. Its tests,
  # then the throughput run with it on and off, alternating, each with its steps timed
  # (step_floor.py: the steps with prompt tokens and how long they waited for the device). All of
  # it is ~650 s on a fresh machine, past one call: TESTS=0 skips the tests, RUNS picks the runs
  # (names N_on / N_off: throughput; N_latency_on / N_latency_off: the single stream, whose
  # 512-token prompt takes the 512-token graph).
  # (TESTS=gpu: the GPU test alone; the CPU file's engine test compiles for CUDA there and a cold
  # machine takes it past 150 s, as session 28's first call found. A run on a cold machine
  # compiles for ~3 min, hence 250 s a run.)
  case ${TESTS:-1} in
    0) ;;
    gpu) STEP_LOG=$OUT/tests.txt step tests 200 python3 -m pytest $PYTEST_ARGS \
      "tests/test_gpu_graphs.py::test_prefill_graph_steps_equal_eager" ;;
    *) STEP_LOG=$OUT/tests.txt step tests 150 python3 -m pytest $PYTEST_ARGS \
      tests/test_prefill_graph.py "tests/test_gpu_graphs.py::test_prefill_graph_steps_equal_eager" ;;
  esac
  for run in ${RUNS:-1_on 2_off 3_on 4_off}; do
    flag=0; [ "${run##*_}" = on ] && flag=1
    if [ "${run#*_latency}" != "$run" ]; then
      MINIVLLM_PREFILL_GRAPH=$flag step "bench_$run" 250 python3 -m minivllm bench \
        --shape qwen3-0.6b --latency --json "$RESULTS/bench_$run.json"
      continue
    fi
    MINIVLLM_PREFILL_GRAPH=$flag step "bench_$run" 250 python3 -m minivllm bench --shape qwen3-0.6b \
      --json "$RESULTS/bench_$run.json" --step-times "$OUT/steps_$run.json"
    python3 benchmarks/step_floor.py "$OUT/steps_$run.json" | tee -a "$OUT/logs.txt"
    gzip -f "$OUT/steps_$run.json"
  done
  ;;
prefill_default)
  # nvidia-h200 (<= 420 s): prefill graphs on by default (session 28): the engine-level GPU tests,
  # which now take them wherever the runner can. On a fresh machine session 28's call 4 passed
  # test_gpu_graphs.py and was still compiling test_engine.py's first engine at 400 s.
  STEP_LOG=$OUT/tests.txt step tests 400 python3 -m pytest $PYTEST_ARGS tests/test_gpu_graphs.py \
    tests/test_engine.py
  ;;
engine_tests)
  # nvidia-h200 (<= 580 s): test_engine.py alone, its engines started small on CUDA since
  # session 31 (16 sequences, 512 batched tokens); at the defaults its first engine was still
  # compiling at 400 s on a fresh machine (sessions 28-29); small, its first 8 tests took the
  # 580 s (session 32), after which its engines run eagerly on CUDA but the first test's.
  STEP_LOG=$OUT/tests.txt step tests $(left_or 580) python3 -m pytest $PYTEST_ARGS \
    tests/test_engine.py
  ;;
suite)
  # nvidia-h200 (<= 580 s): session 42: the whole test suite on the GPU. Six pytest processes
  # share the GPU (compiles are CPU-bound: 16 cores), each a group of files, each its own log
  # ($OUT/suite_N.txt); then, alone on the GPU, the files whose engines size their KV cache from
  # free memory or measure it (another process's memory would skew them). SUITE_GROUPS picks
  # groups (e.g. "2 4 serial"), SUITE_FILES_<group> other files or test ids for one, SUITE_ARGS
  # more pytest arguments. Session 42's first call, on a fresh machine, ran ~85% of the suite in
  # 455 s in five groups (groups 4 and 5 below were one, and test_greedy_graph_step.py was in
  # group 2); the groups were rebalanced after it. Session 43's call of these six (fresh machine,
  # BUDGET_S=540, so 389 s for the groups) finished groups 3 and 5 (288 s, 214 s); 1, 2, 4 and 6
  # and the serial files need a second call (SUITE_GROUPS="1 2 4 6 serial", or by file with
  # SUITE_FILES_<group>): the engine tests compile for 45-120 s each under this load. Each
  # test's time is in the logs. The call returns 8 files (6 groups, serial, results.json): the
  # compile caches do not come back. SUITE_FROM=FILE runs group 6's files from FILE on instead,
  # spread over the six groups (the serial group as it is).
  declare -A groups=(
    [1]="tests/test_engine.py tests/test_greedy_graph_step.py"
    [2]="tests/test_gpu_graphs.py tests/test_prefill_graph.py tests/test_decode_graphs.py
         tests/test_warmup.py"
    [3]="tests/test_engine_bad_input.py tests/test_scheduler_audit.py tests/test_generation_config.py
         tests/test_fp8_cache.py tests/test_detok_audit.py tests/test_sampling_audit.py"
    [4]="tests/test_compile_decode_kernel.py tests/test_decode_head.py tests/test_decode_layer.py
         tests/test_decode_layer_probe.py tests/test_decode_mlp.py tests/test_decode_stem.py
         tests/test_gpu_compile.py"
    [5]="tests/test_kernels.py tests/test_kernels_audit.py tests/test_kernels_model.py
         tests/test_layer_kernel_probe.py tests/test_memory_read.py tests/test_norm_rope_store.py
         tests/test_sample_kernel.py tests/test_skinny_gemm.py"
  )
  serial="tests/test_gpu_memory.py tests/test_memory_budget.py tests/test_cli.py"
  taken=$(echo ${groups[@]} $serial)
  rest=$(ls tests/test_*.py | while read -r f; do case " $taken " in *" $f "*) ;; *) echo "$f" ;; esac; done)
  groups[6]=$(echo $rest)
  groups[serial]=$serial
  if [ -n "${SUITE_FROM:-}" ]; then
    # SUITE_FROM=FILE: group 6's files from FILE on (alphabetically), dealt out over groups 1-6
    # in turn (session 67's call was cut in group 6's tests/test_fp8_weights.py: from it on,
    # 57 files)
    i=0
    for g in 1 2 3 4 5 6; do groups[$g]=""; done
    for f in $(echo $rest | tr ' ' '\n' | awk -v from="$SUITE_FROM" '$0 >= from'); do
      g=$(( i % 6 + 1 )) i=$(( i + 1 ))
      groups[$g]="${groups[$g]} $f"
    done
  fi
  for g in "${!groups[@]}"; do  # SUITE_FILES_<group>: other files (or node ids) for that group
    override=SUITE_FILES_$g
    [ -n "${!override:-}" ] && groups[$g]=${!override}
  done
  limit=$(left_or 580) selected=" ${SUITE_GROUPS:-1 2 3 4 5 6 serial} "
  # the serial group's share of the call (SERIAL_S, default 150 s), when it runs
  case $selected in *" serial "*) limit=$(( limit - ${SERIAL_S:-150} )) ;; esac
  for g in $selected; do
    [ "$g" = serial ] && continue
    STEP_LOG=$OUT/suite_$g.txt step suite_$g $limit python3 -m pytest $PYTEST_ARGS \
      --durations=25 ${SUITE_ARGS:-} ${groups[$g]} > /dev/null &
  done
  wait
  case $selected in *" serial "*)
    STEP_LOG=$OUT/suite_serial.txt step suite_serial $(left_or 580) python3 -m pytest \
      $PYTEST_ARGS --durations=25 ${SUITE_ARGS:-} ${groups[serial]} ;;
  esac
  grep -hE "^(FAILED|ERROR)|passed|failed" $OUT/suite_*.txt | tail -40
  ;;
kv_budget)
  # nvidia-h200 (<= 450 s on a fresh machine): the KV budget where it binds (utilization 0.3):
  # the device's peak under the limit with the prefill graphs on, then off. Session 29 found
  # both over by 0.56 / 0.95 GiB at 9968491; it then emptied the allocator's cache after the
  # warm-up, let the graphs' logits share their pools (graphs.unowned) and set aside the
  # decode graphs' pool (the runner logs the budget's parts and memory after each phase).
  step kv_budget_on 250 python3 benchmarks/kv_budget_check.py --json "$RESULTS/kv_budget_on.json"
  MINIVLLM_PREFILL_GRAPH=0 step kv_budget_off 120 python3 benchmarks/kv_budget_check.py \
    --json "$RESULTS/kv_budget_off.json"
  ;;
fp8_ab)
  # nvidia-h200 (~170 s for the first run on a fresh machine, ~60 s each after): the throughput
  # run with a bf16 and an fp8 KV cache, alternating (session 29's one fp8 run, 28,807 tok/s on a
  # fresh machine, had no bf16 run beside it; sessions 14-15 measured 29,800-30,800).
  # Every run records its steps: step_floor.py splits them into host work and waiting (session
  # 31: the fp8 run at 41% of its floor is likely bound by the host at large batches).
  for run in ${RUNS:-1_bf16 2_fp8 3_bf16 4_fp8}; do
    dtype=auto kv_bytes=2; [ "${run##*_}" = fp8 ] && dtype=fp8 kv_bytes=1
    [ $(( BUDGET_S - SECONDS )) -lt 60 ] && break
    step "bench_$run" $(left_or 250) python3 -m minivllm bench --shape qwen3-0.6b --kv-cache-dtype $dtype \
      --json "$RESULTS/bench_$run.json" --step-times "$OUT/steps_$run.json"
    python3 benchmarks/step_floor.py "$OUT/steps_$run.json" --kv-bytes $kv_bytes | \
      tee -a "$OUT/logs.txt"
  done
  ;;
fp8_cache)
  # nvidia-h200 or nvidia-h100-x1 (<= 560 s): session 59 made the reference backend and the Triton
  # prefill kernel read every token before a query from an fp8 cache (this step's too, written
  # before attention), as decoding reads them. Its GPU tests first: the fp8 cache against its
  # oracle (one token a step over a cache rounded after each), the graphs against eager with an
  # fp8 cache, speculation over an fp8 cache against the plain engine. Its prompt steps changed:
  # the throughput runs follow in the same budget with `RUNS="1_fp8 2_bf16" ... fp8_cache fp8_ab`.
  STEP_LOG=$OUT/tests.txt step fp8_tests $(left_or 240) python3 -m pytest $PYTEST_ARGS \
    tests/test_fp8_cache.py "tests/test_gpu_graphs.py::test_graphs_and_async_scheduling_equal_eager[bfloat16-fp8-cache]" \
    "tests/test_spec_decode.py::test_fp8_kv_cache_outputs_equal_the_plain_engines" \
    "tests/test_draft_model.py::test_self_draft_over_an_fp8_cache_accepts_every_draft"
  ;;
host_ab)
  # nvidia-h200 (<= 590 s on a fresh machine): host cuts against OLD (an unpacked tree: git
  # archive REV | tar -x -C dbg/old), alternating, every run's steps split into host work and
  # waiting by step_floor.py; then test_engine.py (eager engines on CUDA since session 32) for
  # the time left. RUNS names each run N_SIDE_KV (side new or old, KV cache bf16 or fp8). Session
  # 31 ran its cuts with the default; session 47's (07d70f6, 3f2143d: host_cost.py ~40% fewer
  # ms a step at 256 rows on the CPU machine) want the fp8 cache, whose run the host bounds:
  # RUNS="1_new_fp8 2_old_fp8 3_new_fp8 4_old_fp8 5_new_bf16 6_old_bf16". Session 49 ran the
  # fp8 ones: host ms a step down ~35%, every bucket's seconds equal (the device bounds the run).
  if [ ! -d "${OLD:-}/minivllm" ]; then
    echo "host_ab: set OLD to an unpacked tree to compare against (OLD=dbg/old)" >&2
    exit 2
  fi
  OLD=$(cd "$OLD" && pwd) NEW=$PWD
  for run in ${RUNS:-1_new_bf16 2_old_bf16 3_new_fp8 4_new_bf16 5_old_bf16}; do
    left=$(( BUDGET_S - SECONDS ))
    [ $left -lt 60 ] && break
    side=${run#*_}; side=${side%_*} dtype=auto kv_bytes=2
    [ "${run##*_}" = fp8 ] && dtype=fp8 kv_bytes=1
    tree=$NEW; [ "$side" = old ] && tree=$OLD
    (cd "$tree" && step "bench_$run" $(left_or 200) python3 -m minivllm bench \
      --shape qwen3-0.6b --kv-cache-dtype $dtype --json "$RESULTS/bench_$run.json" \
      --step-times "$OUT/steps_$run.json")
    python3 benchmarks/step_floor.py "$OUT/steps_$run.json" --kv-bytes $kv_bytes | \
      tee -a "$OUT/logs.txt"
    gzip -f "$OUT/steps_$run.json"
  done
  left=$(( BUDGET_S - SECONDS ))
  if [ $left -gt 30 ]; then
    STEP_LOG=$OUT/tests.txt step tests $left python3 -m pytest $PYTEST_ARGS tests/test_engine.py
  fi
  ;;
profile)
  # nvidia-h200 (~500 s on a fresh machine): where a decode step's GPU time goes now that the
  # host no longer bounds it (session 32: host work 2.1-2.3 ms of a 5.85 ms bf16 step at 241-256
  # sequences): 8 traced steps of the throughput run from step 100 (~256 sequences) and from
  # step 700 (~100), bf16, then the same with an fp8 cache, whose mid-size steps lose most to
  # its floor (40% at 60-17 sequences); each trace summarized by trace_summary.py, host side
  # too: at 241-256 sequences the fp8 run's host took 3.54 ms a step against bf16's 2.06, and
  # barely waited, where the CPU machine counts the same host code paths for both orders (the
  # fp8 cache's longest-first costs ~0.15 ms there): a call that blocks would show.
  for run in ${RUNS:-bf16_100 bf16_700 fp8_100 fp8_700}; do
    left=$(( BUDGET_S - SECONDS ))
    [ $left -lt 60 ] && break
    dtype=auto; [ "${run%_*}" = fp8 ] && dtype=fp8
    step "trace_$run" $(left_or 200) python3 -m minivllm bench \
      --shape qwen3-0.6b --kv-cache-dtype $dtype --trace "$OUT/trace_$run.json" \
      --trace-from "${run#*_}" --json "$RESULTS/trace_$run.json"
    python3 benchmarks/trace_summary.py "$OUT/trace_$run.json" --top 30 | tee -a "$OUT/logs.txt"
    rm -f "$OUT/trace_$run.json"  # ~100 MB; the summary is what is kept
  done
  # An fp8 cache's split counts at the tail's batches and contexts (it keeps 16 waves where a
  # 16-bit cache was re-tuned to 4 waves or none in session 24; 8 splits beat unsplit at 32).
  if [ -z "${RUNS:-}" ]; then
    for b in 32 64; do
      left=$(( BUDGET_S - SECONDS ))
      [ $left -lt 30 ] && break
      step "sweep_fp8_b$b" $(left_or 60) python3 \
        benchmarks/sweep_decode_attention.py --kv-cache-dtype fp8 --batch $b \
        --contexts 900-1824,1500-2400 --splits 1,2,4,8,16 --default-only
    done
  fi
  ;;
sync)
  # nvidia-h200 (<= 240 s): issue 5's engine loop: decode steps make the host wait for nothing but
  # their tokens (torch's sync debug mode "error"), bf16 and fp8 caches (session 32's new test).
  # `sync engine_tests` adds test_engine.py for the time left (its engines eager on CUDA but the
  # first: 19 of its 26 tests passed in ~125 s of session 32's call 3, the rest not reached).
  STEP_LOG=$OUT/tests.txt step sync_test $(left_or 240) python3 -m pytest $PYTEST_ARGS \
    tests/test_gpu_graphs.py -k never_make_the_host_wait
  ;;
mlp_probe)
  # nvidia-h200 (<= 580 s): the structural lever session 32 named for 64-256 rows, its first
  # half: a layer's six kernels after attention (o_proj to down, ~26 us at 256 rows in session
  # 33's trace) as one persistent launch of tensor-core tiles (kernels/decode_mlp.py, session
  # 33, CPU-tested only). The probe first (it checks each form's bf16 output against the
  # engine's too), from 256 rows down, its JSON saved after each row count, so a cut-short run
  # keeps the sizes that matter most; then the kernel's tests (bf16 and the whole grid).
  # MLP_PROBE_ARGS: the probe's options (session 34: "--deep --rows 256,128,64", the pipeline's
  # depth and the grid at the tilings session 34's --sweep found best; session 35's "--entry
  # --rows 256,128,64", both forms through the next layer's entry: in a9efa1b).
  step mlp_block_probe $(left_or 380) python3 benchmarks/mlp_block_probe.py \
    ${MLP_PROBE_ARGS:---sweep} --json "$RESULTS/mlp_block_probe.json"
  STEP_LOG=$OUT/tests.txt step mlp_tests $(left_or 200) python3 -m pytest $PYTEST_ARGS \
    tests/test_decode_mlp.py
  ;;
mlp_engine)
  # nvidia-h200 (<= 580 s): the engine's decode graphs of FUSED rows (default 3-128, the probe's
  # winning range) with decode_mlp in each layer: graphs against eager, the sync
  # test; then throughput with and without, alternating, while time is left.
  # (session 34: 3-128 rows are the engine's default; the base runs set MINIVLLM_FUSED_MLP=0, off)
  FUSED=${FUSED:-3-128}
  # (session 33: the sync test's two cases took 161 s on a fresh machine; one case of each here)
  # FUSED_TESTS=0: the throughput runs only (session 34: four runs from cold caches fill a call)
  # (session 35's FUSED_ENTRY=1 and *_entry runs, MINIVLLM_FUSED_ENTRY: in a9efa1b)
  [ "${FUSED_TESTS:-1}" = 1 ] && MINIVLLM_FUSED_MLP=1-256 STEP_LOG=$OUT/tests.txt \
    step fused_graph_tests $(left_or 200) python3 -m pytest $PYTEST_ARGS tests/test_gpu_graphs.py -k \
    "(graphs_and_async_scheduling_equal_eager and bfloat16) or (never_make_the_host_wait and auto)"
  # MLP_TESTS=0: not the kernel's own tests (after mlp_probe in the same call, which ran them)
  [ "${FUSED_TESTS:-1}" = 1 ] && [ "${MLP_TESTS:-1}" = 1 ] && STEP_LOG=$OUT/tests.txt \
    step mlp_tests $(left_or 120) python3 -m pytest $PYTEST_ARGS tests/test_decode_mlp.py
  for run in ${FUSED_RUNS:-1_fused 2_base 3_fused 4_base}; do
    left=$(( BUDGET_S - SECONDS ))
    [ $left -lt 60 ] && break
    # A run's suffix: base (MINIVLLM_FUSED_MLP=0) or fused (FUSED's rows; FUSED=default leaves
    # MINIVLLM_FUSED_MLP unset, the engine's default rows).
    if [ "${run#*_}" = base ]; then flag=(env MINIVLLM_FUSED_MLP=0)
    elif [ "$FUSED" = default ]; then flag=(env -u MINIVLLM_FUSED_MLP)
    else flag=(env MINIVLLM_FUSED_MLP=$FUSED); fi
    step "bench_$run" $(left_or 200) "${flag[@]}" python3 -m minivllm bench --shape qwen3-0.6b \
      --json "$RESULTS/bench_$run.json"
  done
  ;;
block_size)
  # nvidia-h200 (<= 580 s): throughput at KV pages of 16 tokens (the default, vLLM's) against
  # larger ones (nano-vllm's 256), alternating while time is left. A 128-token tile of the
  # decode kernel gathers its rows from 8 pages at 16 tokens, from one at 128 or more. Session
  # 36: 256 level with 16, 32-128 2% slower; the default stays 16.
  for run in ${RUNS:-1_16 2_256 3_64 4_32 5_128 6_16 7_256 8_64}; do
    [ $(( BUDGET_S - SECONDS )) -lt 60 ] && break
    step "bench_bs$run" $(left_or 200) python3 -m minivllm bench --shape qwen3-0.6b \
      --block-size ${run#*_} --json "$RESULTS/bench_bs$run.json"
  done
  ;;
inductor_knobs)
  # nvidia-h200 (<= 580 s on a fresh machine): two Inductor switches that change only how its
  # own kernels (the layer's norms, SiLU-and-mul, residual adds: ~0.3 ms of a 256-row step with
  # their gaps) are generated, against the defaults, throughput runs in turn:
  #   pdl: TORCHINDUCTOR_ENABLE_PDL=1, programmatic dependent launch on Hopper (a kernel launches
  #     while the one before it ends, and waits inside for its inputs; no-op where this torch
  #     lacks the switch). Session 9 measured it on the skinny GEMM alone (slower by 0.1-0.4 us);
  #     Inductor's kernels never had it.
  #   cdt: TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1, Inductor times block sizes around its
  #     heuristic's pick for each pointwise and reduction kernel at compile time.
  # Each switch compiles its own kernels: a side's first run compiles (~120 s on a fresh
  # machine; cdt's tuning longer), its later runs are warm (~50 s). Runs go on while the call
  # has time (BUDGET_S), each limited to what is left.
  for run in ${RUNS:-1_base 2_pdl 3_base 4_pdl 5_cdt 6_base 7_cdt}; do
    left=$(( BUDGET_S - SECONDS ))
    [ $left -lt 60 ] && break
    pdl=0 cdt=0
    case ${run#*_} in pdl) pdl=1 ;; cdt) cdt=1 ;; esac
    TORCHINDUCTOR_ENABLE_PDL=$pdl TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=$cdt \
      step "bench_$run" $(left_or 250) python3 -m minivllm bench \
      --shape qwen3-0.6b --json "$RESULTS/bench_$run.json"
  done
  ;;
graph_tests)
  # nvidia-h200 (<= 420 s): session 29's memory tests: an engine sized from free memory stays
  # within gpu_memory_utilization (test_gpu_memory.py); then test_gpu_graphs.py: the graphs
  # against the eager engine, with (session 29) the graphs' logits sharing their pool: buckets
  # in turn equal eager, and the decode pool holds one bucket's logits at a real vocabulary.
  STEP_LOG=$OUT/tests.txt step tests 400 python3 -m pytest $PYTEST_ARGS tests/test_gpu_memory.py \
    tests/test_gpu_graphs.py
  ;;
memory)
  # nvidia-h200 (<= 560 s on a fresh machine): test_gpu_memory.py with the runner's start-up
  # lines (the budget's parts; memory by phase and by owner: allocator pools and outside them),
  # then kv_budget_check.py at the 0.6B shape, prefill graphs on and off. Session 30's calls 2-3
  # ran earlier forms of this mode and memory_fix (in d06bec7); the test was 0.25 GiB over there,
  # before start-up left the heaviest sampling's blocks in the allocator's cache.
  # Session 31's call 1 found 62f4490's start-up failing on memory_snapshot(device) and the
  # sampling blocks reserving 1.97 GiB against the 1.59 set aside; call 2 the cache 0.08-0.10 GiB
  # past its bytes (2 MiB segments) and the decode graphs loading 0.086 GiB of code; all three
  # within the limit at b07b437. Since d4a6695 the sampler works in place (~6 [B, V] fp32
  # temporaries against 8.6 counted on the CPU): the probe's figures measure it on the GPU.
  step sampling_blocks 60 python3 benchmarks/sampling_blocks_probe.py
  STEP_LOG=$OUT/tests.txt step memory_test 230 python3 -m pytest $PYTEST_ARGS -o log_cli=true \
    --log-cli-level=INFO tests/test_gpu_memory.py
  step kv_budget_on 180 python3 benchmarks/kv_budget_check.py --json "$RESULTS/kv_budget_on.json"
  MINIVLLM_PREFILL_GRAPH=0 step kv_budget_off 110 python3 benchmarks/kv_budget_check.py \
    --json "$RESULTS/kv_budget_off.json"
  ;;
green)
  # nvidia-h200 (<= 560 s): session 37: the batch's halves ping-pong with the GEMMs on a green
  # context of G SMs and the attentions on the rest (two_stream_probe.py's green-G), against the
  # engine's layer and session 24's unpartitioned ping-pong; then the attention sweep's default
  # config (its engine form stores each row's K/V in its own slot since 75fed8c: first GPU run).
  step green_probe 400 python3 benchmarks/two_stream_probe.py --seqs ${GREEN_SEQS:-256,128} \
    --contexts 200-1124 --json "$RESULTS/green_probe.json" \
    --modes ${GREEN_MODES:-one,pingpong,green-16,green-24,green-32,greengemm-24}
  step sweep_attention $(left_or 120) python3 benchmarks/sweep_decode_attention.py --default-only
  ;;
tma)
  # nvidia-h200 (<= 300 s): session 37: decode attention with TMA tile loads against the same
  # loop with pointer loads and the engine's kernel, pages of 128 and 256 (tma_decode_probe.py)
  for page in ${TMA_PAGES:-128 256}; do
    step tma_probe_$page $(left_or 140) python3 benchmarks/tma_decode_probe.py --page $page \
      ${TMA_ARGS:-}
  done
  ;;
packed)
  # nvidia-h200 (<= 300 s): session 37: decode attention with a sequence's KV heads in one
  # program (packed_decode_probe.py) against the engine's kernel, page 16
  step packed_probe $(left_or 280) python3 benchmarks/packed_decode_probe.py ${PACKED_ARGS:-}
  ;;
layout)
  # nvidia-h200 (<= 300 s): session 38: kv_layout_probe.py, page 16 (LAYOUT_ARGS for others)
  step layout_probe $(left_or 280) python3 benchmarks/kv_layout_probe.py ${LAYOUT_ARGS:-}
  ;;
kvpf)
  # nvidia-h200 (<= 560 s): session 44: the next layer's first cache pages asked into L2 after
  # each attention (two_stream_probe.py's kvpf modes, benchmarks/kv_prefetch.py) against the
  # same layer in pieces without it and the engine's layer
  step kvpf_probe $(left_or 540) python3 benchmarks/two_stream_probe.py --seqs ${KVPF_SEQS:-256,128,64} \
    --contexts ${KVPF_CONTEXTS:-200-1124} --json "$RESULTS/kvpf_probe.json" \
    --modes ${KVPF_MODES:-one,pieces,kvpf-48-8,kvpfside-48-8,kvpfside-24-8,kvpfside-96-8,kvpfside-48-4,kvpfside-48-16,pieces}
  ;;
probes)
  # nvidia-h200 (<= 360 s): what the first LM-head GEMM at a new row count costs the host; the
  # decode head's program counts beside cuBLAS's GEMV; the decode attention kernel at 256
  # sequences; the skinny GEMM's configs beside cuBLAS.
  step head_first_call 60 python3 benchmarks/head_first_call.py --json "$RESULTS/head_first_call.json"
  step sweep_head 60 python3 benchmarks/sweep_decode_head.py
  step sweep_attention 150 python3 benchmarks/sweep_decode_attention.py
  step sweep_gemm 90 python3 benchmarks/sweep_decode_gemm.py
  ;;
*)
  echo "usage: $0 MODE... (each of speed|suite|figures|profile|sync|mlp_probe|mlp_engine|inductor_knobs|host_ab|prefill_graph|prefill_default|kv_budget|fp8_ab|graph_tests|engine_tests|memory|rounding|tp|tp_engine|tp8b|agreement|tp_trained|ab|green|tma|packed|kvpf|probes|attention_tail|head_cast|norm_rope)" >&2
  exit 2
  ;;
esac
done
