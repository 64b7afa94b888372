"""How the runner sizes the KV cache from device memory (runtime/memory.py; the measuring in
runtime/runner.py): the budget's arithmetic, the profiling step's shape, the start-up report
that says when the budget's estimate fell short, and graphs.unowned, which lets the CUDA
graphs' logits share their pool. Pure functions, checked on the CPU; the sizing itself runs on
a GPU only (benchmarks/kv_budget_check.py, tests/test_gpu_graphs.py)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.functional.sampling import MAX_TOP_K_BOUND, make_sampling_batch
from minivllm.runtime.graphs import unowned
from minivllm.runtime.memory import (GiB, allocator_pools, allocator_report, kv_blocks_within,
                                     kv_budget_bytes, profile_lengths, startup_memory_report)
from minivllm.runtime.runner import heaviest_row


def test_the_kv_budget_sets_aside_what_the_graphs_pools_keep():
    kw = dict(total=1000, utilization=0.9, in_use=100, forward_peak=300, sampling_peak=200)
    # Eager prefill: its activations are freed before sampling allocates.
    assert kv_budget_bytes(**kw, graphs_hold_forward=False) == 900 - 100 - 300
    assert kv_budget_bytes(**(kw | {"sampling_peak": 400}), graphs_hold_forward=False) == 400
    # Prefill graphs: their pool keeps the forward's, and sampling's comes beside it.
    assert kv_budget_bytes(**kw, graphs_hold_forward=True) == 900 - 100 - 500
    # The decode graphs' pool is kept beside either.
    assert kv_budget_bytes(**kw, decode_graphs_peak=50, graphs_hold_forward=False) == 450
    assert kv_budget_bytes(**kw, decode_graphs_peak=50, graphs_hold_forward=True) == 250


@given(st.integers(1, 5000), st.integers(1, 300), st.integers(1, 4096))
def test_the_profiling_step_spreads_its_tokens_over_as_many_sequences_as_a_step_holds(
        tokens, max_num_seqs, max_model_len):
    if tokens > max_num_seqs * max_model_len:
        with pytest.raises(ValueError, match="do not fit"):
            profile_lengths(tokens, max_num_seqs, max_model_len)
        return
    lengths = profile_lengths(tokens, max_num_seqs, max_model_len)
    assert sum(lengths) == tokens
    assert len(lengths) == min(max_num_seqs, tokens)  # one logits row per sequence
    assert 1 <= min(lengths) and max(lengths) - min(lengths) <= 1
    assert max(lengths) <= max_model_len


def test_the_start_up_report_warns_when_start_up_went_past_the_limit():
    total = 100 * GiB
    marks = [("KV cache", 20 * GiB), ("decode graphs", 25 * GiB), ("prefill graphs", 29 * GiB)]
    message, over = startup_memory_report(marks, total, 0.3)
    assert not over
    assert "29.00 GiB of 100.00" in message and "allows 30.00" in message
    assert "KV cache 20.00, decode graphs 25.00, prefill graphs 29.00" in message
    marks.append(("prefill graphs", 31.5 * GiB))
    message, over = startup_memory_report(marks, total, 0.3)
    assert over
    # Set to what it names, the KV cache would be 1.5 GiB smaller: 30 GiB in use, the limit.
    assert "1.50 GiB over; gpu_memory_utilization 0.285 would keep" in message


def test_unowned_reads_the_tensors_memory_without_keeping_it():
    base = torch.arange(24.0)
    t = base.view(4, 6)[1:, ::2]  # an offset and strides of its own
    use_count = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    alias = unowned(t)
    assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) == use_count
    assert alias.data_ptr() == t.data_ptr()
    assert (alias.shape, alias.stride(), alias.storage_offset(), alias.dtype) == \
        (t.shape, t.stride(), t.storage_offset(), t.dtype)
    assert torch.equal(alias, t)
    base.mul_(-1)  # writes through to the alias: the same memory
    assert torch.equal(alias, t)


def test_unowned_without_torchs_private_constructor_keeps_the_tensor(monkeypatch):
    monkeypatch.delattr(torch._C, "_construct_storage_from_data_pointer")
    t = torch.arange(6.0)
    assert unowned(t) is t


def test_allocator_pools_sum_the_snapshots_segments_by_pool():
    segments = [{"total_size": 2 * GiB, "segment_pool_id": (0, 0)},
                {"total_size": GiB, "segment_pool_id": (1, 3)},
                {"total_size": GiB // 2, "segment_pool_id": (1, 3)},
                {"total_size": GiB // 4, "segment_pool_id": (1, 4)},
                {"total_size": GiB // 4}]  # a torch whose snapshot names no pool: the default
    pools = allocator_pools(segments)
    assert pools == {"default": 2.25 * GiB, "pool 1.3": 1.5 * GiB, "pool 1.4": 0.25 * GiB}
    line = allocator_report(pools, outside=GiB)
    assert "default 2.250, pool 1.3 1.500, pool 1.4 0.250" in line
    assert "outside the allocator 1.000" in line


@given(st.integers(1, 5), st.integers(1, 300), st.integers(1, 1000), st.integers(0, 200_000))
def test_kv_blocks_within_is_the_most_that_fit_once_each_tensor_is_rounded_up(
        layers, per_tensor_block, granule, budget):
    """Against counting blocks one by one: each of the cache's tensors reserves its bytes
    rounded up to the allocator's granule."""
    tensors = 2 * layers

    def reserved(n):
        return tensors * -(-n * per_tensor_block // granule) * granule

    n = kv_blocks_within(budget, per_tensor_block * tensors, tensors, granule)
    assert reserved(n) <= budget < reserved(n + 1)


def test_kv_blocks_of_the_06b_shape_fill_whole_segments():
    # the 0.6B shape's bf16 blocks (32 KiB a tensor) in 2 MiB segments: a multiple of 64 blocks
    assert kv_blocks_within(37 * GiB + 5 * 2**20, 56 * 32 * 1024, 56, 2 << 20) % 64 == 0


def test_allocator_pools_count_only_the_devices_segments():
    segments = [{"total_size": GiB, "device": 0}, {"total_size": 2 * GiB, "device": 1},
                {"total_size": GiB, "device": 1, "segment_pool_id": (1, 2)}]
    assert allocator_pools(segments, 1) == {"default": 2 * GiB, "pool 1.2": GiB}
    assert allocator_pools(segments, 0) == {"default": GiB}


def test_memory_owners_calls_the_snapshot_as_torch_declares_it(monkeypatch):
    """torch.cuda.memory_snapshot's first parameter is a graph pool's id: passed a device, it
    raised on the H200 (session 31) and failed every engine's start-up."""
    import inspect

    from minivllm.runtime import memory

    signature = inspect.signature(torch.cuda.memory_snapshot)

    def snapshot(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        pool = bound.arguments.get("mempool_id")
        assert pool is None or isinstance(pool, tuple), f"mempool_id={pool!r}"
        return [{"total_size": GiB, "device": 1}, {"total_size": 3 * GiB, "device": 0}]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    monkeypatch.setattr(memory, "bytes_outside_allocator", lambda device: GiB // 2)
    line = memory.memory_owners(torch.device("cuda", 1))
    assert "allocator pools default 1.000; outside the allocator 0.500" in line


def test_the_budgets_sampling_turns_every_stage_on(tmp_path, monkeypatch):
    """The sampling the KV budget profiles (and start-up leaves the blocks of) is the heaviest
    serving can run: every row penalised, banned ids, top-k, top-p and min-p, max_logprobs; a
    stage left out would be memory serving takes and the budget never set aside."""
    from hf_tiny import make_hf_model, save_checkpoint

    from minivllm import LLM
    from minivllm.runtime import runner as runner_mod

    path = save_checkpoint(make_hf_model(seed=2), tmp_path / "model")
    llm = LLM(path, dtype="float32", num_kv_blocks=32, max_num_seqs=6, max_model_len=128,
              max_logprobs=7, enforce_eager=True)  # the sampling does not depend on graphs
    batches, make = [], runner_mod.make_sampling_batch
    monkeypatch.setattr(runner_mod, "make_sampling_batch",
                        lambda *a, **k: batches.append(make(*a, **k)) or batches[-1])
    out = llm.engine.runner._heaviest_sampling(torch.float32)
    (sb,) = batches
    assert sb.temperature.shape == (6,) and out.token_ids.shape == (6,)
    assert sb.output_ids is not None and sb.prompt_ids is not None and sb.banned_rows is not None
    assert sb.allowed_rows is not None and sb.allowed_bits is not None
    assert bool((sb.presence_penalty != 0).all() and (sb.frequency_penalty != 0).all()
                and (sb.repetition_penalty != 1).all())
    # the sort of the vocabulary (top-p with no top-k: this vocabulary of 1,000 ids or fewer
    # has no top-k past the candidates' bound, the sort's top-k at a real vocabulary's)
    assert sb.top_k_bound == 0 and sb.do_top_p and sb.do_min_p and sb.all_truncated
    vocab = llm.engine.runner.vocab_size
    assert vocab <= MAX_TOP_K_BOUND + 1 and not sb.do_top_k
    big = make_sampling_batch([heaviest_row(7, 151_936)], vocab_size=151_936)
    assert big.do_top_k and big.top_k_bound == 0 and big.do_top_p and big.do_min_p
    assert out.top_logprobs.shape == (6, 7)
