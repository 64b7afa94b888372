"""Tensor parallelism of the functional core over torch.distributed (gloo on CPU): TP=2 prefill
logits equal TP=1 within fp32 rounding (eager, and through the compiled forward), greedy generation is identical, the engine's runners
agree on the KV cache size, and its step messages arrive intact."""

import torch
import torch.multiprocessing as mp

from hf_tiny import make_hf_model, save_checkpoint
from tp_worker import _free_port, _run, _worker

CASES = {
    # vocab 101 is odd: it pads to 102 over 2 ranks
    "kv2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # one KV head, replicated on both ranks; tied head
    "kv1-tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
}


def test_tp2_equals_tp1(tmp_path):
    """Both cases in one pair of spawned processes (starting them is most of the cost)."""
    cases = sorted(CASES)
    refs = {}
    for case in cases:
        model = make_hf_model(seed=11, std=0.3, **CASES[case])
        refs[case] = _run(save_checkpoint(model, tmp_path / case), 0, 1)
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path), cases), nprocs=2, join=True,
                       start_method="spawn")
    assert torch.load(tmp_path / "wire.rank1.pt") is True  # the engine's step messages
    for case in cases:
        ref_logits, _, ref_tokens = refs[case]
        for rank in range(2):
            got = torch.load(tmp_path / f"{case}.rank{rank}.pt")
            assert got["logits"].shape == ref_logits.shape
            for key in ("logits", "compiled_logits"):  # eager, and traced as the graphs run it
                torch.testing.assert_close(got[key], ref_logits, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{case} rank {rank} {key}: {m}")
            assert got["tokens"] == ref_tokens, f"{case} rank {rank}"
            # The engine's runner: rank 0 can hold 10 KV blocks, rank 1 20; both hold 10.
            assert got["kv_blocks"] == 10, f"{case} rank {rank}"
