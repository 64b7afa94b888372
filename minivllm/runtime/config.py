"""EngineConfig: the engine's settings, checked and resolved against the checkpoint once."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import attrs
import torch

from ..functional.sampling import check_logprobs_mode
from ..state.classifier import ClassifierConfig
from ..state.config import (FP8_DTYPES, ModelConfig, config_for_shape, parse_dtype,
                            parse_kv_cache_dtype, read_config_dict)
from ..state.values import as_flag, as_int, as_real
from .distributed import check_tensor_parallel, torchrun_env
from .pooling import resolve_runner
from .scheduler import POLICIES
from .spec_decode import SpeculativeConfig

log = logging.getLogger("minivllm")


def is_random_model(model: str) -> bool:
    """A model named "random:SHAPE" has random weights at a known shape (minivllm.state.SHAPES);
    "random:SHAPE:QUANT" (QUANT "awq" or "fp8") has its decoder linears quantized as the engine
    holds such a checkpoint's (state/params.random_params; `minivllm bench --quantization`)."""
    return model.startswith("random:")


def random_model(model: str) -> tuple[ModelConfig, str | None]:
    """A "random:SHAPE[:QUANT]" model's config and quantization (None: dense weights), checked
    before any weight is drawn: a ValueError for an unknown shape or quantization, a quantized
    mixture of experts (its experts load dense from a checkpoint), and "fp8" where fp8 weights
    are not kept (MINIVLLM_FP8_WEIGHTS=dequantize, state/load.fp8_weights_mode: a block-fp8
    checkpoint would load dequantized, as dense bf16 weights)."""
    from ..state.load import DEFAULT_FP8_WEIGHTS, fp8_weights_mode
    from ..state.params import RANDOM_QUANTIZATIONS

    shape, colon, quantization = model.split(":", 1)[1].partition(":")
    model_config = config_for_shape(shape)
    if not colon:
        return model_config, None
    if quantization not in RANDOM_QUANTIZATIONS:
        raise ValueError(f"{model!r}: quantization {quantization!r} is not one of "
                         f"{', '.join(RANDOM_QUANTIZATIONS)}")
    if model_config.is_moe:
        raise ValueError(f"{model!r}: quantized random weights are for dense shapes; {shape} is "
                         f"a mixture of experts (a checkpoint's experts load dense)")
    if quantization == "fp8" and fp8_weights_mode() != "fp8":
        raise ValueError(f"{model!r}: fp8 weights are kept in fp8 only with "
                         f"MINIVLLM_FP8_WEIGHTS=fp8 (now {fp8_weights_mode()!r}, default "
                         f"{DEFAULT_FP8_WEIGHTS!r}: a block-fp8 checkpoint would load "
                         f"dequantized, as the dense run); set it to measure the fp8 path")
    return model_config, quantization


def random_quantization(model: str) -> str | None:
    """The quantization of a "random:SHAPE:QUANT" model's weights; None for any other model."""
    return random_model(model)[1] if is_random_model(model) else None


def _integer(name: str, value, *, least: int | None = 1, allow_none: bool = False) -> int | None:
    """value as a Python int (an int or a numpy / torch integer scalar) >= least, or None where
    allowed; else ValueError naming it."""
    if value is None and allow_none:
        return None
    number = as_int(value)
    if number is None or (least is not None and number < least):
        what = ("an integer" if least is None else "a positive integer" if least == 1
                else f"an integer >= {least}")
        raise ValueError(f"{name} must be {what}{' or None' if allow_none else ''}, got {value!r}")
    return number


