"""Does a sampling feature cost far more than it should? One engine, one batch of prompts, each
feature's output tok/s beside plain sampling's.

    PYTHONPATH=. python benchmarks/feature_speed.py [--model random:qwen3-0.6b] [--num-seqs 64]
        [--prompt-len 256] [--output-len 128] [--features sample,logprobs,...] [--json PATH]

Session 62 timed the AWQ engine's single stream for the first time: 14 tok/s, 11x below the dense
model's, on a path whose GPU tests had passed. The sampling features have passed theirs, most on
the CPU, and were never timed on a GPU either. This runs each over the same prompts (random ids,
ignore_eos, fixed lengths, so every feature decodes the same steps; their prefill, done once
before, served by the prefix cache) on one engine and prints its
output tok/s and its ratio to plain sampling (temperature 0.6, nano-vllm's), which runs first and
last: their difference bounds what a ratio means. A feature well below 1 is a lead, not a
verdict: logprobs, prompt logprobs and beams read more back from the device each step by design.
n4 samples 4 completions of a quarter of the prompts, beam4 searches 4 beams of a quarter of them
(the same sequences in flight). --lora-rank R starts the engine with LoRA enabled (its steps
without adapter rows, plain sampling's, replay the base model's graphs) and adds "lora": every
request with one random adapter of rank R on all seven linears (its prefill done once before
too: the prefix cache keeps each adapter's apart, the KV cache has room for both sets of
prompts, and each run's prompts are primed in it just before); run without it to compare the
plain figures. Each run records the share of its prompt tokens the prefix cache held (all full
blocks, unless something evicted them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

from minivllm import LLM, BeamSearchParams, LoRARequest, SamplingParams
from minivllm.state.config import ceil_div

PLAIN = dict(temperature=0.6)


def feature_params(vocab: int, output_len: int) -> dict[str, dict]:
    """name -> the SamplingParams fields a feature adds to plain sampling's."""
    spread = list(range(0, min(vocab, 20_000), 200))  # 100 ids across the vocabulary
    return {
        "sample": {},
        "greedy": dict(temperature=0.0),
        "top_p_top_k": dict(top_p=0.9, top_k=50),
        "min_p": dict(min_p=0.05),
        "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
        "logit_bias": dict(logit_bias={i: 1.0 for i in spread}),
        "allowed_token_ids": dict(allowed_token_ids=list(range(min(vocab, 1000)))),
        "min_tokens": dict(min_tokens=output_len, stop_token_ids=spread[:10]),
        "seeded": "seeded",  # a seed per request
        "logprobs": dict(logprobs=5),
        "prompt_logprobs": dict(prompt_logprobs=1),
        "n4": "n4",
        "beam4": "beam4",
    }


