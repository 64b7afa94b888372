"""Does a decode step gain from running two halves of its batch on two streams, ping-pong?

    PYTHONPATH=. python benchmarks/two_stream_probe.py [--seqs 256,128,64] [--contexts 200-1124]
        [--layers 28] [--modes one,pieces,halves,free,pingpong,pingpong-prio] [--json PATH]

At 256 sequences a decode step of the Qwen3-0.6B shape spends ~176 us a layer in attention,
which reads the KV cache at ~92% of the copy rate and uses little arithmetic, and ~36 us in the
layer's GEMMs, norms and SiLU, which are latency-bound and leave the memory system idle
(BENCHMARKS.md, sessions 7 and 21). Two halves of the batch are independent, so one half's GEMMs
can run while the other half's attention streams the cache. Session 9 ran the halves on two free
streams and measured the throughput run 16% slower: half a batch's GEMMs cost nearly the whole
batch's, and nothing made them overlap the other half's attention. Here the overlap is forced:

  one            the engine's compiled decoder layer, the whole batch, one stream (the baseline)
  pieces         the layer as three compiled pieces (norm + qkv; attention; o_proj + MLP), one
                 stream: what the split costs by itself
  halves         the pieces on each half in turn, one stream: the price of paying the GEMMs twice
  free           each half on a stream of its own, no order between them (session 9's form)
  pingpong       as free, but the attentions alternate (A0, B0, A1, B1, ...): each half's GEMMs
                 run while the other half's attention does
  pingpong-prio  as pingpong, the GEMM pieces on high-priority streams and the attentions on
                 low-priority ones, so that the block scheduler hands a freed SM to a GEMM first
                 (torch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority, so a
                 captured kernel keeps its stream's priority)
  green-G        as pingpong, the GEMM pieces on a green context of G SMs and the attentions on
                 one of the other SMs (benchmarks/green_context.py): the GPU split in two, so
                 the attention's many programs can no longer take the SMs the GEMMs wait for
  greengemm-G    the GEMM pieces on G SMs, the attentions on ordinary streams (every SM)
  kvpf-S-P       as pieces, and after each layer's attention a kernel asks the L2 for the next
                 layer's first P pages (K and V) of the first S sequences (benchmarks/kv_prefetch.py),
                 which its attention's first wave reads first, while the GEMMs leave the DRAM idle
  kvpfside-S-P   as kvpf-S-P, the prefetch kernel on a side stream (its launch off the main chain)

Each mode's layer stack over the same random weights, cache and batch is captured in one CUDA
graph and replayed; its outputs are compared with `one`'s. Contexts are drawn uniformly from
--contexts (the throughput run's at step ~100: 200-1124; at step ~600: 700-1624), page 16.

On the H200 (BENCHMARKS.md session 24) every two-stream mode was slower than `one`, 4-31%:
half a batch's attention reads slower than the whole batch's, and the overlap never wins that
back; high priority for the GEMMs made it worse. Session 37's green-G modes were slower still at
every G from 16 to 80 (at 256 sequences 1.10x `one` at G = 32, its best, 1.62x at 80): the
GEMMs need more than 32 SMs to keep up, and the attention slows with every SM taken from it, so
no split of the GPU lets the two overlap. Session 44's kvpf modes were slower than `pieces` at
every size tried (12-48 MB a layer, 64-256 sequences): 0.1-6.4%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import sys

import torch

import minivllm
from benchmarks.bench_linear import replay_us
from minivllm.functional.layer import mlp_block, norm_qkv
from minivllm.functional.linear import row_linear, split_qkv, sum_partials
from minivllm.functional.model import _layers, stem
from minivllm.kernels import select_backend
from minivllm.runtime.compiled import _own_copy, compiled_forward
from minivllm.state import SeqChunk, make_batch
from minivllm.state.batch import Batch
from minivllm.state.cache import init_cache
from minivllm.state.config import config_for_shape

MODES = ("one", "pieces", "halves", "free", "pingpong", "pingpong-prio")
# and green-G / greengemm-G (G: an SM count, a multiple of 8): see the module's docstring
GREEN = re.compile(r"(green|greengemm)-(\d+)$")
# and kvpf-S-P / kvpfside-S-P (S: sequences, P: pages a sequence): see the module's docstring
KVPF = re.compile(r"(kvpf|kvpfside)-(\d+)-(\d+)$")


def attend(lp, qkv, cos, sin, k_cache, v_cache, batch, *, config, shard, backend):
    """The attention of a decode step from qkv: [T, (heads + 2 kv_heads) * d] -> [T, heads * d]
    (the backend norms and rotates q and k, and writes K/V, as in functional.layer)."""
    q, k, v = split_qkv(qkv, config, shard)
    norm_rope = (lp.q_norm, lp.k_norm, cos, sin, config.rms_norm_eps)
    if getattr(backend, "decode_with_norm_rope", None) is not None:
        out = backend.decode_with_norm_rope(q, k, v, k_cache, v_cache, batch,
                                            config.head_dim ** -0.5, norm_rope)
    else:
        from minivllm.functional.layer import qk_norm_rope

        q, k = qk_norm_rope(q, k, *norm_rope)
        out = backend(q, k, v, k_cache, v_cache, batch, config.head_dim ** -0.5)
    return out.reshape(out.shape[0], -1)


def after_attention(lp, attn, residual, *, shard, eps):
    """o_proj, then the MLP block: (down's output, the residual stream)."""
    return mlp_block(lp, row_linear(attn, lp.o_proj, shard, unsummed_ok=True), residual, shard, eps)


def half_batch(batch: Batch, lo: int, hi: int) -> Batch:
    """Rows lo:hi of a decode batch (one token a sequence, so a row is a sequence)."""
    return Batch(input_ids=batch.input_ids[lo:hi], positions=batch.positions[lo:hi],
                 slot_mapping=batch.slot_mapping[lo:hi],
                 cu_seqlens_q=batch.cu_seqlens_q[: hi - lo + 1],
                 context_lens=batch.context_lens[lo:hi], block_tables=batch.block_tables[lo:hi],
                 logits_indices=batch.logits_indices[: hi - lo], block_size=batch.block_size)


def split_stack(params, cache, parts, pre, post, backend, streams, alternate: bool, keep: list,
                after_attention_hook=None):
    """The layer stack on each part (batch, x, residual, cos, sin), part p's pieces on
    streams[p] = (gemm stream, attention stream) or None (the current stream). alternate: each
    attention waits for the one before it (part 0 layer 0, part 1 layer 0, part 0 layer 1, ...).
    Tensors that cross streams go into `keep`, so that no stream's allocator reuses them early.
    after_attention_hook(i), if given, runs after layer i's attention (one part only)."""
    config, shard = params.config, params.shard
    eps = config.rms_norm_eps
    main = torch.cuda.current_stream() if torch.cuda.is_available() else None
    used = {s for pair in streams if pair for s in pair}
    for s in used:
        s.wait_stream(main)
    state = [[x, res] for _, x, res, _, _ in parts]
    last_attention = None

    def on(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    for i, (lp, kc, vc) in enumerate(zip(params.layers, cache.k, cache.v)):
        for p, (batch, _, _, cos, sin) in enumerate(parts):
            gemm, attn = streams[p] or (None, None)
            with on(gemm):
                qkv, state[p][1] = pre(lp, state[p][0], state[p][1], eps)
            keep += [qkv, state[p][1]]
            with on(attn):
                if attn is not None and attn is not gemm:
                    attn.wait_stream(gemm)
                if alternate and attn is not None and last_attention is not None:
                    attn.wait_event(last_attention)
                out = attend(lp, qkv, cos, sin, kc, vc, batch, config=config, shard=shard,
                             backend=backend)
                if alternate and attn is not None:
                    last_attention = torch.cuda.Event()
                    last_attention.record(attn)
            keep.append(out)
            if after_attention_hook is not None:
                after_attention_hook(i)
            with on(gemm):
                if gemm is not None and attn is not gemm:
                    gemm.wait_stream(attn)
                state[p] = list(post(lp, out, state[p][1], shard=shard, eps=eps))
            keep += state[p]
    for s in used:
        main.wait_stream(s)
    return state


_green_streams: dict = {}


def green_pairs(mode: str, dev: torch.device):
    """Each half's (GEMM stream, attention stream) for a green-G or greengemm-G mode; the
    partitions are made once a G and kept (a green context is never freed here)."""
    from benchmarks.green_context import sm_count_probe, sm_partition_streams

    kind, sms = GREEN.match(mode).groups()
    sms = int(sms)
    if sms not in _green_streams:
        gemm, attention = sm_partition_streams(sms, streams_each=2, device=dev.index or 0)
        _green_streams[sms] = gemm, attention
        plain = torch.cuda.Stream(dev)
        print(f"  a memory-bound op's ms: all SMs {sm_count_probe(plain, dev):.3f}, "
              f"{sms} SMs {sm_count_probe(gemm[0], dev):.3f}, the rest "
              f"{sm_count_probe(attention[0], dev):.3f}", flush=True)
    gemm, attention = _green_streams[sms]
    if kind == "greengemm":
        attention = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    return list(zip(gemm, attention))


class KVPrefetchHook:
    """After layer i's attention: ask the L2 for layer i+1's first pages (kv_prefetch.py), on
    the current stream or on a side stream that the current one joins at the end (join())."""

    def __init__(self, cache, batch, seqs, pages, *, side, dev):
        self.cache, self.batch, self.seqs, self.pages = cache, batch, seqs, pages
        self.side = torch.cuda.Stream(dev) if side else None
        self.forked = False

    def __call__(self, i):
        if i + 1 >= self.cache.num_layers or self.batch.block_tables.device.type != "cuda":
            return  # the prefetch is PTX: nothing to ask for on the CPU
        from benchmarks.kv_prefetch import prefetch_first_pages
        stream = self.side
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            self.forked = True
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            prefetch_first_pages(self.cache.k[i + 1], self.cache.v[i + 1], self.batch.block_tables,
                                 self.batch.context_lens, self.seqs, self.pages)

    def join(self):
        if self.side is not None and self.forked:
            torch.cuda.current_stream().wait_stream(self.side)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def probe(params, backend, seqs: int, contexts: tuple[int, int], modes, page: int = 16,
          seed: int = 0) -> dict:
    config = params.config
    dev = params.device
    rng = random.Random(seed)
    lens = [rng.randint(*contexts) for _ in range(seqs)]
    blocks = [-(-n // page) for n in lens]
    cache = init_cache(params, num_blocks=sum(blocks) + 1, block_size=page)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for t in cache.k + cache.v:
        t.normal_(generator=gen)
    chunks, start = [], 1  # block 0 is the padding rows' (as in the engine's graphs)
    for n, nb in zip(lens, blocks):
        chunks.append(SeqChunk([rng.randrange(config.vocab_size)], n - 1,
                               list(range(start, start + nb))))
        start += nb
    batch = make_batch(chunks, block_size=page, device=dev)
    x0, res0, cos, sin = stem(params, batch)
    res0 = torch.randn_like(x0) * 0.1
    h = seqs // 2
    halves = [(half_batch(batch, 0, h), x0[:h], res0[:h], cos[:h], sin[:h]),
              (half_batch(batch, h, seqs), x0[h:], res0[h:], cos[h:], sin[h:])]
    whole = [(batch, x0, res0, cos, sin)]
    layer = compiled_forward().keywords["layer"]
    pre = torch.compile(_own_copy(norm_qkv), fullgraph=True)
    post = torch.compile(_own_copy(after_attention), fullgraph=True)
    cuda = dev.type == "cuda"

    def run(mode, keep):
        if mode == "one":
            return _layers(params, cache, batch, backend, x0, res0, cos, sin, layer)
        if mode == "pieces":
            (x, res), = split_stack(params, cache, whole, pre, post, backend, [None], False, keep)
            return x, res
        if m := KVPF.match(mode):
            hook = KVPrefetchHook(cache, batch, int(m[2]), int(m[3]),
                                  side=m[1] == "kvpfside" and cuda, dev=dev)
            (x, res), = split_stack(params, cache, whole, pre, post, backend, [None], False, keep,
                                    hook)
            hook.join()
            return x, res
        if mode == "halves":
            got = split_stack(params, cache, halves, pre, post, backend, [None, None], False, keep)
        elif mode in ("free", "pingpong"):
            pairs = ([(s, s) for s in (torch.cuda.Stream(dev), torch.cuda.Stream(dev))] if cuda
                     else [None, None])
            got = split_stack(params, cache, halves, pre, post, backend, pairs,
                              mode == "pingpong", keep)
        elif mode == "pingpong-prio":  # GEMM pieces high priority (-1), attentions low (0)
            pairs = ([(torch.cuda.Stream(dev, priority=-1), torch.cuda.Stream(dev, priority=0))
                      for _ in range(2)] if cuda else [None, None])
            got = split_stack(params, cache, halves, pre, post, backend, pairs, True, keep)
        else:  # green-G, greengemm-G
            pairs = green_pairs(mode, dev) if cuda else [None, None]
            got = split_stack(params, cache, halves, pre, post, backend, pairs, True, keep)
        return tuple(torch.cat([got[0][j], got[1][j]]) for j in range(2))

    result = dict(seqs=seqs, contexts=list(contexts), layers=config.num_layers,
                  kv_tokens=sum(lens), modes={})
    reference = None

    def measure(mode):
        nonlocal reference
        with torch.no_grad():
            for _ in range(2):  # compile (each piece at both row counts) and warm up, eagerly
                keep = []
                out = run(mode, keep)
            if cuda:
                torch.cuda.synchronize()
            x = sum_partials(out[0], config.dtype)
            if reference is None:
                reference = (x, out[1])
            entry = dict(x_rel_diff=rel_diff(x, reference[0]),
                         residual_rel_diff=rel_diff(out[1], reference[1]))
            if cuda:
                graph = torch.cuda.CUDAGraph()
                keep = []
                capture = torch.cuda.Stream(dev)
                capture.wait_stream(torch.cuda.current_stream())
                with torch.cuda.graph(graph, stream=capture):
                    run(mode, keep)
                us = replay_us(graph)
                entry |= dict(us_per_step=us, us_per_layer=us / config.num_layers)
                del graph, keep
        return entry

    for mode in modes:
        try:
            entry = measure(mode)
        except Exception as e:  # a green context the driver or a launcher refuses: say so, go on
            print(f"{seqs} sequences, {mode}: failed: {type(e).__name__}: {e}", flush=True)
            torch.cuda.synchronize() if cuda else None
            continue
        result["modes"][mode] = entry
        print(f"{seqs} sequences, contexts {contexts[0]}-{contexts[1]}, {mode}: "
              + ", ".join(f"{k} {v:.4g}" for k, v in entry.items()), flush=True)
    if cuda and "one" in result["modes"]:
        base = result["modes"]["one"]["us_per_step"]
        for mode, entry in result["modes"].items():
            print(f"  {mode}: {entry['us_per_step'] / base:.3f} of one's time", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="256,128,64")
    ap.add_argument("--contexts", default="200-1124")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's 28")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES and not GREEN.match(m) and not KVPF.match(m)]:
        print(f"unknown modes {bad}; known: {', '.join(MODES)}", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("two_stream_probe.py needs a CUDA GPU for its timings (--device cpu checks the "
              "modes' outputs only)", file=sys.stderr)
        return 2
    overrides = {} if args.layers is None else dict(num_layers=args.layers)
    config = config_for_shape(args.shape, **overrides)
    params = minivllm.random_params(config, seed=0, device=dev)
    backend = select_backend(dev, "triton" if dev.type == "cuda" else None)
    lo, hi = (int(v) for v in args.contexts.split("-"))
    results = [probe(params, backend, int(s), (lo, hi), modes) for s in args.seqs.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           shape=args.shape, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
