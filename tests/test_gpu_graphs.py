"""On CUDA only: the engine's fast paths (compiled decoder layer, decode CUDA graphs, asynchronous
scheduling) give the same greedy tokens as the plain eager engine, on a batch of prompts of
varied lengths, in bf16 and fp32. Skipped without a GPU (the CPU has no graphs)."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

from hf_tiny import make_hf_model, save_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    # Four layers and a wider model than the other tests' tiny one; std 0.3 keeps greedy margins
    # above bf16 rounding, so that two correct paths agree token for token.
    model = make_hf_model(seed=1, std=0.3, num_hidden_layers=4, hidden_size=128,
                          intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=32, vocab_size=257)
    return save_checkpoint(model, tmp_path_factory.mktemp("deep") / "model")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graphs_and_async_scheduling_equal_eager(deep_dir, dtype):
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 257, (n,), generator=g).tolist()}
               for n in (1, 5, 17, 33, 64, 100, 3, 250, 9, 40, 77, 128, 2, 31, 60, 15, 200, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(**kw):
        llm = LLM(deep_dir, dtype=dtype, num_kv_blocks=256, max_num_seqs=32, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outs]

    eager, want = run(enforce_eager=True, async_scheduling=False)
    assert eager.engine.runner.graphs is None
    fast, got = run()
    assert fast.engine.runner.graphs is not None and fast.engine.async_scheduling
    assert got == want
