"""Teacher-forced top-1 agreement of minivllm with transformers at a real Qwen3 shape.

A transformers Qwen3ForCausalLM is loaded by minivllm.load from the same checkpoint: by default
one with random weights (its own initialiser, written to a temporary directory), or with
--checkpoint one that benchmarks/synthetic_lm.py trained, whose held-out sequences come from the
language it learned. Both read the same token sequence and, at each position, we compare the
arg-max of the next-token logits. minivllm is run twice: one prefill over the whole sequence,
and token by token through the decode path. Both models run in the given dtype. The same weights
in fp32 under transformers give the noise floor: how far the dtype's rounding alone moves
transformers' own arg-max. With --kv-cache-dtype fp8 the cache is fp8: only the decode path
reads it (the prefill's tokens are used as computed), so decode_top1_agreement is the figure
that shows it. With --engine-prompts N the engine (LLM: compiled, CUDA graphs on the GPU) also
generates greedily from N prompts, compared token by token with transformers' greedy generate.

    python benchmarks/agreement.py --shape qwen3-0.6b --positions 256 --dtype bfloat16
    python benchmarks/synthetic_lm.py --out /tmp/trained && \\
        python benchmarks/agreement.py --checkpoint /tmp/trained --positions 512 --engine-prompts 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import minivllm  # noqa: E402
import minivllm.kernels  # noqa: E402
from benchmarks.synthetic_lm import (LANGUAGE_FILE, MarkovLanguage, most_likely_next,  # noqa: E402
                                    qwen3_config, sample)
from minivllm.state import SHAPES, SeqChunk, make_batch  # noqa: E402


def random_checkpoint(path: str, shape: dict, seed: int, init_std: float, dtype, device) -> str:
    """A transformers Qwen3ForCausalLM of `shape` (a SHAPES entry) with its own random
    initialisation, saved in `dtype`."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        Qwen3ForCausalLM(qwen3_config(shape, init_std)).to(dtype).save_pretrained(path)
    return path