@dataclass(frozen=True)
class EngineConfig:
    """What LLM(...) was asked for, resolved: `dtype` a torch dtype, `device` a torch device,
    `max_model_len` and `max_num_batched_tokens` numbers. num_kv_blocks None: sized from memory."""

    model: str
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    gpu_memory_utilization: float
    num_kv_blocks: int | None
    enforce_eager: bool
    tensor_parallel_size: int
    attention_backend: str | None
    seed: int
    enable_prefix_caching: bool
    max_logprobs: int
    async_scheduling: bool = True
    kv_cache_dtype: torch.dtype | None = None  # None: dtype
    # Decode steps of 1-2 rows: every layer in one persistent kernel (with LoRA: steps without
    # adapter rows; the kernel adds no deltas).
    persistent_decode: bool = False
    # The same for a draft model's decode graphs (propose's rounds, a decode step's mirror),
    # decided by the draft's shape: a 0.6B draft of an 8B target takes it where the target cannot.
    draft_persistent_decode: bool = False
    # "generate", or "pooling" (embeddings: runtime/pooling.py; the model's config then has tied
    # embeddings, so that no LM head is loaded); normalize_embeddings: PoolingParams' default.
    runner: str = "generate"
    normalize_embeddings: bool = True
    # A pooling model's classifier head (a Qwen3ForSequenceClassification, or a causal LM made
    # one by hf_overrides: state/classifier.py), or None: it embeds.
    classifier: ClassifierConfig | None = None
    scheduling_policy: str = "fcfs"  # or "priority" (runtime/scheduler.py)
    # n-gram or draft-model speculative decoding (runtime/spec_decode.py), or None
    speculative: SpeculativeConfig | None = None
    # LoRA adapters (runtime/lora.py): up to max_loras at once, of rank up to max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # vLLM's enable_prompt_embeds: generate takes {"prompt_embeds": [T, hidden] tensor} prompts.
    enable_prompt_embeds: bool = False
    # vLLM's enable_sleep_mode: LLM.sleep / wake_up may free the weights' and the KV cache's
    # device memory and take it back (runtime/sleep.py).
    enable_sleep_mode: bool = False
    # vLLM's logprobs_mode: what returned logprobs are taken from, one of
    # functional.sampling_batch.LOGPROBS_MODES (raw_logprobs, raw_logits, processed_logprobs,
    # processed_logits); it travels to every rank with the config, in each step's SamplingBatch.
    logprobs_mode: str = "raw_logprobs"

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    @classmethod
    def create(cls, model, *, dtype="auto", max_model_len=None, max_num_seqs=256,
               max_num_batched_tokens=None, block_size=16, gpu_memory_utilization=0.9,
               num_kv_blocks=None, enforce_eager=False, tensor_parallel_size=1,
               attention_backend=None, seed=0, enable_prefix_caching=True, max_logprobs=20,
               device=None, async_scheduling=True, kv_cache_dtype="auto",
               persistent_decode=None, hf_overrides=None, runner="auto",
               task=None, scheduling_policy="fcfs",
               speculative_config=None, enable_lora=False, max_loras=1,
               max_lora_rank=16, enable_prompt_embeds=False,
               enable_sleep_mode=False, logprobs_mode="raw_logprobs") -> "EngineConfig":
        model = os.fsdecode(model)  # a str, for a str, bytes or os.PathLike path
        speculative = SpeculativeConfig.create(speculative_config)
        if scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, POLICIES))}, "
                             f"got {scheduling_policy!r}")
        if hf_overrides is not None and not isinstance(hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config.json keys, got "
                             f"{hf_overrides!r:.80}")
        config_dict: dict = {}
        random_quant = None  # "random:SHAPE:QUANT"'s
        if is_random_model(model):
            # "random:qwen3-0.6b": random weights at a real shape (benchmarks); no checkpoint.
            if hf_overrides:
                raise ValueError("hf_overrides needs a checkpoint's config.json, not random weights")
            model_config, random_quant = random_model(model)
            classifier = None
        elif not os.path.isdir(model):
            what = "is a file, not a directory" if os.path.exists(model) else "does not exist"
            raise ValueError(f"model directory {model!r} {what} (minivllm loads local "
                             f"Hugging Face checkpoints; try `minivllm generate --demo`)")
        elif not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json (a Hugging Face "
                             f"checkpoint directory holds config.json and *.safetensors)")
        else:
            try:
                config_dict = read_config_dict(model, hf_overrides)
                model_config = ModelConfig.from_dict(config_dict)
                classifier = ClassifierConfig.from_dict(config_dict)
            except ValueError as e:
                raise ValueError(f"{model}: {e}" + (" (with hf_overrides)" if hf_overrides else "")
                                 ) from None
        runner, normalize_embeddings = resolve_runner(
            runner, task, None if is_random_model(model) else model,
            config_dict.get("architectures") or ())
        if runner != "pooling":
            classifier = None
        if runner == "pooling":
            # A pooling model computes no logits: its checkpoint need not hold an LM head
            # (Qwen3-Embedding's hold none, tied or not), and the engine's head, which no request
            # reads, is the embedding.
            model_config = attrs.evolve(model_config, tie_word_embeddings=True)
        max_num_seqs = _integer("max_num_seqs", max_num_seqs)
        block_size = _integer("block_size", block_size)
        tensor_parallel_size = _integer("tensor_parallel_size", tensor_parallel_size)
        max_model_len = _integer("max_model_len", max_model_len, allow_none=True)
        num_kv_blocks = _integer("num_kv_blocks", num_kv_blocks, allow_none=True)
        max_num_batched_tokens = _integer("max_num_batched_tokens", max_num_batched_tokens,
                                          allow_none=True)
        seed = 0 if seed is None else _integer("seed", seed, least=None)  # None: vLLM's 0
        max_logprobs = _integer("max_logprobs", max_logprobs, least=-1)  # -1: the vocabulary
        logprobs_mode = check_logprobs_mode(logprobs_mode)
        utilization = as_real(gpu_memory_utilization)
        if utilization is None or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        enforce_eager = as_flag("enforce_eager", enforce_eager, False)
        enable_prefix_caching = as_flag("enable_prefix_caching", enable_prefix_caching, True)
        async_scheduling = as_flag("async_scheduling", async_scheduling, True)
        if speculative is not None and async_scheduling:
            # A speculative step's accepted tokens decide the next step's chunks: it is recorded
            # before the next is scheduled (runtime/spec_decode.py).
            log.info("minivllm: speculative decoding runs with synchronous scheduling: "
                     "async_scheduling is turned off")
            async_scheduling = False

        device = _device(device)
        # "auto" keeps the checkpoint's dtype (float32 tiny test checkpoints stay float32).
        dtype = parse_dtype(dtype, model_config.dtype)
        kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype, dtype)
        if kv_cache_dtype != dtype and kv_cache_dtype not in FP8_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} with dtype {dtype}: the cache is in "
                             f"the model's dtype ('auto') or in fp8")
        # Heads that do not split, more ranks than GPUs, a torchrun of another size: errors now,
        # before any process starts.
        check_tensor_parallel(model_config, tensor_parallel_size, device, torchrun_env())
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: there are {torch.cuda.device_count()} CUDA GPUs")
        # The backend's name, or its ValueError, now: the runner picks it once the weights are
        # in (an unknown or unavailable name was named only after an 8B checkpoint had loaded).
        from ..kernels.backends import backend_name
        backend_name(device, attention_backend, kv_cache_dtype, model_config.head_dim)
        limit = model_config.max_context_len
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            scaling = model_config.rope_scaling_dict or {}
            kind = scaling.get("rope_type")
            what = ("YaRN's original_max_position_embeddings x factor" if kind == "yarn" else
                    f"max_position_embeddings x {kind} rope scaling's factor"
                    if kind in ("linear", "dynamic") else "max_position_embeddings")
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context, its "
                             f"{what} ({limit})")
        from ..kernels.launch import triton_usable
        if persistent_decode is not None and not isinstance(persistent_decode, bool):
            raise TypeError(f"persistent_decode must be True, False or None (the default for the "
                            f"device), got {persistent_decode!r}")
        persistent_asked = persistent_decode  # before the target's default resolves it
        # An AWQ checkpoint's linears are packed int4, a block-fp8 one's stay fp8 (state/quant.py,
        # state/load.keeps_fp8): the persistent decode kernel multiplies 16-bit dense weights only.
        quantized = _quantized_linears(config_dict, model_config, random_quant)
        if persistent_decode is None:
            persistent_decode = not model_config.is_moe and not quantized and persistent_decode_default(
                device, tensor_parallel_size, attention_backend, triton_usable(device),
                model_config.head_dim, kv_cache_dtype, hidden_size=model_config.hidden_size)
        if persistent_decode:
            if model_config.is_moe:
                raise ValueError(f"persistent_decode runs dense Qwen3 layers; "
                                 f"{len(model_config.sparse_layers)} of this model's "
                                 f"{model_config.num_layers} are mixtures of experts (leave "
                                 f"persistent_decode unset or False)")
            if quantized:
                raise ValueError(f"persistent_decode runs 16-bit dense layers; this checkpoint's "
                                 f"linears are {quantized} (leave persistent_decode unset or "
                                 f"False)")
            from ..kernels.backends import TRITON_HEAD_DIMS, triton_takes_head_dim
            if device.type == "cuda" and not triton_takes_head_dim(model_config.head_dim):
                lo, hi = TRITON_HEAD_DIMS
                raise ValueError(f"persistent_decode is a Triton kernel: it takes head_dim {lo}-{hi} "
                                 f"on a GPU, the model has {model_config.head_dim}")
            if tensor_parallel_size != 1:
                raise ValueError("persistent_decode runs on one GPU (tensor_parallel_size 1), got "
                                 f"tensor_parallel_size={tensor_parallel_size}")
            if not triton_usable(device):
                raise ValueError(f"persistent_decode is a Triton kernel: it needs a CUDA device "
                                 f"(or TRITON_INTERPRET=1 on a CPU), got {device}")
        from ..functional import linear

        for name, value in (("MINIVLLM_AWQ_KERNEL", linear._AWQ_KERNEL),
                            ("MINIVLLM_FP8_KERNEL", linear._FP8_KERNEL)):
            if value not in linear.QUANTIZED_KERNELS:  # named before the model loads
                raise ValueError(f"{name}={value!r} is not one of {linear.QUANTIZED_KERNELS}")
        if model_config.is_moe:
            from ..functional import moe

            if moe._MOE_KERNEL not in moe.MOE_KERNELS:  # named before the model loads
                raise ValueError(f"MINIVLLM_MOE_KERNEL={moe._MOE_KERNEL!r} is not one of "
                                 f"{moe.MOE_KERNELS}")
        if model_config.is_moe and device.type == "cuda" and (
                dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] not in (9, 10)):
            # functional/moe.py: torch's grouped GEMM runs without a host sync in bf16 on a
            # Hopper or Blackwell GPU only; its fallback serves steps the Triton kernels do not.
            from ..kernels.fused_moe import MAX_KERNEL_TOKENS

            log.warning("minivllm: this mixture-of-experts model's expert GEMMs compute every "
                        "expert on every routed row (%d x the work) in %s on %s for steps the "
                        "Triton MoE kernels do not take (more than %d tokens, or all with "
                        "MINIVLLM_MOE_KERNEL=grouped): they run as grouped GEMMs in bf16 on a "
                        "Hopper or Blackwell GPU",
                        model_config.num_experts, str(dtype).removeprefix("torch."),
                        torch.cuda.get_device_name(device), MAX_KERNEL_TOKENS)
        enable_lora = as_flag("enable_lora", enable_lora, False)
        max_loras = _integer("max_loras", max_loras)
        max_lora_rank = _integer("max_lora_rank", max_lora_rank)
        if enable_lora:
            if model_config.is_moe:
                raise ValueError("enable_lora: LoRA on a mixture-of-experts model is not "
                                 "supported (dense Qwen3 models only)")
            if runner == "pooling":
                raise ValueError("enable_lora: LoRA is for generating models (runner "
                                 "'generate'), not pooling ones")
        enable_prompt_embeds = as_flag("enable_prompt_embeds", enable_prompt_embeds, False)
        if enable_prompt_embeds and runner == "pooling":
            raise ValueError("enable_prompt_embeds: prompt embeddings are for generating models "
                             "(runner 'generate'), not pooling ones")
        enable_sleep_mode = as_flag("enable_sleep_mode", enable_sleep_mode, False)
        if speculative is not None and speculative.method == "draft_model":
            speculative = check_draft_model(
                speculative, model_config, tensor_parallel_size=tensor_parallel_size,
                runner=runner, enable_lora=enable_lora, enable_prompt_embeds=enable_prompt_embeds,
                max_model_len=max_model_len)
        draft_persistent_decode = False
        if speculative is not None and speculative.draft_config is not None:
            draft_persistent_decode = draft_takes_persistent_decode(
                persistent_asked, speculative.draft_config, device, attention_backend,
                kv_cache_dtype, triton_usable(device))
        if max_logprobs == -1:  # as vLLM: no cap
            max_logprobs = model_config.vocab_size
        if max_num_batched_tokens is None:
            # CPU: the reference attention's memory grows with tokens x context, keep steps small.
            max_num_batched_tokens = 8192 if device.type == "cuda" else 512
        if speculative is not None and \
                speculative.num_speculative_tokens >= max_num_batched_tokens:
            # A step verifies a sequence's k drafts and its token as one chunk: a larger k never
            # drafts k, and /metrics would render a per-position series for each of them.
            raise ValueError(f"speculative_config: num_speculative_tokens "
                             f"({speculative.num_speculative_tokens}) must be below "
                             f"max_num_batched_tokens ({max_num_batched_tokens}): a step "
                             f"verifies the drafts and the sequence's token as one chunk")
        return cls(model=model, model_config=model_config, dtype=dtype, device=device,
                   max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                   gpu_memory_utilization=utilization, num_kv_blocks=num_kv_blocks,
                   enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                   attention_backend=attention_backend, seed=seed,
                   enable_prefix_caching=enable_prefix_caching, max_logprobs=max_logprobs,
                   async_scheduling=async_scheduling, kv_cache_dtype=kv_cache_dtype,
                   persistent_decode=persistent_decode,
                   draft_persistent_decode=draft_persistent_decode, runner=runner,
                   normalize_embeddings=normalize_embeddings, classifier=classifier,
                   scheduling_policy=scheduling_policy,
                   speculative=speculative, enable_lora=enable_lora, max_loras=max_loras,
                   max_lora_rank=max_lora_rank, enable_prompt_embeds=enable_prompt_embeds,
                   enable_sleep_mode=enable_sleep_mode, logprobs_mode=logprobs_mode)


