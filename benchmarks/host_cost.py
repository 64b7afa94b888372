"""Host cost per decode step of the real engine on CPU, model compute stubbed out.

The runner takes its CUDA-graph decode path (DecodeGraphs built with compile_forward=False, never
captured): step_input, make_sampling_batch, fill, _feed_back, PendingStep all run for real; only
replay (the forward) and sample are replaced by stand-ins returning tensors of the right shape.
Prefill steps go through _run with a stubbed forward. Asynchronous scheduling, as on the GPU.

--prefill: instead, the host time of each step while nano-vllm's 256 prompts (100-1024 tokens)
are prefilled, 8192 tokens a step, the prefill forward stubbed too.

--ending: instead, 256 sequences that end one after another (max_tokens U[150, 600]), as in the
throughput workload, where a sequence ends every few steps and each such step rebuilds the
sampling batch and feeds tokens back through a gather: the median step while more than 200 run.
(The default batch never changes, so every step reuses its sampling batch.)

usage: python benchmarks/host_cost.py [--prof B] [--steps N] [--prefill | --ending | --breakdown]
"""
import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time

sys.path.insert(0, "tests")
import torch
from hf_tiny import make_hf_model, save_checkpoint

from minivllm import LLM, SamplingParams
from minivllm.functional.sampling import SampleOutput
from minivllm.runtime import runner as runner_mod
from minivllm.runtime.graphs import DecodeGraphs
from minivllm.state.config import ceil_div

VOCAB = 1000
torch.set_num_threads(1)


def stub(llm):
    r = llm.engine.runner
    logits = torch.zeros(4096, VOCAB)
    toks = torch.arange(4096, dtype=torch.int64) % 997 + 1

    def fake_forward(params, cache, batch, backend, **kw):
        return logits[: batch.logits_indices.shape[0]], cache

    def fake_sample(lg, sb):
        return SampleOutput(token_ids=toks[: lg.shape[0]].clone())

    runner_mod.forward = fake_forward
    runner_mod.sample = fake_sample
    g = DecodeGraphs(r.params, r.cache, r.backend, max_num_seqs=r.config.max_num_seqs,
                     max_blocks_per_seq=ceil_div(r.config.max_model_len, r.block_size),
                     compile_forward=False)
    g.replay = lambda b: logits[:b]
    r.graphs = g


def make(model_dir, B, ending=False):
    """An engine with B sequences past their prompts. ending: their max_tokens U[150, 600], so
    that they end one after another, else 1000 for all (the batch never changes)."""
    llm = LLM(model_dir, num_kv_blocks=B * 130 + 16, block_size=16, max_num_seqs=256,
              max_num_batched_tokens=4096, attention_backend="reference", max_model_len=2048)
    stub(llm)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(100, 300))]}
               for _ in range(B)]
    max_tokens = [rng.randint(150, 600) if ending else 1000 for _ in range(B)]
    eng = llm.engine
    eng.add_requests(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m)
                               for m in max_tokens])
    while any(s.num_computed < s.prompt_len for s in eng.scheduler.sequences) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    return eng


def prefill_steps(model_dir, steps=20):
    """Host ms of each of the first `steps` steps of the throughput workload's prefill phase."""
    llm = LLM(model_dir, num_kv_blocks=256 * 130 + 16, block_size=16, max_num_seqs=256,
              max_num_batched_tokens=8192, attention_backend="reference", max_model_len=4096)
    stub(llm)
    llm.engine.runner.prefill_forward = runner_mod.forward  # the stub, as for the graphs
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(100, 1024))]}
               for _ in range(256)]
    eng = llm.engine
    eng.add_requests(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1000)] * 256)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def ending_steps(model_dir) -> list[float]:
    """Host ms of each decode step while more than 200 of 256 sequences run, their max_tokens
    U[150, 600] so that they end one after another."""
    eng = make(model_dir, 256, ending=True)
    times = []
    while len(eng.scheduler.running) > 200:
        t0 = time.perf_counter()
        eng.step(unfinished=False)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure(eng, steps, reps=5):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step(unfinished=False)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prof", type=int, default=0, help="cProfile this batch size")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--prefill", action="store_true", help="time the prefill phase's steps")
    ap.add_argument("--ending", action="store_true",
                    help="time decode steps of 256 sequences that end one after another")
    ap.add_argument("--breakdown", action="store_true",
                    help="split a 256-sequence decode step's host time into its phases")
    a = ap.parse_args()
    if a.breakdown:
        breakdown(steps=a.steps or 60)
        return
    if a.prefill:
        d = save_checkpoint(make_hf_model(std=0.3, vocab_size=VOCAB, max_position_embeddings=4096),
                            "/tmp/hc_model_4k")
        t = prefill_steps(d, a.steps or 20)
        print("host ms per step, prefill phase:", " ".join(f"{x:.1f}" for x in t))
        return
    d = save_checkpoint(make_hf_model(std=0.3, vocab_size=VOCAB, max_position_embeddings=2048), "/tmp/hc_model")
    if a.ending:
        t = ending_steps(d)
        print(f"ending sequences, >200 running: {len(t)} steps, host ms/step median "
              f"{statistics.median(t):.3f}")
        return
    for B, steps in ((1, 200), (256, 30)):
        if a.prof and a.prof != B:
            continue
        eng = make(d, B)
        steps = a.steps or steps
        if a.prof:
            prof = cProfile.Profile()
            prof.enable()
            measure(eng, steps, reps=1)
            prof.disable()
            pstats.Stats(prof).sort_stats(a.sort).print_stats(40)
            continue
        t = measure(eng, steps)
        print(f"B={B:4d}  host ms/step: min {min(t):.3f}  median {statistics.median(t):.3f}")


def breakdown(B=256, steps=60):
    """Real-time (no profiler) split of a step into its phases, by wrapping the phase methods."""
    import collections
    d = save_checkpoint(make_hf_model(std=0.3, vocab_size=VOCAB, max_position_embeddings=2048), "/tmp/hc_model")
    eng = make(d, B)
    acc = collections.Counter()

    def wrap(obj, name, label):
        f = getattr(obj, name)

        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t0
        setattr(obj, name, w)
    r = eng.runner
    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng, "step_input", "step_input")
    wrap(r, "launch", "launch")
    wrap(eng.scheduler, "advance", "advance")
    wrap(eng.scheduler, "resolve", "resolve")
    wrap(eng, "_postprocess", "postprocess")
    wrap(eng, "_count", "count")
    wrap(runner_mod, "make_sampling_batch", "  make_sampling_batch")
    wrap(r.graphs, "fill", "  fill")
    wrap(r, "_feed_back", "  feed_back")
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step(unfinished=False)
    total = (time.perf_counter() - t0) / steps * 1e3
    print(f"B={B} total {total:.3f} ms/step")
    for k, v in acc.items():
        print(f"  {k:24s} {v / steps * 1e3:.3f}")


if __name__ == "__main__":
    main()
