"""The start-up warm-up's choice of sampler batch sizes: one per tiling of the sampler kernel, and
every tiling that a batch up to max_num_seqs can get is among them."""

import torch

import minivllm.kernels.sample_kernel as sample_kernel
from minivllm.runtime.warmup import sampler_sizes


def test_sampler_sizes_cover_every_tiling(monkeypatch):
    monkeypatch.setattr(sample_kernel, "num_sms", lambda device: 132)  # an H200's
    device = torch.device("cpu")
    for vocab, max_rows, tilings in ((151936, 256, 4), (1000, 8, 1), (50, 1, 1)):
        sizes = sampler_sizes(max_rows, vocab, device)
        every = {sample_kernel.chunk_size(r, vocab, device) for r in range(1, max_rows + 1)}
        assert sorted(sample_kernel.chunk_size(r, vocab, device) for r in sizes) == sorted(every)
        assert len(sizes) == tilings and sizes[0] == 1 and all(1 <= r <= max_rows for r in sizes)


def test_warm_up_runs_its_steps_and_leaves_the_model_alone():
    import minivllm
    from minivllm.kernels import select_backend
    from minivllm.runtime.warmup import warm_up_kernels
    from minivllm.state import ModelConfig

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    params = minivllm.random_params(config, seed=0)
    before = [t.clone() for t in torch.utils._pytree.tree_leaves(params)]
    warm_up_kernels(params, select_backend("cpu", "reference"), block_size=4, max_num_seqs=8,
                    cuda_only=False)
    assert all(torch.equal(a, b) for a, b in zip(before, torch.utils._pytree.tree_leaves(params)))


def test_warm_up_runs_the_forwards_head_at_every_row_count():
    """The head of the forward it is given (as compiled_forward binds it) runs at every number
    of logits rows from 1 to max_num_seqs (cuBLAS's first GEMM at a new row count is slow)."""
    import functools

    import minivllm
    from minivllm.functional import model
    from minivllm.kernels import select_backend
    from minivllm.runtime.warmup import head_of, warm_up_kernels
    from minivllm.state import ModelConfig

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    params = minivllm.random_params(config, seed=0)
    rows_seen = []

    def head(params, x, residual, rows):
        logits = model.head(params, x, residual, rows)
        assert logits.shape == (len(rows), config.vocab_size)
        rows_seen.append(len(rows))
        return logits

    forward_fn = functools.partial(minivllm.forward, head=head)
    assert head_of(forward_fn) is head and head_of(minivllm.forward) is model.head
    warm_up_kernels(params, select_backend("cpu", "reference"), block_size=4, max_num_seqs=8,
                    forward_fn=forward_fn, cuda_only=False)
    assert set(range(1, 9)) <= set(rows_seen), rows_seen


def test_warm_up_samples_logits_in_every_dtype_serving_gives_the_sampler(monkeypatch):
    """The compiled forward's head returns the activation dtype and the eager one fp32; the
    sampler kernel is compiled per logits dtype, so the warm-up must sample both."""
    import minivllm
    import minivllm.runtime.warmup as warmup
    from minivllm.kernels import select_backend
    from minivllm.state import ModelConfig

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    params = minivllm.random_params(config, seed=0)
    seen = []
    real_sample = warmup.sample

    def sample(logits, sb):
        seen.append(logits.dtype)
        return real_sample(logits, sb)

    monkeypatch.setattr(warmup, "sample", sample)
    warmup.warm_up_kernels(params, select_backend("cpu", "reference"), block_size=4,
                           max_num_seqs=8, cuda_only=False)
    assert set(seen) == {torch.float32, torch.bfloat16}, seen


def test_warm_up_samples_truncated_rows_on_both_kernel_variants(monkeypatch):
    """The truncated rows' draw (kernels.truncated_sample) compiles a variant with top-p and
    one without, per logits dtype: the warm-up samples a batch of each in both dtypes, rows
    whose top-k / top-p take the candidates (the kernel's batches), not a sort."""
    import minivllm
    import minivllm.runtime.warmup as warmup
    from minivllm.kernels import select_backend
    from minivllm.state import ModelConfig

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    params = minivllm.random_params(config, seed=0)
    seen = set()
    real_sample = warmup.sample

    def sample(logits, sb):
        if sb.any_truncated:
            assert sb.top_k_bound or not (sb.do_top_k or sb.do_top_p)
            seen.add((logits.dtype, sb.do_top_p))
        return real_sample(logits, sb)

    monkeypatch.setattr(warmup, "sample", sample)
    warmup.warm_up_kernels(params, select_backend("cpu", "reference"), block_size=4,
                           max_num_seqs=8, cuda_only=False)
    assert seen == {(d, p) for d in (torch.float32, torch.bfloat16) for p in (True, False)}, seen