def check_draft_model(speculative: SpeculativeConfig, target: ModelConfig, *,
                      tensor_parallel_size: int, runner: str, enable_lora: bool,
                      enable_prompt_embeds: bool, max_model_len: int) -> SpeculativeConfig:
    """A "draft_model" speculative config with its draft's ModelConfig read from its checkpoint
    and checked against the target's and the engine's settings: ValueError naming what minivllm
    does not serve with a draft model (tensor parallelism, LoRA, pooling, prompt embeddings)
    and a draft that is not a 16-bit Qwen3 dense checkpoint of the target's
    vocabulary and at least max_model_len of context."""
    what = "speculative_config (draft_model)"
    for refused, why in ((tensor_parallel_size != 1,
                          f"tensor_parallel_size={tensor_parallel_size}: the draft runs on one "
                          f"device only"),
                         (enable_lora, "enable_lora: the draft computes no LoRA deltas"),
                         (runner == "pooling", "a pooling runner: it samples nothing to draft"),
                         (enable_prompt_embeds, "enable_prompt_embeds: the draft cannot take the "
                                                "target's input embeddings")):
        if refused:
            raise ValueError(f"{what} is not supported with {why}")
    path = speculative.model
    if is_random_model(path):
        # "random:SHAPE": random weights of a named shape (benchmarks: `minivllm bench
        # --speculative-config`), drawn by the runner with the engine's seed, so that a draft of
        # the target's own shape and seed holds the target's very weights (the best case).
        try:
            draft, quantization = random_model(path)
        except ValueError as e:
            raise ValueError(f"{what}: the draft model {path}: {e}") from None
        if quantization is not None or draft.is_moe:
            raise ValueError(f"{what}: the draft model {path} must be 16-bit dense random "
                             f"weights (\"random:SHAPE\" of a dense shape)")
        return _check_draft_fits(speculative, draft, target, path, max_model_len)
    if not os.path.isdir(path):
        raise ValueError(f"{what}: the draft model {path!r} is not a checkpoint directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{what}: the draft model directory {path!r} has no config.json")
    try:
        config_dict = read_config_dict(path, None)
        draft = ModelConfig.from_dict(config_dict)
    except ValueError as e:
        raise ValueError(f"{what}: the draft model {path}: {e}") from None
    arch = tuple(config_dict.get("architectures") or ())
    if arch and arch != ("Qwen3ForCausalLM",) or draft.is_moe:
        raise ValueError(f"{what}: the draft model {path} must be a Qwen3 dense causal LM "
                         f"(Qwen3ForCausalLM), got {', '.join(arch) or 'a mixture of experts'}")
    if config_dict.get("quantization_config"):
        raise ValueError(f"{what}: the draft model {path} is quantized; minivllm drafts with "
                         f"16-bit dense checkpoints only")
    return _check_draft_fits(speculative, draft, target, path, max_model_len)


