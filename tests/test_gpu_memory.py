"""On CUDA only: an engine whose KV cache is sized from free memory stays within
gpu_memory_utilization, CUDA graphs, warm-up and the heaviest sampling included. Skipped without
a GPU (the CPU's budget is a fixed share of RAM: memory.cpu_kv_budget_bytes)."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.runtime.bench import device_peak_bytes
from minivllm.runtime.memory import GiB, memory_owners

from hf_tiny import make_hf_model, save_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_an_engine_sized_from_free_memory_stays_within_gpu_memory_utilization(tmp_path):
    """A real vocabulary (151,936) with a tiny body, so that what start-up builds beside the
    cache is as large as at the 0.6B shape: 256 sequences' fp32 logits in the decode and the
    prefill graphs, and top-k / top-p / min-p / penalties with logprobs sampling 256 rows. The
    limit is set 4 GiB above what is in use, under the 4 GiB that every sequence at full length
    would want, so the budget decides the cache. Session 29 found the engine past the limit by
    0.2-1 GiB on the H200, when every graph's logits were kept apart and the decode graphs' pool
    was not set aside; session 30 by 0.25 GiB, when the allocator's cache grew as serving
    sampled more rows step by step."""
    model = make_hf_model(seed=4, vocab_size=151936, hidden_size=64, intermediate_size=128,
                          num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=2048)
    path = save_checkpoint(model, tmp_path / "model")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = (total - free + 4 * GiB) / total
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(path, dtype="bfloat16", gpu_memory_utilization=utilization, max_num_seqs=256,
              max_model_len=2048)
    wanted = 256 * 2048 // llm.config.block_size  # blocks for every sequence at full length
    assert llm.engine.num_blocks < wanted, "the budget did not bind"
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, 151936, (int(n),), generator=g).tolist()}
               for n in torch.randint(20, 100, (256,), generator=g)]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=5,
                            presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                            max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    torch.cuda.synchronize()
    peak = device_peak_bytes(torch.device("cuda"))
    limit = utilization * total
    owners = memory_owners(torch.device("cuda"))
    assert peak <= limit, f"{(peak - limit) / GiB:.2f} GiB over gpu_memory_utilization ({owners})"
