"""A decode step whose rows are all plain greedy takes the arg-max that the decode graph picks
itself (DecodeGraphs.greedy_tokens) where its bucket picks, else the logits' arg-max after the
replay, and builds no sampling batch either way; any other step samples as before. On CPU there
are no CUDA graphs, so the graphs here replay their function eagerly (DecodeGraphs._decode, which
is what capture records); tests/test_gpu_graphs.py has the captured graphs. The oracle is transformers' greedy decoding."""

from __future__ import annotations

import pytest
import torch

import minivllm.runtime.runner as runner_module
from minivllm import LLM, SamplingParams
from minivllm.functional.sampling import SamplingRow, plain_greedy
from minivllm.runtime.graphs import DecodeGraphs

from hf_tiny import hf_greedy, make_hf_model, save_checkpoint

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=0, std=0.3)  # margins well above rounding, as in test_engine


@pytest.fixture(scope="module")
def tiny_dir(hf_model, tmp_path_factory):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("greedy") / "model")


def eager_graphs(llm, greedy_rows: int, monkeypatch, head_picks: bool = True) -> dict:
    """Give llm's runner DecodeGraphs whose replay runs the captured function eagerly; count the
    replays and the sampling batches made. head_picks: the pick's first half in the head's
    kernel (kernels.decode_head), else after the logits (sample_kernel.greedy_argmax)."""
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.params, runner.cache, runner.backend, max_num_seqs=4,
                          max_blocks_per_seq=8, compile_forward=False)
    assert graphs.head_picks  # hidden 64 in fp32 fits the head kernel
    graphs.greedy_rows, graphs.head_picks = greedy_rows, head_picks
    counts = {"replays": 0, "sampling_batches": 0, "argmax_after": 0}

    def replay(b):
        counts["replays"] += 1
        return graphs._decode(graphs.bucket(b))[:b]

    graphs.replay = replay
    runner.graphs = graphs
    # A step's sampling batch is built afresh, or the last one's with new steps (with_steps).
    for name in ("make_sampling_batch", "with_steps"):
        monkeypatch.setattr(runner_module, name, counting(getattr(runner_module, name), counts))
    # A step of plain greedy rows without the graph's pick: the arg-max of its logits.
    sample_in_slices = runner_module.sample_in_slices

    def counting_slices(logits, batches, size):
        counts["argmax_after"] += batches is None
        return sample_in_slices(logits, batches, size)
    monkeypatch.setattr(runner_module, "sample_in_slices", counting_slices)
    return counts


def counting(make, counts: dict):
    def counting_make(*args, **kw):
        counts["sampling_batches"] += 1
        return make(*args, **kw)
    return counting_make


@pytest.mark.parametrize("async_scheduling, head_picks", [(True, True), (False, True),
                                                           (True, False)])
def test_plain_greedy_steps_take_the_graphs_pick(tiny_dir, hf_model, monkeypatch, async_scheduling,
                                                 head_picks):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (5, 17, 3)]
    want = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, async_scheduling=async_scheduling)
    counts = eager_graphs(llm, greedy_rows=2, monkeypatch=monkeypatch, head_picks=head_picks)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    # One and two sequences: every decode step is a graph step of a bucket that picks.
    for batch in ([prompts[0]], prompts[:2]):
        counts.update(replays=0, sampling_batches=0, argmax_after=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want[:len(batch)]
        assert counts["replays"] >= MAX_TOKENS - 1
        # No step built a sampling batch; only the prompt steps (one or two) took the arg-max
        # after their forward.
        assert counts["sampling_batches"] == 0 and counts["argmax_after"] <= len(batch)

    # Three sequences: bucket 4 does not pick, so every step takes the arg-max after the replay.
    counts.update(replays=0, sampling_batches=0, argmax_after=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert counts["sampling_batches"] == 0 and counts["argmax_after"] >= MAX_TOKENS

    # Greedy with logprobs is not plain: it samples, and its logprobs are there.
    counts.update(replays=0, sampling_batches=0)
    out = llm.generate([{"prompt_token_ids": prompts[1]}],
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                      logprobs=2), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want[1] and len(out.logprobs) == MAX_TOKENS
    assert counts["sampling_batches"] >= MAX_TOKENS


def test_a_sampled_row_beside_a_greedy_one_keeps_its_own_draws(tiny_dir, monkeypatch):
    """A step that mixes a plain-greedy row with a sampled one samples both (seeded: the draw is
    the one the engine without graphs makes)."""
    prompt = list(range(3, 12))
    both = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)]
    plain = LLM(tiny_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=4,
                max_num_batched_tokens=64, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in plain.generate(
        [{"prompt_token_ids": prompt}] * 2, both, use_tqdm=False)]
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=64)
    counts = eager_graphs(llm, greedy_rows=2, monkeypatch=monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": prompt}] * 2, both, use_tqdm=False)]
    assert got == want and counts["replays"] >= MAX_TOKENS - 1
    assert counts["sampling_batches"] >= MAX_TOKENS


def test_plain_greedy_rule():
    assert plain_greedy(SamplingRow(temperature=0.0))
    assert plain_greedy(SamplingRow(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, seed=3))
    for row in (SamplingRow(temperature=0.7), SamplingRow(temperature=0.0, presence_penalty=0.5),
                SamplingRow(temperature=0.0, frequency_penalty=-0.1),
                SamplingRow(temperature=0.0, repetition_penalty=1.2),
                SamplingRow(temperature=0.0, banned_ids=(2,)), SamplingRow(temperature=0.0, logprobs=0),
                SamplingRow(temperature=0.0, logit_bias=((3, 1.0),)),
                SamplingRow(temperature=0.0, allowed_ids=(3, 4))):
        assert not plain_greedy(row), row