def teacher_forced(params, ids: list[int], backend, cache_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """minivllm's logits [n, vocab] (fp32) at every position: one prefill, and n single-token
    decodes (the only path that reads the cache, in cache_dtype; None: the weights' dtype)."""
    n, bs = len(ids), 16
    table = list(range(-(-n // bs)))
    cache = minivllm.init_cache(params, num_blocks=len(table), block_size=bs, dtype=cache_dtype)
    batch = make_batch([SeqChunk(ids, 0, table)], block_size=bs, device=params.device, every_row=True)
    with torch.no_grad():
        prefill, _ = minivllm.forward(params, cache, batch, backend)
        cache = minivllm.init_cache(params, num_blocks=len(table), block_size=bs, dtype=cache_dtype)
        decode = []
        for pos, tok in enumerate(ids):
            step = make_batch([SeqChunk([tok], pos, table)], block_size=bs, device=params.device)
            logits, cache = minivllm.forward(params, cache, step, backend)
            decode.append(logits)
    return prefill.float(), torch.cat(decode).float()


def engine_against_transformers(path: str, model, prompts: list[list[int]], max_tokens: int,
                                args, device) -> dict:
    """Greedy tokens of the engine (LLM) and of transformers' generate, prompt by prompt."""
    from minivllm import LLM, SamplingParams

    with torch.no_grad():
        ref = [model.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens,
                              do_sample=False, min_new_tokens=max_tokens)[0, len(p):].tolist()
               for p in prompts]
    with LLM(path, dtype=args.dtype, device=device.type, max_model_len=1024, num_kv_blocks=512,
             max_num_seqs=max(8, len(prompts)),  # few graphs to capture: this is about tokens
             kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.backend) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    same = [common_prefix(o.outputs[0].token_ids, r) for o, r in zip(outs, ref)]
    return {"prompts": len(prompts), "max_tokens": max_tokens,
            "identical_sequences": sum(s == max_tokens for s in same) / len(prompts),
            "common_prefix_fraction": sum(same) / (max_tokens * len(prompts)),
            "first_divergence": [s if s < max_tokens else None for s in same]}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--checkpoint", default=None,
                    help="a Qwen3 checkpoint directory (e.g. written by synthetic_lm.py) instead of "
                         "random weights of --shape")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.02,
                    help="std of the random weights (transformers' initializer_range; 0.02 by default, "
                         "which gives nearly flat next-token distributions)")
    ap.add_argument("--engine-prompts", type=int, default=0,
                    help="also compare the engine's greedy generation with transformers' on this "
                         "many prompts")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each engine prompt generates")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import Qwen3ForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = minivllm.state.parse_dtype(args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or random_checkpoint(tmp, SHAPES[args.shape], args.seed,
                                                    args.init_std, dtype, device)
        model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        params = minivllm.load(path, dtype=dtype, device=device)
        cache_dtype = minivllm.state.parse_kv_cache_dtype(args.kv_cache_dtype, dtype)
        backend = minivllm.kernels.select_backend(device, args.backend, cache_dtype)
        language_file = os.path.join(path, LANGUAGE_FILE)
        lang = MarkovLanguage.load(language_file) if os.path.exists(language_file) else None

        gen = torch.Generator().manual_seed(args.seed + 1000)  # not the training's draws
        n = args.positions
        if lang is not None:
            ids = sample(lang, 1, n, gen)[0]
        else:
            ids = torch.randint(0, params.config.vocab_size, (n,), generator=gen)
        with torch.no_grad():
            ref = model(ids[None].to(device)).logits[0].float()  # [n, vocab]
            # The same weights in fp32: how far the dtype's arithmetic itself moves the arg-max.
            exact = model.float()(ids[None].to(device)).logits[0]
            model.to(dtype)
        ref_top, exact_top = ref.argmax(-1), exact.argmax(-1)

        t0 = time.perf_counter()
        prefill_logits, decode_logits = teacher_forced(params, ids.tolist(), backend, cache_dtype)
        prefill_top, decode_top = prefill_logits.argmax(-1), decode_logits.argmax(-1)
        top2 = ref.topk(2, dim=-1).values
        exact2 = exact.topk(2, dim=-1).values
        confident = (exact2[:, 0] - exact2[:, 1]) > 0.125

        def agree(a, b, where=None):
            same = a == b
            return (same if where is None else same[where]).float().mean().item()

        result = {
            "shape": args.shape if args.checkpoint is None else
            {k: getattr(params.config, k) for k in ("vocab_size", "hidden_size", "num_layers", "num_heads")},
            "checkpoint": args.checkpoint or "random",
            "language": lang is not None,  # the positions come from synthetic_lm.py's language
            "dtype": str(dtype), "positions": n, "backend": backend.name,
            "kv_cache_dtype": str(cache_dtype),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "prefill_top1_agreement": agree(prefill_top, ref_top),
            "decode_top1_agreement": agree(decode_top, ref_top),
            "transformers_vs_fp32_top1_agreement": agree(ref_top, exact_top),
            "minivllm_vs_fp32_top1_agreement": agree(prefill_top, exact_top),
            # Positions whose fp32 top-2 margin exceeds bf16's rounding of the logits (0.125 is 8
            # ulps at |logit| ~ 2): where the arg-max is decided by the model, not by rounding.
            "confident_positions": int(confident.sum().item()),
            "prefill_top1_agreement_confident": agree(prefill_top, ref_top, confident),
            "decode_top1_agreement_confident": agree(decode_top, ref_top, confident),
            "transformers_vs_fp32_top1_agreement_confident": agree(ref_top, exact_top, confident),
            "max_abs_logit_diff_prefill": (prefill_logits - ref).abs().max().item(),
            "max_abs_logit_diff_decode": (decode_logits - ref).abs().max().item(),
            "median_top2_margin_reference": (top2[:, 0] - top2[:, 1]).median().item(),
            "seconds": time.perf_counter() - t0,
        }
        if args.checkpoint is None:
            result["init_std"] = args.init_std
        if lang is not None:
            # How well the model learned the chain: its fp32 arg-max against the chain's mode.
            result["fp32_top1_is_the_chains_mode"] = agree(exact_top.cpu(), most_likely_next(lang, ids))
        report(result, args.json)  # the teacher-forced part now, in case the engine's start runs long
        if args.engine_prompts:
            g = torch.Generator().manual_seed(args.seed + 2000)
            lengths = torch.randint(16, 129, (args.engine_prompts,), generator=g).tolist()
            prompts = ([sample(lang, 1, k, g)[0].tolist() for k in lengths] if lang is not None else
                       [torch.randint(0, params.config.vocab_size, (k,), generator=g).tolist()
                        for k in lengths])
            del params
            result["engine_greedy_vs_transformers"] = engine_against_transformers(
                path, model, prompts, args.max_tokens, args, device)
            report(result, args.json)


def report(result: dict, json_path: str | None) -> None:
    print(json.dumps(result, indent=1), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
