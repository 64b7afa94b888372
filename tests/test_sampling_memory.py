"""The sampler's [B, V] temporaries (functional/sampling.py), counted on the CPU: the KV budget
sets aside the heaviest sampling's peak on the GPU (1.60 GiB allocated, 1.97 reserved at 256 rows
of 151,936 ids on the H200 in session 31, before the sampler worked in place), so a temporary
more is ~150 MB less cache there. Storages that ops create are counted from creation until their
last tensor dies, by a dispatch mode: an independent count of what the code keeps alive."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from minivllm.functional.sampling import SamplingRow, make_sampling_batch, sample
from minivllm.runtime.runner import heaviest_row


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages that ops create while it is active (views of a storage
    already counted, or of an input, add nothing)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors alive]
        self.counted: set[int] = set()  # ids of the tensors alive that hold a counted storage

    def _release(self, ptr: int, tensor_id: int) -> None:
        self.counted.discard(tensor_id)
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or id(t) in self.counted:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.storages:
                if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr
                       for a in tree_flatten((args, kwargs))[0]):
                    continue  # a view of an input
                self.storages[ptr] = [storage.nbytes(), 0]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self.storages[ptr][1] += 1
            self.counted.add(id(t))
            weakref.finalize(t, self._release, ptr, id(t))
        return out


HEAVIEST = SamplingRow(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=0.5, repetition_penalty=1.1, output_ids=(0, 5, 5),
                       prompt_ids=(7,), banned_ids=(3,), logprobs=20)


def test_live_bytes_counts_what_stays_alive():
    with LiveBytes() as m:
        a = torch.ones(1000)  # 4,000 bytes alive
        b = a * 2  # 8,000
        del a  # 4,000
        c = b[:10]  # a view: nothing new
        d = torch.cat([b, b])  # 12,000
        del b  # c keeps b's storage alive
        e = d.sum()  # 12,004
        del d  # 4,004
    assert (m.peak, m.live) == (12_004, 4_004)
    del c  # b's storage dies with its last view
    assert m.live == 4
    del e


def test_the_heaviest_sampling_keeps_about_six_fp32_rows_by_vocab_alive(device):
    """Every stage on, fp32 and bf16 logits: at most 6.25 [B, V] fp32 temporaries at once (8.6
    when each stage made a new tensor), with top-k / top-p on candidates (top-k 50) and on a
    sort of the vocabulary (the runner's heaviest row: top-k past MAX_TOP_K_BOUND). With the
    draw's kernels, as on the GPU whose memory this is about (the torch reference of the
    Gumbel pass, the CPU's, writes its [B, V] noise out)."""
    rows, vocab = 16, 20_000
    unit = rows * vocab * 4
    for row in (HEAVIEST, heaviest_row(20, vocab)):
        batch = make_sampling_batch([row] * rows, vocab_size=vocab, device=device)
        assert bool(batch.top_k_bound) == (row is HEAVIEST)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(rows, vocab).to(dtype).to(device)
            with LiveBytes() as m:
                out = sample(logits, batch, kernel=True)
            assert out.token_ids.shape == (rows,) and out.top_ids.shape == (rows, 20)
            assert m.peak <= 6.25 * unit, f"{dtype}: {m.peak / unit:.2f} [B, V] fp32 temporaries"


def test_sampling_never_writes_the_callers_logits():
    """The sampler works in place on its own copies only."""
    rows, vocab = 8, 500
    g = torch.Generator().manual_seed(0)
    plain = SamplingRow(temperature=0.7)
    greedy = SamplingRow(temperature=0.0, presence_penalty=0.4, output_ids=(1, 2))
    for sampling_rows in ([HEAVIEST] * rows, [plain, greedy, HEAVIEST, plain] * 2):
        batch = make_sampling_batch(sampling_rows, vocab_size=vocab)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(rows, vocab, generator=g).to(dtype)
            kept = logits.clone()
            for gumbel in (True, False):
                sample(logits, batch, kernel=False, gumbel=gumbel)
                assert torch.equal(logits, kept)