def _check_draft_fits(speculative: SpeculativeConfig, draft: ModelConfig, target: ModelConfig,
                      path: str, max_model_len: int) -> SpeculativeConfig:
    """check_draft_model's last checks, for a checkpoint's draft and a random one alike: the
    target's vocabulary, and at least max_model_len of context."""
    what = "speculative_config (draft_model)"
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{what}: the draft model's vocab_size ({draft.vocab_size}, {path}) "
                         f"differs from the target model's ({target.vocab_size}): the draft "
                         f"must share the target's tokenizer and vocabulary")
    if draft.max_context_len < max_model_len:
        raise ValueError(f"{what}: the draft model {path} takes {draft.max_context_len} tokens "
                         f"of context, less than max_model_len={max_model_len}")
    return dataclasses.replace(speculative, draft_config=draft)


def _quantized_linears(config_dict: dict, model_config,
                       random_quant: str | None = None) -> str | None:
    """What a checkpoint's decoder linears are in memory when they are not dense tensors ("AWQ
    4-bit", "block fp8 ..."), else None: config.json's quantization_config (already checked by
    ModelConfig) and, for block fp8, whether load keeps the weights in fp8 (state/load.keeps_fp8:
    not where MINIVLLM_FP8_WEIGHTS=dequantize). random_quant: a "random:SHAPE:QUANT" model's
    QUANT ("awq", "fp8"; random_model checked it), whose random weights are drawn so."""
    from ..state.load import keeps_fp8
    from ..state.params import RANDOM_AWQ_GROUP, RANDOM_FP8_BLOCK
    from ..state.quant import AwqQuantization, Fp8BlockQuantization, quantization_from_config

    quant = quantization_from_config(config_dict) if config_dict else None
    if random_quant == "awq":
        quant = AwqQuantization(group_size=RANDOM_AWQ_GROUP)
    elif random_quant == "fp8":
        quant = Fp8BlockQuantization(block=RANDOM_FP8_BLOCK)
    if isinstance(quant, AwqQuantization):
        return "AWQ 4-bit"
    if keeps_fp8(quant, model_config):
        return "block fp8, kept in fp8 (MINIVLLM_FP8_WEIGHTS=dequantize loads them dense)"
    return None