def write_random_adapter(path: str, config, rank: int, seed: int = 0) -> str:
    """A PEFT LoRA directory at `path` for a model of `config` (a ModelConfig): random A [rank,
    in] and B [out, rank] (std 0.01) for every layer's seven linears."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    dims = {"self_attn": {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)},
            "mlp": {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for n in range(config.num_layers):
        for parent, modules in dims.items():
            for m, (n_in, n_out) in modules.items():
                key = f"base_model.model.model.layers.{n}.{parent}.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                       bias="none", lora_dropout=0.0, task_type="CAUSAL_LM"), f)
    return path


BLOCK_SIZE = 16  # the engine's default KV block


def run_feature(llm: LLM, name: str, extra, prompts: list[dict], output_len: int
                ) -> tuple[int, float, float | None]:
    """(output tokens, seconds, the share of its prompts' tokens the prefix cache held) of one
    feature's run over `prompts`."""
    base = dict(PLAIN, max_tokens=output_len, ignore_eos=True)
    if isinstance(extra, LoRARequest):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(**base), use_tqdm=False, lora_request=extra)
        seconds = time.perf_counter() - t0
        return sum(len(c.token_ids) for o in outs for c in o.outputs), seconds, cached_share(outs)
    if name == "beam4":
        few = prompts[:max(1, len(prompts) // 4)]
        params = BeamSearchParams(beam_width=4, max_tokens=output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.beam_search(few, params)
        seconds = time.perf_counter() - t0
        lens = {len(p["prompt_token_ids"]) for p in few}
        return (sum(len(b.tokens) - min(lens) for o in outs for b in o.sequences), seconds,
                None)  # beam search's outputs carry no cached count
    if extra == "n4":
        few = prompts[:max(1, len(prompts) // 4)]
        params = [SamplingParams(**base, n=4)] * len(few)
    elif extra == "seeded":
        few, params = prompts, [SamplingParams(**base, seed=i) for i in range(len(prompts))]
    else:
        few, params = prompts, [SamplingParams(**{**base, **extra})] * len(prompts)
    t0 = time.perf_counter()
    outs = llm.generate(few, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outs for c in o.outputs), seconds, cached_share(outs)


def prime_prefix_cache(llm: LLM, extra, prompts: list[dict]) -> None:
    """Untimed, before each timed run: every prompt once more, one token each, under the run's
    adapter (or none), so that its prompts' blocks are the cache's most recently used. A run's
    new blocks evict the least recently freed first; without this, the base runs' outputs came
    after the adapter's prompts and pushed them out (session 68: the adapter's run found 36% of
    its prompt tokens cached on the H200, the base runs 94%, all their full blocks)."""
    lora = extra if isinstance(extra, LoRARequest) else None
    llm.generate(prompts, SamplingParams(**PLAIN, max_tokens=1), use_tqdm=False,
                 lora_request=lora)


def cached_share(outs) -> float:
    """The share of the requests' prompt tokens that the prefix cache held when they came."""
    return sum(o.num_cached_tokens for o in outs) / sum(len(o.prompt_token_ids) for o in outs)


def device_allocs(device: torch.device) -> int | None:
    """The caching allocator's cudaMalloc calls so far (None off CUDA): a timed run that makes
    any waits on them, which its figure would not show otherwise."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device)["num_device_alloc"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--features", default=None, help="comma-separated (default: all)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="enable LoRA and add the feature \"lora\" (an adapter of this rank)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    known = list(feature_params(1, 1)) + (["lora"] if args.lora_rank else [])
    names = args.features.split(",") if args.features else known
    unknown = [n for n in names if n not in known]
    if unknown:  # before the engine starts
        raise ValueError(f"unknown features {unknown}; known: {', '.join(known)}")
    start = time.perf_counter()
    max_model_len = args.prompt_len + args.output_len + 16
    # Room for every sequence twice over: the engine's own sizing (every sequence at full
    # length, where memory allows) holds one set of the prompts' blocks and the runs' outputs,
    # and with LoRA the adapter's run caches the same prompts under its own key; in one set's
    # room each switch between the base model and the adapter evicted the other's prompts, and
    # the next run prefilled them again in its timed seconds (session 67: plain sampling in the
    # LoRA engine 10% behind, greedy, run after another base run, level). Room alone is not
    # enough: prime_prefix_cache, before each timed run, keeps its prompts the last evicted.
    num_kv_blocks = 2 * args.num_seqs * ceil_div(max_model_len, BLOCK_SIZE)
    llm = LLM(args.model, max_num_seqs=args.num_seqs, device=args.device,
              max_model_len=max_model_len, block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
              enforce_eager=args.enforce_eager, enable_lora=args.lora_rank > 0,
              max_lora_rank=args.lora_rank or 16)
    start = time.perf_counter() - start
    print(f"engine start {start:.1f} s", flush=True)
    vocab = llm.engine.vocab_size
    features = feature_params(vocab, args.output_len)
    if args.lora_rank:
        path = write_random_adapter(tempfile.mkdtemp(prefix="feature_speed_lora_"),
                                    llm.engine.model_config, args.lora_rank)
        features["lora"] = LoRARequest("feature_speed", 1, path)
    rng = random.Random(0)
    ids = min(vocab, 10_000)
    prompts = [{"prompt_token_ids": [rng.randrange(ids) for _ in range(args.prompt_len)]}
               for _ in range(args.num_seqs)]
    # Untimed: the prompts' prefill (the prefix cache then serves every timed run's prompts, so
    # that the runs differ by their decode steps only) and the engine's first steps.
    run_feature(llm, "sample", {}, prompts, args.output_len)
    if "lora" in names:
        run_feature(llm, "lora", features["lora"], prompts, args.output_len)
    order = ["sample"] + [n for n in names if n != "sample"] + ["sample"]
    results = []
    for i, name in enumerate(order):
        prime_prefix_cache(llm, features[name], prompts)
        allocs = device_allocs(llm.engine.config.device)
        tokens, seconds, cached = run_feature(llm, name, features[name], prompts,
                                              args.output_len)
        allocs = None if allocs is None else device_allocs(llm.engine.config.device) - allocs
        results.append({"feature": name, "output_tokens": tokens, "seconds": seconds,
                        "output_tok_per_s": tokens / seconds, "run": i,
                        "cuda_mallocs": allocs, "cached_prompt_share": cached})
    plain = [r["output_tok_per_s"] for r in results if r["feature"] == "sample"]
    for r in results:
        r["ratio_to_plain"] = r["output_tok_per_s"] / plain[0]
        cached = "" if r["cached_prompt_share"] is None else \
            f"  prompts cached {r['cached_prompt_share']:.0%}"
        mallocs = "" if r["cuda_mallocs"] is None else f"  cudaMalloc calls {r['cuda_mallocs']}"
        print(f"{r['feature']:18s} {r['output_tokens']:7d} tokens {r['seconds']:7.2f} s "
              f"{r['output_tok_per_s']:9.0f} tok/s  {r['ratio_to_plain']:.2f}{cached}{mallocs}",
              flush=True)
    print(f"plain sampling first and last: {plain[0]:.0f} and {plain[-1]:.0f} tok/s "
          f"({torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "num_seqs": args.num_seqs,
                       "lora_rank": args.lora_rank, "prompt_len": args.prompt_len,
                       "output_len": args.output_len, "engine_start_s": start,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
