"""Teacher-forced top-1 agreement of minivllm with transformers at a real Qwen3 shape.

A transformers Qwen3ForCausalLM with random weights (its own initialiser) is saved as a checkpoint
and loaded by minivllm.load; both read the same random token sequence and, at each position, we
compare the arg-max of the next-token logits. minivllm is run twice: one prefill over the whole
sequence, and token by token through the decode path. Both models run in the given dtype on the GPU.
With --kv-cache-dtype fp8 the cache is fp8: only the decode path reads it (the prefill's tokens are
used as computed), so decode_top1_agreement is the figure that shows it.

    python benchmarks/agreement.py --shape qwen3-0.6b --positions 256 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

import minivllm
import minivllm.kernels
from minivllm.state import SHAPES, SeqChunk, make_batch


def hf_model_for_shape(shape: str, dtype: torch.dtype, device, seed: int, init_std: float = 0.02):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = SHAPES[shape]
    config = Qwen3Config(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                         intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
                         num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
                         head_dim=s["head_dim"], tie_word_embeddings=s["tie_word_embeddings"],
                         rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                         initializer_range=init_std)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.02,
                    help="std of the random weights (transformers' initializer_range; 0.02 by default, "
                         "which gives nearly flat next-token distributions)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = minivllm.state.parse_dtype(args.dtype)

    model = hf_model_for_shape(args.shape, dtype, device, args.seed, args.init_std)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        params = minivllm.load(d, dtype=dtype, device=device)
    cache_dtype = minivllm.state.parse_kv_cache_dtype(args.kv_cache_dtype, dtype)
    backend = minivllm.kernels.select_backend(device, args.backend, cache_dtype)

    gen = torch.Generator().manual_seed(args.seed)
    n = args.positions
    ids = torch.randint(0, params.config.vocab_size, (n,), generator=gen).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids], device=device)).logits[0].float()  # [n, vocab]
        # The same weights in fp32: how far bf16 arithmetic itself moves the arg-max (noise floor).
        exact = model.float()(torch.tensor([ids], device=device)).logits[0]
        model.to(dtype)
    ref_top = ref.argmax(-1)
    exact_top = exact.argmax(-1)

    bs = 16
    table = list(range(-(-n // bs)))
    cache = minivllm.init_cache(params, num_blocks=len(table), block_size=bs, dtype=cache_dtype)
    batch = make_batch([SeqChunk(ids, 0, table)], block_size=bs, device=device, every_row=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        prefill_logits, cache = minivllm.forward(params, cache, batch, backend)
    prefill_agree = (prefill_logits.argmax(-1) == ref_top).float().mean().item()

    cache = minivllm.init_cache(params, num_blocks=len(table), block_size=bs, dtype=cache_dtype)
    decode_top = []
    with torch.no_grad():
        for pos, tok in enumerate(ids):
            step = make_batch([SeqChunk([tok], pos, table)], block_size=bs, device=device)
            logits, cache = minivllm.forward(params, cache, step, backend)
            decode_top.append(logits.argmax(-1))
    decode_agree = (torch.cat(decode_top) == ref_top).float().mean().item()
    top2 = ref.topk(2, dim=-1).values
    exact2 = exact.topk(2, dim=-1).values
    confident = (exact2[:, 0] - exact2[:, 1]) > 0.125
    result = {
        "shape": args.shape, "dtype": str(dtype), "init_std": args.init_std, "positions": n, "backend": backend.name,
        "kv_cache_dtype": str(cache_dtype),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "prefill_top1_agreement": prefill_agree, "decode_top1_agreement": decode_agree,
        "transformers_vs_fp32_top1_agreement": (ref_top == exact_top).float().mean().item(),
        "minivllm_vs_fp32_top1_agreement": (prefill_logits.argmax(-1) == exact_top).float().mean().item(),
        # Positions whose fp32 top-2 margin exceeds bf16's rounding of the logits (0.125 is 8 ulps
        # at |logit| ~ 2): where the arg-max is decided by the model, not by rounding.
        "confident_positions": int(confident.sum().item()),
        "prefill_top1_agreement_confident": (prefill_logits.argmax(-1) == ref_top)[confident].float().mean().item(),
        "decode_top1_agreement_confident": (torch.cat(decode_top) == ref_top)[confident].float().mean().item(),
        "transformers_vs_fp32_top1_agreement_confident": (ref_top == exact_top)[confident].float().mean().item(),
        "max_abs_logit_diff_prefill": (prefill_logits - ref).abs().max().item(),
        "median_top2_margin_reference": (top2[:, 0] - top2[:, 1]).median().item(),
        "seconds": time.perf_counter() - t0,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
