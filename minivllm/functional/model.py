"""forward(params, cache, batch) -> (logits, cache): the whole Qwen3 model.

A step is three pure functions: `stem` (embeddings, a zero residual, RoPE's cos and sin), the
decoder layers, and `head` (the final norm and the LM head at the rows that need logits). A
caller may run any of them compiled (runtime.compiled.compiled_forward does): each is one small
graph, where one graph of the whole 28-layer forward took minutes to compile."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from ..state.batch import Batch, SeqChunk, make_batch
from ..state.cache import KVCache, check_cache_fits
from ..state.params import Params, check_layer_count
from .attention import REFERENCE, AttentionBackend
from .embedding import embed, lm_head
from .layer import decoder_layer
from .linear import sum_partials
from .norm import add_rms_norm
from .rope import rope_cos_sin
from .sampling import token_logprobs


def stem(params: Params, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, hidden] the tokens' embeddings, residual: zeros like x, cos, sin: [T, head_dim].

    A zero residual rather than None: x + 0 is x exactly, and every layer then has one
    signature, so a compiled layer is one graph for all of them.

    Rows with an input embedding (batch.embeds_mask; vLLM's prompt_embeds) take
    batch.input_embeds in place of their id's embedding. A `where` over the lookup, not a lookup
    of the other rows only: the step's shapes stay those of a step without embeddings, and under
    tensor parallelism every rank runs the lookup's all-reduce as before."""
    x = embed(batch.input_ids, params.embed, params.config, params.shard)
    if batch.input_embeds is not None:
        x = torch.where(batch.embeds_mask[:, None], batch.input_embeds.to(x.dtype), x)
    cos, sin = rope_cos_sin(params.config, batch.positions)
    return x, torch.zeros_like(x), cos, sin