# The widest model the persistent decode layer is on by default for: Qwen3-0.6B's 1,024, where
# it decodes the single stream 19% faster (session 16). At Qwen3-1.7B's 2,048 it ran 212 tok/s
# against 496 without, at Qwen3-8B's 4,096 47 against 117 (an H100, session 56).
PERSISTENT_DECODE_MAX_HIDDEN = 1024


def persistent_decode_default(device: torch.device, tensor_parallel_size: int,
                              attention_backend: str | None, triton_usable: bool,
                              head_dim: int, kv_cache_dtype: torch.dtype | None = None, *,
                              hidden_size: int) -> bool:
    """persistent_decode when not given: on where it runs (one CUDA GPU with Triton, a head_dim
    the Triton kernels compile for), the engine's attention backend is Triton's, whether
    asked for, named by MINIVLLM_ATTENTION_BACKEND or chosen as the best available (the kernel's
    attention is Triton's decode kernel: with another backend, steps of 1-2 rows would not run
    it), and where it was measured faster: models of hidden_size up to
    PERSISTENT_DECODE_MAX_HIDDEN."""
    from ..kernels.backends import backend_name, triton_takes_head_dim
    return (device.type == "cuda" and tensor_parallel_size == 1 and triton_usable and
            hidden_size <= PERSISTENT_DECODE_MAX_HIDDEN and
            triton_takes_head_dim(head_dim) and
            backend_name(device, attention_backend, kv_cache_dtype, head_dim) == "triton")


