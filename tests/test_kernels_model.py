"""The whole model on the triton backend: minivllm.generate, greedy, against transformers'
generate(do_sample=False) on a tiny fp32 checkpoint. On CPU the kernels run under Triton's
interpreter, so CI checks the backend end to end (prefill of ragged prompts, then decode)."""

import pytest
import torch

import minivllm
from hf_tiny import make_hf_model, save_checkpoint
from minivllm.kernels.launch import triton_usable

PROMPTS = [[3, 14, 15, 92, 65], list(range(7, 30)), [(i * 37) % 101 for i in range(41)]]
NEW_TOKENS = 32


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("block_size", [16])
def test_generate_on_triton_backend_matches_transformers(tmp_path, monkeypatch, device, block_size):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    model = make_hf_model(seed=1)
    params = minivllm.load(save_checkpoint(model, tmp_path / "ckpt"), dtype="float32", device=device)
    cache = minivllm.init_cache(params, num_blocks=64 * 16 // block_size, block_size=block_size)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    got, _ = minivllm.generate(params, cache, PROMPTS, max_new_tokens=NEW_TOKENS)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert got == want
    assert len({tuple(w) for w in want}) == len(want) and len(set(want[0])) > 3  # not degenerate