def final_hidden(params: Params, x: torch.Tensor, residual: torch.Tensor,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """The last layer's output (either form, see decoder_layer) added to the residual stream and
    normed, at `rows` (default all): [rows, hidden]."""
    x = sum_partials(x, residual.dtype)
    if rows is not None:
        x, residual = x[rows], residual[rows]
    x, _ = add_rms_norm(x, residual, params.final_norm, params.config.rms_norm_eps)
    return x


def logits_head(params: Params, x: torch.Tensor, residual: torch.Tensor,
                rows: torch.Tensor) -> torch.Tensor:
    """logits: [len(rows), vocab_size] in the activation dtype, from the last layer's output and
    residual stream. What the engine's compiled forward returns (runtime.compiled): the sampler
    reads bf16 logits as they are and widens them exactly, so a cast to fp32 would only add a
    pass over them."""
    h = final_hidden(params, x, residual, rows)
    return lm_head(h, params.head_weight, params.config, params.shard)


def head(params: Params, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits: [len(rows), vocab_size] fp32 (logits_head's, widened)."""
    return logits_head(params, x, residual, rows).float()


def prompt_logprobs(params: Params, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor,
                    targets: torch.Tensor, n: int, *, chunk: int = 256
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores of known next tokens (vLLM's prompt_logprobs): for each of `rows` [P] (token rows
    of the step), the logprob [P] and rank [P] of targets [P] (the token that follows it) and
    the top n (ids, logprobs) [P, n], as sample reports a sampled token's (token_logprobs).
    `chunk` rows at a time, so that a long prompt holds chunk x vocab logits, not P x vocab."""
    parts = []
    for lo in range(0, rows.shape[0], chunk):
        logits = head(params, x, residual, rows[lo:lo + chunk])
        parts.append(token_logprobs(logits, targets[lo:lo + chunk], n))
    return tuple(torch.cat(column) for column in zip(*parts))


def check_step(params: Params, cache: KVCache, batch: Batch) -> None:
    """What a step can check for free (a few us): a Batch made for the cache's block size, a
    cache made for the params (check_cache_fits' cheap form), a layer per layer of the config
    (state.params.check_params checks every weight; generate runs it)."""
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be a Batch (make_batch), got {type(batch).__name__}")
    check_cache_fits(params, cache, whole=False)
    check_layer_count(params)
    if params.lora is not None and params.config.is_moe:  # (init_lora refuses to make these)
        raise ValueError(f"LoRA weights on a mixture-of-experts model are not supported: layers "
                         f"{list(params.config.sparse_layers)} are sparse (dense Qwen3 only)")
    if batch.block_size != cache.block_size:
        raise ValueError(f"the batch was made for blocks of {batch.block_size} tokens, the cache "
                         f"holds blocks of {cache.block_size} (make_batch's block_size)")
    if batch.lora_slots is not None and params.lora is None:
        raise ValueError("the batch names LoRA slots (lora_slots) but params hold no LoRA "
                         "weights (params.lora)")
    if (batch.input_embeds is None) != (batch.embeds_mask is None):
        raise ValueError("a batch's input_embeds and embeds_mask come together (or neither)")
    if batch.input_embeds is not None and (
            batch.input_embeds.shape != (batch.num_tokens, params.config.hidden_size)
            or batch.embeds_mask.shape != (batch.num_tokens,)
            or batch.embeds_mask.dtype != torch.bool):
        raise ValueError(f"a batch of {batch.num_tokens} tokens takes input_embeds "
                         f"[{batch.num_tokens}, {params.config.hidden_size}] and a bool "
                         f"embeds_mask [{batch.num_tokens}], got "
                         f"{list(batch.input_embeds.shape)} and {list(batch.embeds_mask.shape)} "
                         f"{batch.embeds_mask.dtype}")


def batch_for(params: Params, cache: KVCache, chunks: Sequence[SeqChunk], *,
              every_row: bool = False, max_blocks: int | None = None,
              lora_slots: Sequence[int] | None = None,
              embeds: Sequence[tuple[int, torch.Tensor]] = ()) -> Batch:
    """make_batch for a step of `params` over `cache`, with what they already know filled in:
    the cache's block size, the params' device, embeds' width and dtype, and the bounds that
    forward cannot check on the device without waiting for it. A token id outside the
    vocabulary, a block past the cache or a LoRA slot outside [-1, params.lora.max_loras) (any
    slot but -1 when params hold no LoRA weights) is a ValueError here, on the host, before any
    work; a Batch packed by hand from such values would raise an IndexError on the CPU, a
    device-side assert on CUDA, or (a slot) silently run the base model at that row."""
    return make_batch(chunks, block_size=cache.block_size, device=params.device,
                      max_blocks=max_blocks, every_row=every_row,
                      num_blocks=cache.num_blocks, vocab_size=params.config.vocab_size,
                      lora_slots=lora_slots,
                      max_loras=0 if params.lora is None else params.lora.max_loras,
                      embeds=embeds, hidden_size=params.config.hidden_size,
                      embeds_dtype=params.dtype)


def resolve_backend(params: Params, cache: KVCache, backend) -> AttentionBackend:
    """backend as forward runs it: an attention backend object as it is; a name ("reference",
    "triton", "flash_attn") or None, as generate takes them, through kernels.select_backend
    (None: the best available for the device and cache); anything else a TypeError here, not
    "'str' object is not callable" from inside the first layer. An isinstance check: free."""
    if backend is None or isinstance(backend, str):
        from ..kernels import select_backend

        return select_backend(params.device, backend, cache.k[0].dtype, params.config.head_dim)
    if not callable(backend):
        raise TypeError(f"backend must be an attention backend, a name or None, got "
                        f"{type(backend).__name__}")
    return backend


def without_embeds(batch: Batch) -> Batch:
    """batch less its input embeddings, which only the stem reads: the layers after it then
    take the pytree of a step without embeddings, so that a compiled layer is the same graph
    for both (a Batch with two more leaves would fail its guards and compile it again)."""
    if batch.input_embeds is None:
        return batch
    return attrs.evolve(batch, input_embeds=None, embeds_mask=None)


def uses_lora(params: Params, batch: Batch) -> bool:
    """Whether the step runs LoRA deltas: params hold slot weights and some row names a slot.
    Otherwise the forward is exactly the one without LoRA."""
    return params.lora is not None and batch.lora_slots is not None


def _layers(params: Params, cache: KVCache, batch: Batch, backend: AttentionBackend, x, residual,
            cos, sin, layer, lora_layer=None) -> tuple[torch.Tensor, torch.Tensor]:
    if uses_lora(params, batch):  # every layer with its LoRA deltas (functional/lora.py)
        from .lora import lora_decoder_layer, lora_layers

        return lora_layers(params, cache, batch, backend, x, residual, cos, sin,
                           lora_layer or lora_decoder_layer)
    config, shard = params.config, params.shard
    for lp, k_cache, v_cache in zip(params.layers, cache.k, cache.v):
        x, residual = layer(lp, x, residual, cos, sin, k_cache, v_cache, batch,
                            config=config, shard=shard, backend=backend)
    return x, residual


def hidden_states(params: Params, cache: KVCache, batch: Batch,
                  backend: AttentionBackend | str | None = REFERENCE,
                  rows: torch.Tensor | None = None, *, layer=decoder_layer) -> torch.Tensor:
    """The final-normed hidden state of each token in `rows` (default all): [rows, hidden].
    Writes this step's K/V into `cache`. `layer` is decoder_layer or a compiled form of it.
    The batch's values are unchecked, as forward's are (batch_for checks them on the host)."""
    check_step(params, cache, batch)
    backend = resolve_backend(params, cache, backend)
    x, residual, cos, sin = stem(params, batch)
    batch = without_embeds(batch)
    x, residual = _layers(params, cache, batch, backend, x, residual, cos, sin, layer)
    return final_hidden(params, x, residual, rows)


def forward(params: Params, cache: KVCache, batch: Batch,
            backend: AttentionBackend | str | None = REFERENCE,
            *, layer=decoder_layer, stem=stem, head=head, layers=None, lora_layer=None
            ) -> tuple[torch.Tensor, KVCache]:
    """logits: [len(batch.logits_indices), vocab_size] fp32, and the cache with this step's K/V.

    The cache is donated: its buffers are written in place and the returned cache is the one to
    use from now on (see minivllm.state.cache). `layer`, `stem` and `head` let a caller run the
    parts compiled (torch.compile(decoder_layer), ...): the function is unchanged, only how it is
    executed. `layers`, if given, runs the whole layer stack instead of a loop over `layer`:
    layers(params, cache, batch, backend, x, residual, cos, sin) -> (x, residual), e.g. one
    persistent kernel for every layer (kernels.decode_layer.persistent_layers). What `head`
    returns is what comes back in the logits' place (kernels.decode_head.picking_head: the
    logits and the tiles' maxima of a greedy pick).

    LoRA: when params.lora holds slot weights and batch.lora_slots names each row's slot, every
    layer adds its rows' LoRA deltas: `lora_layer` (default functional.lora.lora_decoder_layer,
    or a compiled form of it) runs in `layer`'s place. A batch without lora_slots runs `layer`,
    exactly the forward without LoRA. `layers` (a kernel for the whole stack) takes no deltas.

    backend: an attention backend, or a name or None as generate takes them (resolve_backend).

    What forward checks is what costs no wait for the device (check_step): not the batch's
    values. Its token ids must lie in [0, vocab_size), its block tables' blocks (-1 aside) in
    [0, cache.num_blocks), its lora_slots in [-1, params.lora.max_loras): an id or block beyond
    is an IndexError on the CPU and a device-side assert on CUDA; a slot beyond runs the base
    model at that row, silently. batch_for(params, cache, chunks) packs a batch with these
    bounds checked (make_batch's vocab_size, num_blocks and max_loras).

    torch.func: pass the cache to the transformed function as an argument. forward writes the
    step's K/V into it in place, and torch.func refuses an in-place write to a tensor the
    function captured ("... would mutate a captured Tensor"):

        loss = lambda p, c: forward(p, c, batch)[0].logsumexp(-1).sum()
        grads = torch.func.grad(loss)(params, cache)      # d loss / d params (argnums=0)

    (grad wraps every argument, differentiating argnums' only). Or make the cache inside the
    function, init_cache(p, ...): that form serves every transform, vjp included (which would
    differentiate a cache passed among its primals, and refuses the in-place write to it).
    vmap: one cache a member, vmapped alongside the params."""
    check_step(params, cache, batch)
    backend = resolve_backend(params, cache, backend)
    if layers is not None and uses_lora(params, batch):
        raise ValueError("forward's `layers` (a whole-stack kernel) computes no LoRA deltas; "
                         "a step with lora_slots runs the layers one by one")
    x, residual, cos, sin = stem(params, batch)
    batch = without_embeds(batch)
    if layers is not None:
        x, residual = layers(params, cache, batch, backend, x, residual, cos, sin)
    else:
        x, residual = _layers(params, cache, batch, backend, x, residual, cos, sin, layer,
                              lora_layer)
    return head(params, x, residual, batch.logits_indices), cache