def draft_takes_persistent_decode(asked: bool | None, draft: ModelConfig, device: torch.device,
                                  attention_backend: str | None, kv_cache_dtype,
                                  triton_usable: bool) -> bool:
    """Whether a draft model's decode graphs run persistent_decode's kernel: as the engine's
    persistent_decode says (False: never; True: wherever the kernel takes the draft, which
    check_draft_model has made a dense 16-bit model on one device), and when not given by the
    draft's own shape, as persistent_decode_default decides it for a target (so a Qwen3-0.6B
    draft of an 8B target, which does not take it, has it)."""
    if asked is False:
        return False
    if asked is None:
        return persistent_decode_default(device, 1, attention_backend, triton_usable,
                                         draft.head_dim, kv_cache_dtype,
                                         hidden_size=draft.hidden_size)
    from ..kernels.backends import triton_takes_head_dim
    return triton_usable and (device.type != "cuda" or triton_takes_head_dim(draft.head_dim))


def _device(device) -> torch.device:
    """The engine's device: the one given, else CUDA when there is one; ValueError for a name
    torch does not know or a CUDA device this machine lacks."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None
    if device.type == "cuda":
        if torch.cuda.device_count() == 0:
            raise ValueError(f"device {str(device)!r}: this machine's torch sees no CUDA GPU")
    elif device.type != "cpu":
        raise ValueError(f"device {str(device)!r}: minivllm runs on cpu or cuda")
    return device
