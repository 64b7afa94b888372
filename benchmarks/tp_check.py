"""TP=2 against TP=1 at a real Qwen3 shape with random weights, in bf16: teacher-forced top-1
agreement (prefill over the whole sequence, and token by token through the decode path) and
greedy generation through the engine (LLM(tensor_parallel_size=2): spawned NCCL worker, CUDA
graphs). Prints JSON.

A transformers Qwen3ForCausalLM with random weights is saved as a checkpoint; TP=1 and each TP=2
rank load it with minivllm.load (a rank reads only its slice). The noise floor is TP=1 in bf16
against TP=1 in fp32: TP=2 changes the order of the reductions, so it cannot agree with TP=1
better than bf16 agrees with itself where the top-2 margin is within rounding. "confident"
positions are those whose fp32 top-2 margin exceeds 0.125 (8 bf16 ulps at |logit| ~ 2).

    python benchmarks/tp_check.py                          # qwen3-0.6b, bf16, GPUs 0 and 1
    python benchmarks/tp_check.py --json benchmarks/results/tp_check.json
    python benchmarks/tp_check.py --device cpu --dtype float32 --layers 2 --vocab-size 1024 \\
        --positions 32 --prompts 2 --max-tokens 8    # a smoke test on CPU (gloo)

With --checkpoint DIR (written by benchmarks/synthetic_lm.py) the model is one trained on a
synthetic language, and the teacher-forced sequence and the prompts are drawn from it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import minivllm  # noqa: E402
import minivllm.kernels  # noqa: E402
from benchmarks.agreement import common_prefix, random_checkpoint, teacher_forced  # noqa: E402
from benchmarks.synthetic_lm import LANGUAGE_FILE, MarkovLanguage, sample, shape_of  # noqa: E402
from minivllm.runtime.distributed import exit_now  # noqa: E402
from minivllm.state import SHAPES, ShardSpec  # noqa: E402


def _rank_main(rank: int, world: int, port: int, path: str, ids: list[int], args, out: str):
    """One rank of the TP=2 teacher-forced run; rank 0 saves its logits to `out`."""
    cuda = args.device != "cpu"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, **({"device_id": device} if cuda else {}))
    try:
        shard = ShardSpec(rank=rank, world_size=world, group=dist.group.WORLD)
        params = minivllm.load(path, dtype=args.dtype, device=device, shard=shard)
        backend = minivllm.kernels.select_backend(device, args.backend)
        prefill, decode = teacher_forced(params, ids, backend)
        if rank == 0:
            torch.save({"prefill": prefill.cpu(), "decode": decode.cpu(), "backend": backend.name}, out)
    finally:
        dist.destroy_process_group()
    exit_now(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def top1_stats(logits: torch.Tensor, ref: torch.Tensor, confident: torch.Tensor) -> dict:
    same = logits.argmax(-1) == ref.argmax(-1)
    return {"top1_agreement": same.float().mean().item(),
            "top1_agreement_confident": same[confident].float().mean().item(),
            "max_abs_logit_diff": (logits - ref).abs().max().item()}


def engine_greedy(path: str, tp: int, prompts: list[list[int]], args) -> tuple[list[list[int]], float]:
    from minivllm import LLM, SamplingParams

    kwargs = dict(dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
                  max_model_len=1024, max_num_seqs=max(16, len(prompts)), num_kv_blocks=1024,
                  enforce_eager=args.enforce_eager, attention_backend=args.backend)
    with LLM(path, **kwargs) as llm:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                            use_tqdm=False)
        seconds = time.perf_counter() - start
    return [o.outputs[0].token_ids for o in outs], seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--vocab-size", type=int, default=None, help="override the shape's vocabulary")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cuda (NCCL, GPUs 0 and 1) or cpu (gloo)")
    ap.add_argument("--backend", default=None, help="attention backend (default: the device's best)")
    ap.add_argument("--init-std", type=float, default=0.02, help="std of the random weights")
    ap.add_argument("--checkpoint", default=None,
                    help="a Qwen3 checkpoint (e.g. written by synthetic_lm.py) instead of random weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--positions", type=int, default=512, help="teacher-forced sequence length")
    ap.add_argument("--prompts", type=int, default=8, help="greedy prompts through the engine")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    ap.add_argument("--skip-engine", action="store_true", help="teacher-forced part only")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    if args.device != "cpu" and torch.cuda.device_count() < 2:
        raise SystemExit(f"tp_check needs 2 GPUs, {torch.cuda.device_count()} visible "
                         f"(--device cpu for the CPU smoke test)")
    dtype = minivllm.state.parse_dtype(args.dtype)
    device = torch.device("cuda", 0) if args.device != "cpu" else torch.device("cpu")
    result = {"shape": args.shape, "layers": args.layers, "vocab_size": args.vocab_size,
              "dtype": str(dtype), "init_std": args.init_std, "positions": args.positions,
              "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or random_checkpoint(
            os.path.join(tmp, "model"), shape_of(args.shape, args.layers, args.vocab_size),
            args.seed, args.init_std, dtype, device)
        result["checkpoint"] = "trained" if args.checkpoint else "random"
        if args.checkpoint:  # the shape is the checkpoint's, not --shape's
            result.update(shape=None, layers=None, vocab_size=None, init_std=None)
        result["checkpoint_seconds"] = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(args.seed)
        config = minivllm.ModelConfig.from_json(path)
        language_file = os.path.join(path, LANGUAGE_FILE)
        lang = MarkovLanguage.load(language_file) if os.path.exists(language_file) else None

        def draw(n: int, g: torch.Generator) -> list[int]:
            if lang is not None:
                return sample(lang, 1, n, g)[0].tolist()
            return torch.randint(0, config.vocab_size, (n,), generator=g).tolist()

        ids = draw(args.positions, gen)

        # TP=1, in the checkpoint's dtype and in fp32 (the noise floor), in this process.
        t = time.perf_counter()
        backend = minivllm.kernels.select_backend(device, args.backend)
        params = minivllm.load(path, dtype=dtype, device=device)
        ref_prefill, ref_decode = (t.cpu() for t in teacher_forced(params, ids, backend))
        del params
        exact, _ = teacher_forced(minivllm.load(path, dtype=torch.float32, device=device), ids, backend)
        exact = exact.cpu()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        top2 = exact.topk(2, dim=-1).values
        confident = (top2[:, 0] - top2[:, 1]) > 0.125

        # TP=2: two spawned ranks (GPUs 0 and 1), rank 0's logits.
        out = os.path.join(tmp, "tp2.pt")
        mp.start_processes(_rank_main, args=(2, _free_port(), path, ids, args, out), nprocs=2,
                           join=True, start_method="spawn")
        tp2 = torch.load(out)
        result.update({
            "backend": tp2["backend"],
            "confident_positions": int(confident.sum()),
            "median_top2_margin_fp32": (top2[:, 0] - top2[:, 1]).median().item(),
            "tp2_vs_tp1_prefill": top1_stats(tp2["prefill"], ref_prefill, confident),
            "tp2_vs_tp1_decode": top1_stats(tp2["decode"], ref_decode, confident),
            "tp1_vs_fp32_prefill (noise floor)": top1_stats(ref_prefill, exact, confident),
            "tp2_vs_fp32_prefill": top1_stats(tp2["prefill"], exact, confident),
            "teacher_forced_seconds": time.perf_counter() - t,
        })

        if not args.skip_engine:
            g = torch.Generator().manual_seed(args.seed + 1)
            prompts = [draw(int(n), g) for n in torch.randint(16, 129, (args.prompts,), generator=g)]
            one, one_s = engine_greedy(path, 1, prompts, args)
            two, two_s = engine_greedy(path, 2, prompts, args)
            prefix = [common_prefix(a, b) for a, b in zip(one, two)]
            result["engine_greedy"] = {
                "prompts": len(prompts), "max_tokens": args.max_tokens,
                "identical_sequences": sum(a == b for a, b in zip(one, two)) / len(prompts),
                "mean_common_prefix_fraction": sum(prefix) / sum(map(len, one)),
                "first_divergence": [p if p < len(a) else None for p, a in zip(prefix, one)],
                "tp1_seconds": one_s, "tp2_seconds": two_s,
                "enforce_eager": args.enforce_eager,
            }
    result["seconds"] = time.perf_counter() - t0
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
