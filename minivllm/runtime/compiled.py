"""The pure forward under torch.compile: its three parts (stem, decoder layer, head) compiled
one by one (and the LoRA decoder layer, for steps with adapter rows), for the CUDA graphs'
decode steps and for prefill and mixed steps.

What is compiled is one decoder layer (and the stem and head around the layers), not the whole
forward: the 28 layers of a Qwen3 model are the same function on same-shaped weights, so one
small graph serves them all, and inside a CUDA graph the Python loop around it costs nothing.
Compiling the whole forward gave the same fused kernels but took minutes on a fresh machine (a
28-layer graph, compiled twice: once static, once with a dynamic batch), which is why it is not
done.
"""

from __future__ import annotations

import functools
import itertools
import types

import torch

from ..functional import model
from ..functional.layer import attention_half, decoder_layer
from ..functional.lora import lora_decoder_layer
from ..functional.model import forward


def compiled_forward(compile_backend="inductor", fused_mlp_rows: tuple[int, int] | None = None,
                     device: torch.device | None = None):
    """forward with its three parts (stem, decoder layer, head) compiled, each fullgraph (no
    graph breaks), for one engine. Compiling the stem and the head too turns their ~20 eager
    kernels per step (embedding, RoPE tables, final add + norm) into a few.

    torch.compile keeps its compiled graphs and its record of which input sizes have varied per
    code object. With one code object shared by every engine of a process, a second engine of
    another shape (a TP=2 engine after a TP=1 one, a test session) saw its weight sizes "vary",
    so dynamo compiled them as symbolic sizes: slower code, and on the H200 an Inductor crash
    (KeyError in Scheduler.compute_ancestors, pytorch/pytorch#189271, when a Triton kernel's
    output is reshaped by symbolic head counts). So each call compiles its own copies
    (_own_copy): an engine's first compile is static, its second makes only the step's sizes
    dynamic. fused_mlp_rows (lo, hi): decode steps of lo-hi rows on one rank run each layer as
    its attention half compiled and kernels.decode_mlp (with_fused_mlp; its barrier counter on
    `device`)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Inductor's default mode: max-autotune (timing Triton GEMM templates against cuBLAS) did not
    # finish its start-up within 90 s on the H200, several templates asking for more shared
    # memory than an SM has (BENCHMARKS.md, session 8).

    def compiled(fn):
        return compile_part(_own_copy(fn), compile_backend)

    # The head returns the logits in the activation dtype (model.logits_head): the cast to fp32
    # was a kernel of its own that read the bf16 logits and wrote them twice as wide for the
    # sampler to read again. The sampler widens them exactly as it reads, so no token changes;
    # head and sampler took 190.5 against 242.3 us at 256 rows on the H200, and the throughput
    # run gained 0.4% (BENCHMARKS.md session 25).
    layer = compiled(decoder_layer)
    if fused_mlp_rows is not None:
        from ..kernels.decode_mlp import with_fused_mlp

        counter = torch.zeros(1, dtype=torch.int64, device=device)
        layer = with_fused_mlp(layer, compiled(attention_half), fused_mlp_rows, counter)
    # A step with LoRA rows (batch.lora_slots) runs every layer through lora_decoder_layer,
    # compiled as its own small graph: the deltas fuse with the layer's casts and adds, and its
    # shapes depend on the step's rows and max_loras only (which adapters the rows use are
    # values, not guarded). torch.compile is lazy: an engine without LoRA never compiles it.
    return functools.partial(forward, layer=layer, stem=compiled(model.stem),
                             head=compiled(model.logits_head),
                             lora_layer=compiled(lora_decoder_layer))


def compile_part(fn, compile_backend="inductor"):
    """fn compiled as compiled_forward compiles each part: fullgraph, and under Inductor with
    emulate_precision_casts. Inductor otherwise keeps a 16-bit op's result in fp32 when it fuses
    the op into the next one, where eager PyTorch (and transformers) round it: with the option
    a compiled GEMM + add + norm gives eager's residual stream bit for bit and its norm all but
    (a fused reduction may sum in another order; tests/test_compiled_rounding.py, on the CPU
    with torch 2.13 and on the H200), at no measurable cost (BENCHMARKS.md sessions 45-46)."""
    options = {"emulate_precision_casts": True} if compile_backend == "inductor" else None
    return torch.compile(fn, fullgraph=True, backend=compile_backend, options=options)


_copies = itertools.count(1)


def _own_copy(fn):
    """fn under a name of its own: dynamo keys a function's size history by file, line and name
    (torch._dynamo.pgo.CodeId), and its compiled graphs by code object; both are new here."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__doc__ = fn.__kwdefaults__, fn.__doc__
    return copy
