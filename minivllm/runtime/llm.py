"""LLM: the offline API, shaped like vLLM's, so that switching is a one-line change.

    from minivllm import LLM, SamplingParams
    llm = LLM("path/to/Qwen3-0.6B")
    for out in llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32)):
        print(out.outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable, Iterable, Iterator

import torch

from ..state.values import as_flag, as_int
from .config import EngineConfig, is_random_model
from .distributed import torchrun_env
from . import reasoning
from .beam_search import BeamSearchOutput, beam_search
from .chat_messages import read_conversations
from .classify import ClassificationRequestOutput, load_head
from .engine import EngineStats, LLMEngine, check_lora_ids, tokenize_prompts
from .executor import make_executor
from .lora import LoRARequest
from .generation_config import (FILE as GEN_FILE, eos_ids_of, generation_config_dir,
                                read_generation_config, sampling_defaults)
from .outputs import RequestOutput
from .pooling import EmbeddingRequestOutput, PoolingParams
from .sampling_params import BeamSearchParams, SamplingParams
from .scoring import ScorePlan, ScoringRequestOutput, plan_scores

log = logging.getLogger("minivllm")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str, *, required: bool):
    """transformers' AutoTokenizer from `path`; None (with a warning) when the directory has no
    tokenizer files and none is required."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        if required:
            raise ValueError(f"no tokenizer files in {path}")
        log.warning("minivllm: no tokenizer in %s; prompts must be given as prompt_token_ids "
                    "and outputs have no text", path)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers' errors name neither the directory nor, often, the file
        raise ValueError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from e


def generation_defaults(generation_config, override, model: str) -> tuple[dict, dict]:
    """LLM's generation_config and override_generation_config -> (the SamplingParams fields
    they set, the generation_config.json that gives the EOS ids), checked; reads a file only."""
    directory = generation_config_dir(generation_config, model, is_random_model(model))
    gen = read_generation_config(directory) if directory is not None else {}
    where = os.path.join(directory, GEN_FILE) if directory is not None else GEN_FILE
    eos_ids_of(gen, where)  # checked here, before any work
    return sampling_defaults({} if generation_config == "vllm" else gen, override, where), gen


def _one_per_prompt(value, cls: type, n: int, name: str, plural: str) -> list:
    """`value` for each of n prompts: one `cls` for all, or an iterable of one per prompt."""
    if isinstance(value, cls):
        return [value] * n
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a {cls.__name__} or a list of them, got "
                         f"{type(value).__name__}")
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{n} prompts but {len(values)} {plural}")
    return values


class LLM:
    """An inference engine over one local Qwen3 checkpoint.

    model: a Hugging Face checkpoint directory. tokenizer: a directory to load the tokenizer from
    instead (default: the model's). dtype: "auto" (the checkpoint's), "float32", "bfloat16",
    "float16" or a torch dtype. max_model_len: longest prompt + output (default: the model's
    max_position_embeddings). max_num_seqs / max_num_batched_tokens: the scheduler's budgets per
    step. block_size: tokens per KV block. num_kv_blocks: the KV cache's size in blocks (default,
    on a GPU: what the device's total memory * gpu_memory_utilization leaves after what is in use
    (weights, the CUDA context, other processes) and what start-up measures the largest step,
    sampling and the CUDA graphs to need, as vLLM; on CPU, MINIVLLM_CPU_KV_CACHE_SPACE GiB, else 4
    GiB and at most a quarter of the RAM). enforce_eager: no CUDA graphs (issue 5).
    attention_backend: "reference", "triton", "flash_attn" or None (best for the device;
    MINIVLLM_ATTENTION_BACKEND). seed: draws the seeds of requests that set none (None: 0, as
    vLLM). tensor_parallel_size: split the model over this many processes (GPUs on CUDA, NCCL;
    gloo on CPU): the LLM spawns the other ranks on this host, or, under torchrun, rank 0 runs the
    engine and the other ranks serve it inside LLM(...) and then exit. Call shutdown() (or use the
    LLM as a context manager) to stop them early; they also stop at exit. async_scheduling:
    schedule each step while the previous one runs (same outputs). kv_cache_dtype: "auto" (the
    model's dtype) or "fp8" (float8 e4m3, half the cache's bytes and twice its tokens; the triton
    or reference attention backend; keys and values are stored unscaled, so outputs differ from
    "auto" by fp8's rounding of the cached tokens). persistent_decode: decode steps of 1-2
    sequences run every decoder layer in one persistent Triton kernel (kernels/decode_layer.py;
    one GPU); None: on for one CUDA GPU when the attention backend is "triton" (asked for, named
    by MINIVLLM_ATTENTION_BACKEND or chosen as the best) and the model is at most 1,024 wide; a
    draft model's decode graphs take it by the same rule for the draft's shape (False: neither
    does). generation_config: where the sampling
    defaults of requests that pass no SamplingParams come from (vLLM's): "auto" the model's
    generation_config.json (Qwen3: temperature 0.6, top_p 0.95, top_k 20), "vllm" none (plain
    SamplingParams()), or a directory holding one; override_generation_config: a dict of
    repetition_penalty / temperature / top_k / top_p / min_p / max_new_tokens set over it.
    get_default_sampling_params() returns the result. hf_overrides: config.json values set over
    the checkpoint's (vLLM's), e.g. Qwen3's long context: {"rope_scaling": {"rope_type": "yarn",
    "factor": 4.0, "original_max_position_embeddings": 32768}} (max_model_len then defaults to
    32,768 x 4); an object merges into the file's object of that key. reasoning_parser: "qwen3"
    makes structured outputs constrain a thinking model's answer, after its </think>, as vLLM's
    (runtime/reasoning.py; the server also splits the reasoning from the answer with it).
    runner: "generate", "pooling" (embeddings: LLM.embed, for Qwen3-Embedding checkpoints;
    classes and scores: LLM.classify and LLM.score, for a Qwen3ForSequenceClassification
    checkpoint or the original Qwen3-Reranker with vLLM's hf_overrides {"architectures":
    ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True}; such an LLM cannot generate, as in vLLM) or "auto"
    (vLLM's default: "pooling" for a sentence-transformers checkpoint, as Qwen3-Embedding's, for
    a bare Qwen3Model and for a Qwen3ForSequenceClassification, else "generate"). task: vLLM's
    older form of it ("embed", "classify" and "score" are runner="pooling").
    scheduling_policy: "fcfs" (arrival order) or "priority" (generate's priority=, lower first;
    the lowest priority is preempted first: runtime/scheduler.py), as vLLM's.
    speculative_config: vLLM's n-gram speculative decoding, {"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_max": N, "prompt_lookup_min": M}, or its
    draft-model one, {"model": DRAFT_DIR, "num_speculative_tokens": k} ("method": "draft_model"
    implied; a Qwen3 dense checkpoint of the same vocabulary, one device, no LoRA or prompt
    embeddings; sleep level 1 only) (runtime/spec_decode.py): outputs are those without it;
    it turns async_scheduling off, and sequences whose sampling reads their output (penalties,
    multi-token bad_words, structured outputs, min_tokens still pending) decode without drafts. LLM.stats counts the drafted and
    accepted tokens.
    enable_lora, max_loras, max_lora_rank: serve PEFT LoRA adapters (generate / chat / stream's
    lora_request=LoRARequest(name, int_id, path)), up to max_loras in one batch, of rank up to
    max_lora_rank (runtime/lora.py, state/lora.py); dense models, on one device or under
    tensor parallelism (each rank holds its shard of the adapters); compiled forward and decode
    CUDA graphs as without LoRA (steps without adapter rows replay the base engine's graphs;
    those with them a second set, decode and prefill, with the deltas).
    enable_prompt_embeds: generate / stream take vLLM's {"prompt_embeds": tensor [T,
    hidden_size]} prompts (README, "Prompt embeddings"): no prefix caching for them, no
    prompt_logprobs or beam search; their outputs' prompt_token_ids are None.
    enable_sleep_mode: LLM.sleep / wake_up may free the device memory of the weights and the KV
    cache between generations (an RL loop's trainer steps) and take it back (runtime/sleep.py).
    logprobs_mode: vLLM's, what a request's returned logprobs (the sampled token's, its rank, the
    top-N and cumulative_logprob, their sum) are taken from: "raw_logprobs" (the default: the
    model's distribution), "raw_logits", "processed_logprobs" (the distribution the token was
    drawn from: after allowed ids, bad words, min_tokens, logit bias, penalties and, at a
    temperature above 0, temperature, min-p, top-k and top-p; what RL loops set) or
    "processed_logits" (functional/sampling_batch.py, LOGPROBS_MODES). prompt_logprobs stay raw.
    beam_search, which ranks beams by summed logprobs, refuses the two logits modes.
    disable_log_stats: record no metrics (get_metrics() then refuses). Unlike vLLM's LLM, whose
    default is True, metrics are recorded by default: the engine keeps a few counters and
    histograms (runtime/metrics.py), cheap next to a step.
    """

    def __init__(self, model, *, tokenizer=None, dtype="auto", max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 block_size: int = 16, gpu_memory_utilization: float = 0.9,
                 num_kv_blocks: int | None = None, enforce_eager: bool = False,
                 tensor_parallel_size: int = 1, attention_backend: str | None = None, seed: int = 0,
                 enable_prefix_caching: bool = True, max_logprobs: int = 20, device=None,
                 skip_tokenizer_init: bool = False, async_scheduling: bool = True,
                 kv_cache_dtype="auto", persistent_decode: bool | None = None,
                 generation_config="auto", override_generation_config: dict | None = None,
                 hf_overrides: dict | None = None, reasoning_parser: str | None = None,
                 runner: str = "auto", task: str | None = None,
                 scheduling_policy: str = "fcfs", speculative_config: dict | None = None,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 enable_prompt_embeds: bool = False, disable_log_stats: bool = False,
                 enable_sleep_mode: bool = False, logprobs_mode: str = "raw_logprobs"):
        skip_tokenizer_init = as_flag("skip_tokenizer_init", skip_tokenizer_init, False)
        reasoning.check_parser(reasoning_parser)
        self.config = EngineConfig.create(
            model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, num_kv_blocks=num_kv_blocks,
            enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
            attention_backend=attention_backend, seed=seed,
            enable_prefix_caching=enable_prefix_caching, max_logprobs=max_logprobs, device=device,
            async_scheduling=async_scheduling, kv_cache_dtype=kv_cache_dtype,
            persistent_decode=persistent_decode, hf_overrides=hf_overrides, runner=runner,
            task=task, scheduling_policy=scheduling_policy,
            speculative_config=speculative_config, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank,
            enable_prompt_embeds=enable_prompt_embeds, enable_sleep_mode=enable_sleep_mode,
            logprobs_mode=logprobs_mode)
        self._diff_sampling_param, gen = generation_defaults(
            generation_config, override_generation_config, self.config.model)
        if self._diff_sampling_param:
            # Said at start-up (vLLM warns too): it changes what a call without SamplingParams
            # gives.
            log.info("minivllm: requests without SamplingParams use %s (from generation_config=%r%s)",
                     self._diff_sampling_param, generation_config,
                     " and override_generation_config" if override_generation_config else "")
        # Before the weights load and the cache is sized, so that a broken tokenizer is named
        # before that work; only on the rank that runs the engine (under torchrun, ranks > 0
        # serve rank 0 inside make_executor and then exit).
        launch = torchrun_env()
        tok = None
        if not skip_tokenizer_init and not is_random_model(self.config.model) and \
                (launch is None or launch.rank == 0):
            tok = load_tokenizer(os.fspath(tokenizer or self.config.model), required=tokenizer is not None)
        if reasoning_parser is not None and (launch is None or launch.rank == 0):
            reasoning.think_tags(tok)  # before the weights load (the engine's rank only)
        head = None  # a classifier's (runtime/classify.py): its tokens and tensor checked first
        if self.config.classifier is not None and (launch is None or launch.rank == 0):
            head = load_head(self.config.model, self.config.classifier,
                             self.config.model_config.hidden_size, tok)
        runner = make_executor(self.config)
        self.engine = LLMEngine(self.config, tok, runner=runner, generation_config=gen,
                                reasoning_parser=reasoning_parser, classifier=head)
        if disable_log_stats:  # as vLLM's flag: no metrics recorded (get_metrics refuses)
            self.engine.metrics = None
        # Requests of the calls in progress (generate, streams), and outputs one call's step
        # received for another's: see _next_outputs.
        self._owned: set[str] = set()
        self._parked: dict = {}

    # -- accessors -------------------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of requests that give none: see generation_config."""
        return SamplingParams(**self._diff_sampling_param)

    def get_diff_sampling_param(self) -> dict:
        """The SamplingParams fields that generation_config sets (vLLM's name), e.g. for a
        front end that sets the rest itself."""
        return dict(self._diff_sampling_param)

    def get_tokenizer(self):
        """The tokenizer; ValueError where this LLM has none, as vLLM's (whose only such case
        is skip_tokenizer_init=True; here also a random model, or a checkpoint without
        tokenizer files). minivllm's own callers read engine.tokenizer, None there."""
        if self.engine.tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True` (this LLM "
                             "has none: skip_tokenizer_init, a random model, or a checkpoint "
                             "without tokenizer files)")
        return self.engine.tokenizer

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's reset_prefix_cache): True. While unfinished
        requests hold blocks, whose K/V would stay cached past the reset, nothing is forgotten
        and it returns False with a warning, as vLLM's."""
        bm = self.engine.block_manager
        held = bm.num_blocks - bm.num_free
        if held:
            log.warning("minivllm: reset_prefix_cache: %d blocks are held by unfinished "
                        "requests; nothing reset (finish or abort them first)", held)
            return False
        bm.reset_prefix_cache()
        return True

    def load_weights(self, weights) -> None:
        """Update the model's weights in place from (Hugging Face name, tensor) pairs, e.g. a
        trainer's state_dict().items(), any subset (TRL / OpenRLHF call vLLM's model
        load_weights so): each tensor is cast to the model's dtype and copied into this rank's
        slice of its param (q/k/v into the merged qkv, gate/up into gate_up; at
        tensor_parallel_size > 1 into every rank's), and the prefix cache is reset. ValueError,
        with nothing changed, for an unknown name, a wrong shape or a non-float tensor,
        while requests are unfinished and while the weights sleep (sleep mode); quantized
        models are refused. A mixture of experts' experts go by their checkpoint names
        (mlp.experts.E.gate_proj.weight, ...) or transformers 5's fused ones
        (mlp.experts.gate_up_proj, mlp.experts.down_proj).
        See LLMEngine.load_weights."""
        self.engine.load_weights(_copyable(weights))

    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the weights and the KV cache (vLLM's sleep, with
        enable_sleep_mode=True): level 1 keeps the weights in host memory (pinned on a GPU) for
        wake_up to bring back; level 2 discards them too, for load_weights to refill after
        wake_up(tags=["weights"]) (until then they are zeros). The KV cache is discarded and the
        prefix cache reset. ValueError while requests are unfinished. Requests are refused until
        the engine is fully awake. See LLMEngine.sleep."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of `tags`, "weights" and / or "kv_cache" (None: both), as vLLM's
        wake_up; verl's order is wake_up(["weights"]), load_weights(...), wake_up(["kv_cache"]).
        See LLMEngine.wake_up."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache sleep (vLLM's is_sleeping)."""
        return self.engine.is_sleeping()

    def get_metrics(self) -> list:
        """vLLM's metrics now, as vLLM's LLM.get_metrics(): a list of
        minivllm.metrics.Counter / Gauge / Histogram / Vector (vLLM's vllm.v1.metrics.reader
        dataclasses; runtime/metrics_reader.py), the families and values that `minivllm serve`'s
        /metrics would show (labels model_name, this LLM's model path as vLLM's default
        served_model_name, and engine "0"). Counters are named without _total, as vLLM's
        reader names them. RuntimeError under disable_log_stats=True."""
        if self.engine.metrics is None:
            raise RuntimeError("Stat logging disabled. Set `disable_log_stats=False` argument "
                               "to export metrics.")
        from . import metrics, metrics_reader
        return metrics_reader.get_metrics_snapshot(metrics.snapshot(self.engine),
                                                   str(self.config.model))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the LLM cannot generate afterwards. Also
        done at exit and when the LLM is garbage collected."""
        stop = getattr(self.engine.runner, "shutdown", None)
        if stop is not None:
            stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- requests --------------------------------------------------------------------------------

    @staticmethod
    def _prompt_list(prompts) -> list:
        """One prompt or a list of them -> the list. As vLLM's prompt_to_seq and
        parse_dec_only_prompt, a list of token ids (list[int], told by its first item) is one
        prompt, {"prompt_token_ids": ids}, whether given alone or as an item of the list."""
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if prompts is None:
            raise ValueError("prompts is None")
        if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
            raise ValueError(f"prompts must be a prompt or a list of them, got {type(prompts).__name__}")
        if isinstance(prompts, list) and prompts and as_int(prompts[0]) is not None:
            return [{"prompt_token_ids": prompts}]
        prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
        if not prompts:
            raise ValueError("no prompts given")
        return prompts

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        return _one_per_prompt(sampling_params, SamplingParams, n, "sampling_params",
                               "sampling params")

    @staticmethod
    def _lora_list(lora_request, n: int) -> list:
        """One LoRARequest (or None: the base model) per prompt: one for all, or a list of one
        per prompt."""
        if lora_request is None:
            return [None] * n
        return _one_per_prompt(lora_request, LoRARequest, n, "lora_request", "lora requests")

    def _tokenized(self, prompts: list, params: list[SamplingParams],
                   tokenization_kwargs) -> tuple[list, list[SamplingParams]]:
        """vLLM's tokenization_kwargs over the prompts and their SamplingParams:
        truncate_prompt_tokens for each request that sets none of its own (vLLM's merge: the
        request's wins), add_special_tokens for the prompts given as text (tokenized here).
        Other keys are refused by name, rather than ignored as vLLM does with a warning."""
        if tokenization_kwargs is None:
            return prompts, params
        if not isinstance(tokenization_kwargs, dict):
            raise TypeError(f"tokenization_kwargs must be a dict or None, got "
                            f"{type(tokenization_kwargs).__name__}")
        unknown = sorted(map(str, set(tokenization_kwargs) -
                             {"truncate_prompt_tokens", "add_special_tokens"}))
        if unknown:
            raise ValueError(f"tokenization_kwargs: minivllm takes truncate_prompt_tokens and "
                             f"add_special_tokens, not {unknown}")
        keep = tokenization_kwargs.get("truncate_prompt_tokens")
        if keep is not None:  # SamplingParams checks the value (and names it)
            params = [sp if sp.truncate_prompt_tokens is not None else
                      dataclasses.replace(sp, truncate_prompt_tokens=keep) for sp in params]
        special = as_flag("tokenization_kwargs' add_special_tokens",
                          tokenization_kwargs.get("add_special_tokens"), True)
        if not special:
            prompts = tokenize_prompts(self.engine.tokenizer, prompts, add_special_tokens=False)
        return prompts, params

    def _add(self, prompts, sampling_params, priority=None, lora_request=None,
             use_tqdm: bool | Callable = False,
             tokenization_kwargs: dict | None = None) -> tuple[list[str], "_Progress | None"]:
        """Queue one request per prompt, all checked first: their ids, and the progress bar of
        use_tqdm (made after the checks and before any request is queued, so that a bar that
        cannot be made leaves the engine as it was, its seeds for unseeded requests undrawn)."""
        prompts = self._prompt_list(prompts)
        n = len(prompts)
        params = self._params_list(sampling_params, n)
        prompts, params = self._tokenized(prompts, params, tokenization_kwargs)
        loras = self._lora_list(lora_request, n)
        if as_int(priority) is not None:  # vLLM's: one priority for every prompt
            priority = [as_int(priority)] * n
        requests = self.engine.check_requests(prompts, params, priority, loras)
        bar = _Progress(n, self.engine.stats, use_tqdm) if use_tqdm else None
        try:
            ids = [self.engine.enqueue(*request) for request in requests]
        except BaseException:
            if bar:
                bar.close()
            raise
        return ids, bar

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool | Callable = True,
                 lora_request=None, priority: int | list[int] | None = None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Complete every prompt (a string, {"prompt": text}, a list of token ids or
        {"prompt_token_ids": [...]}, {"prompt_embeds": tensor} with enable_prompt_embeds, or a
        list of them, as vLLM's); results in input order. Every request is checked (ValueError)
        before any is scheduled. sampling_params: one SamplingParams for every prompt, a list of
        one per prompt, or None (get_default_sampling_params()). use_tqdm: a progress bar, or as
        vLLM's a callable that makes one (tqdm's arguments, e.g. functools.partial(tqdm,
        leave=False)). priority: an integer per prompt (or one for all), lower scheduled first,
        with scheduling_policy="priority" (vLLM's). lora_request: a LoRARequest for every
        prompt, or a list of one per prompt (None: the base model), with enable_lora.
        tokenization_kwargs: vLLM's truncate_prompt_tokens (for the requests whose
        SamplingParams set none) and add_special_tokens (for prompts given as text)."""
        ids, bar = self._add(prompts, sampling_params, priority, lora_request, use_tqdm,
                             tokenization_kwargs)
        return self._run(ids, use_tqdm, bar)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, *,
                    use_tqdm: bool = False, concurrency_limit: int | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search from each prompt (vLLM's `LLM.beam_search`; runtime/beam_search.py):
        per prompt, in input order, its best params.beam_width beams, best first. A beam ends at
        an EOS id (unless params.ignore_eos), after params.max_tokens tokens, or at max_model_len.
        lora_request: as generate's (one for every prompt, or a list of one per prompt; each
        prompt's beams run under its adapter). concurrency_limit: search this many prompts at a
        time (None: all at once). Every prompt is checked (ValueError) before any step runs."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or
                                              not isinstance(concurrency_limit, int) or
                                              concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got "
                             f"{concurrency_limit!r}")
        if self.config.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            # Each beam's score is a sum of the step's returned logprobs: logits summed and
            # length-penalised would rank the beams by no probability.
            raise ValueError(f"beam_search scores beams by their tokens' log-probabilities: it "
                             f"needs logprobs_mode 'raw_logprobs' or 'processed_logprobs', not "
                             f"{self.config.logprobs_mode!r} (logits)")
        step_params = params.step_params()
        if step_params.logprobs > self.config.max_logprobs:
            raise ValueError(f"beam_width={params.beam_width} takes {step_params.logprobs} "
                             f"logprobs a step, more than max_logprobs={self.config.max_logprobs}")
        # Checked as one request of max_tokens tokens: the longest beam's last step must fit
        # the cache.
        whole = dataclasses.replace(step_params, max_tokens=params.max_tokens)
        prompts = self._prompt_list(prompts)
        if any(isinstance(p, dict) and "prompt_embeds" in p for p in prompts):
            # Each step re-submits every beam as a prompt of ids (prompt + beam tokens).
            raise ValueError("beam_search does not take prompt_embeds prompts: it extends each "
                             "beam as a prompt of token ids, and embeddings have none")
        loras = self._lora_list(lora_request, len(prompts))
        check_lora_ids(loras)
        checked = [self.engine.check_request(p, whole, lr) for p, lr in zip(prompts, loras)]
        tok = self.engine.tokenizer

        def step(beams: list[list[int]], prompt_of: list[int]) -> list[dict]:
            outs = self.generate([{"prompt_token_ids": b} for b in beams], step_params,
                                 use_tqdm=False,
                                 lora_request=None if lora_request is None else
                                 [loras[k] for k in prompt_of])
            return [o.outputs[0].logprobs[0] for o in outs]

        def progress(steps: range):
            from tqdm.auto import tqdm

            return tqdm(steps, desc="Beam search", unit="token")  # the most steps; may end early

        return beam_search(step, [c.ids for c in checked], beam_width=params.beam_width,
                           max_tokens=params.max_tokens, eos_ids=self.engine.eos_ids,
                           length_penalty=params.length_penalty, ignore_eos=params.ignore_eos,
                           max_model_len=self.config.max_model_len,
                           concurrency_limit=concurrency_limit,
                           decode=tok.decode if tok is not None else None,
                           progress=progress if use_tqdm else None)

    def embed(self, prompts, pooling_params=None, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable = True,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (vLLM's LLM.embed; runtime/pooling.py), in input order: the
        final-normed hidden state at the prompt's last token, cut to pooling_params.dimensions and
        L2-normalised unless pooling_params.normalize is False. prompts as generate's;
        pooling_params: a PoolingParams, a list of them (one per prompt) or None (the default);
        truncate_prompt_tokens: set over every request's (keep the last k tokens; -1:
        max_model_len). Only an LLM of runner="pooling" that is no classifier embeds.
        lora_request: vLLM's argument; None only, as a pooling LLM serves no LoRA adapter
        (_check_pooling_lora). Every prompt is checked (ValueError / TypeError) before any step
        runs."""
        if self.config.runner != "pooling":  # vLLM's words, with minivllm's way out
            raise ValueError("Embedding API is not supported by this model: it runs as a "
                             "generative model. Try passing `runner=\"pooling\"` to use the "
                             "model as a pooling model.")
        if self.config.classifier is not None:
            raise ValueError("Embedding API is not supported by this model: it is a classifier "
                             "(Qwen3ForSequenceClassification); LLM.classify and LLM.score "
                             "serve it.")
        ids = self._add_pooling(prompts, pooling_params, truncate_prompt_tokens, "embed",
                                lora_request)
        return self._run(ids, use_tqdm)

    def classify(self, prompts, pooling_params=None, *,
                 truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool | Callable = True,
                 lora_request=None) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (vLLM's LLM.classify; runtime/classify.py), in input
        order: the classifier head on the final-normed hidden state at the prompt's last token,
        softmax over the labels (a sigmoid for one label; none for problem_type "regression",
        a sigmoid per label for "multi_label_classification"), or the logits with
        PoolingParams(use_activation=False). prompts, pooling_params, truncate_prompt_tokens and
        lora_request as embed's. Only an LLM of runner="pooling" whose model is a classifier
        classifies. Every prompt is checked (ValueError / TypeError) before any step runs."""
        if self.config.runner != "pooling":
            raise ValueError("LLM.classify() is only supported for pooling models. Try passing "
                             "`runner=\"pooling\"` to use the model as a pooling model.")
        if self.config.classifier is None:
            raise ValueError("Classification API is not supported by this model: it embeds. A "
                             "Qwen3ForSequenceClassification checkpoint classifies, as does a "
                             "Qwen3ForCausalLM one with hf_overrides naming that architecture "
                             "and classifier_from_token.")
        ids = self._add_pooling(prompts, pooling_params, truncate_prompt_tokens, "classify",
                                lora_request)
        return self._run(ids, use_tqdm)

    def score(self, data_1, data_2, /, *, pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable = True,
              lora_request=None) -> list[ScoringRequestOutput]:
        """A score per pair (vLLM's LLM.score; runtime/scoring.py): data_1 a text (or
        {"prompt": text}, or {"prompt_token_ids": ids}, decoded to its text as vLLM did) or a
        list of them, data_2 likewise; one data_1 is paired with every data_2 (1:N), else the
        lists pair in order (N:N). A cross-encoder (a classifier of one label, as the original
        Qwen3-Reranker with its hf_overrides) scores each pair joined into one prompt: for the
        reranker P(yes) = sigmoid(logit_yes - logit_no) at its last token. An embedding model
        scores the cosine of the two texts' embeddings. pooling_params: use_activation (False:
        the raw logit), and for an embedding model its embedding's fields;
        truncate_prompt_tokens: keep each prompt's last k tokens; lora_request as embed's. Every
        input is checked (ValueError / TypeError) before any step runs."""
        self._check_pooling_lora(lora_request)
        plan = self.score_plan(data_1, data_2, pooling_params, truncate_prompt_tokens)
        ids = self.engine.add_pooling_requests(plan.prompts, plan.params)
        return plan.finish(self._run(ids, use_tqdm))

    def score_plan(self, data_1, data_2, pooling_params: PoolingParams | None = None,
                   truncate_prompt_tokens: int | None = None) -> ScorePlan:
        """The engine requests that score data_1 against data_2, and how their outputs become
        the scores (LLM.score's, and the server's /score and /rerank)."""
        if self.config.runner != "pooling":  # vLLM's words
            raise ValueError("LLM.score() is only supported for pooling models. Try passing "
                             "`runner=\"pooling\"` to use the model as a pooling model.")
        params = PoolingParams() if pooling_params is None else pooling_params
        if truncate_prompt_tokens is not None and isinstance(params, PoolingParams):
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        return plan_scores(data_1, data_2, params, tokenizer=self.engine.tokenizer,
                           head=self.config.classifier)

    def _add_pooling(self, prompts, pooling_params, truncate_prompt_tokens, task: str,
                     lora_request=None) -> list[str]:
        """Queue one pooling request of `task` per prompt (embed's and classify's), all checked
        first."""
        prompts = self._prompt_list(prompts)
        self._check_pooling_lora(lora_request, len(prompts))
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        elif isinstance(pooling_params, (list, tuple)):
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} pooling params")
        else:
            raise TypeError(f"pooling_params must be a PoolingParams, a list of them or None, "
                            f"got {type(pooling_params).__name__}")
        if truncate_prompt_tokens is not None:  # checked as PoolingParams checks it
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                      if isinstance(p, PoolingParams) else p for p in params]
        # Each set to the call's task (a PoolingParams naming another is refused, as vLLM's);
        # anything else is left for the engine's check to name.
        params = [p.for_task(task) if isinstance(p, PoolingParams) else p for p in params]
        return self.engine.add_pooling_requests(prompts, params)

    @staticmethod
    def _check_pooling_lora(lora_request, n: int | None = None) -> None:
        """A pooling call's lora_request (vLLM's: a LoRARequest, a list of one or None per
        prompt, or None), checked before any work: TypeError for anything else, ValueError for a
        list of another length than the n prompts (score's pairs are counted after: None), and
        ValueError for any adapter at all. minivllm's LoRA serves generating models only (a
        pooling LLM cannot enable_lora): an adapter the embeddings would silently leave out is
        refused."""
        if lora_request is None:
            return
        if isinstance(lora_request, LoRARequest):
            loras = [lora_request]
        elif isinstance(lora_request, (str, bytes, dict)) or \
                not isinstance(lora_request, Iterable):
            raise TypeError(f"lora_request must be a LoRARequest, a list of them or None, got "
                            f"{type(lora_request).__name__}")
        else:
            loras = list(lora_request)
            for lr in loras:
                if lr is not None and not isinstance(lr, LoRARequest):
                    raise TypeError(f"lora_request's items must be LoRARequests or None, got "
                                    f"{type(lr).__name__}")
            if n is not None and len(loras) != n:
                raise ValueError(f"{n} prompts but {len(loras)} lora requests")
        named = next((lr for lr in loras if lr is not None), None)
        if named is not None:
            raise ValueError(f"LoRA adapter {named.lora_name!r} asked of a pooling call: "
                             f"minivllm serves LoRA adapters to generating models only "
                             f"(generate, chat, stream with enable_lora=True; a pooling LLM "
                             f"cannot enable it); embed, classify and score take "
                             f"lora_request=None")

    def chat(self, messages, sampling_params=None, use_tqdm: bool | Callable = True,
             lora_request=None, chat_template=None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Complete one conversation (a list of {"role", "content"} dicts) or a list of them,
        formatted by the tokenizer's chat template (with `tools`, OpenAI's function
        definitions, for a template that lists them, as Qwen3's). continue_final_message
        (with add_generation_prompt=False, as vLLM's) leaves the last message open, without
        its end of turn, for the model to continue ("prefill"); the outputs hold only the new
        text. The parameters are vLLM's, in its order; chat_template_content_format: "auto" or
        "string" (a message's content reaches the template as one string; "openai", its parts
        as a list, is refused). tokenization_kwargs: generate's (the prompts are the template's
        text tokenized without special tokens: its add_special_tokens changes nothing)."""
        prompts = self.chat_prompts(messages, chat_template=chat_template,
                                    chat_template_content_format=chat_template_content_format,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs, tools=tools)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)

    def chat_prompts(self, messages, *, chat_template=None,
                     chat_template_content_format: str = "auto",
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: dict | None = None, tools: list[dict] | None = None
                     ) -> list[dict]:
        """Conversations -> prompts ({"prompt", "prompt_token_ids"}) through the chat template,
        each message read as vLLM's parser reads it (chat_messages.chat_message: text parts
        joined, string tool-call arguments parsed; a malformed message raises before any is
        rendered). chat_template_kwargs' chat_template / tools / add_generation_prompt /
        continue_final_message win over the arguments, as in vLLM's LLM.chat before its
        renderers (current vLLM's let the arguments win); continue_final_message renders as
        transformers' apply_chat_template(continue_final_message=True): the text stops right
        after the last message's content."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer, and this engine has none")
        if chat_template_content_format == "openai":
            raise ValueError("chat_template_content_format='openai' (a message's content as a "
                             "list of parts) is not supported: minivllm hands the template each "
                             "message's text as one string ('string'; 'auto' does the same)")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or "
                             f"'openai', got {chat_template_content_format!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict or None, got "
                            f"{type(chat_template_kwargs).__name__}")
        kwargs = dict(chat_template_kwargs or {})
        # vLLM renders the text and tokenizes it after (its tokenize=False wins over theirs);
        # passed on, transformers' "got multiple values for keyword argument 'tokenize'".
        kwargs.pop("tokenize", None)
        # chat_template_kwargs win over the arguments, as vLLM's LLM.chat updated its template
        # arguments with them (before its renderers: current vLLM's merge_kwargs lets the
        # arguments that are not None win; tests/test_engine.py pins this order).
        chat_template = kwargs.pop("chat_template", chat_template)
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a Jinja template string or None, got "
                            f"{type(chat_template).__name__}")
        if tools is not None:
            kwargs.setdefault("tools", tools)
        conversations = read_conversations(messages)
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        if continue_final_message and add_generation_prompt:
            # transformers' refusal, which vLLM's LLM.chat passes on as a ValueError
            raise ValueError("continue_final_message and add_generation_prompt are not "
                             "compatible: pass add_generation_prompt=False to continue the "
                             "final message")
        if continue_final_message:
            kwargs["continue_final_message"] = continue_final_message
        prompts = []
        for conv in conversations:
            if continue_final_message and not conv:  # transformers' refusal too
                raise ValueError("continue_final_message is set but the conversation is empty")
            try:
                text = tok.apply_chat_template(conv, tokenize=False,
                                               chat_template=chat_template,
                                               add_generation_prompt=add_generation_prompt,
                                               **kwargs)
            except RecursionError:  # the template's tojson over a deeply nested tool schema, say
                raise ValueError("the conversation or its tools nest too deep for the chat "
                                 "template to render (past Python's recursion limit)") from None
            except (ValueError, TypeError):
                raise
            except Exception as e:  # jinja's TemplateError (raise_exception), a 1/0: vLLM's
                raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e
            # The template writes any special tokens itself.
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return prompts

    def stream(self, prompts, sampling_params=None, *, lora_request=None
               ) -> Iterator[RequestOutput]:
        """Yield incremental outputs as they are produced: each RequestOutput holds, per
        completion, only the text, token ids and logprobs that are new since the last one yielded
        for that request (`finished` and finish_reason on the last). Text that could be the
        start of a stop string is held back until it is known not to be one. Bad requests raise
        here, not at the first next(); the requests are queued at the first next()."""
        prompts = self._prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        loras = self._lora_list(lora_request, len(prompts))
        check_lora_ids(loras)
        checked = [self.engine.check_request(p, sp, lr)
                   for p, sp, lr in zip(prompts, params, loras)]
        for lr in loras:  # all accepted: their ids are bound now, as a generate's would be
            self.engine.check_lora(lr)
        return self._stream(checked, params, loras)

    def _stream(self, checked: list, params: list[SamplingParams],
                loras: list | None = None) -> Iterator[RequestOutput]:
        loras = loras or [None] * len(params)
        ids = [self.engine.enqueue(prompt, sp, 0, lr)
               for prompt, sp, lr in zip(checked, params, loras)]
        mine = set(ids)
        # (request, index) -> progress; (request, "prompt") -> its prompt_logprobs were sent
        sent: dict[tuple[str, int | str], tuple[int, int, bool] | bool] = {}
        self._owned |= mine
        try:
            while mine:
                for out in self._next_outputs(mine, unfinished=True):
                    delta = _delta(out, sent)
                    if out.finished:
                        mine.discard(out.request_id)
                    if delta is not None:
                        yield delta
        finally:
            self._release(ids, abort=mine)  # the caller stopped early: free the cache

    # -- the loop --------------------------------------------------------------------------------

    def _next_outputs(self, mine: set[str], *, unfinished: bool) -> list[RequestOutput]:
        """The next outputs of the requests in `mine`: those another call's steps received for
        them, else one engine step's. Outputs of other live calls' requests are kept for those
        calls (the latest, outputs being cumulative), so that calls interleaved (a stream paused
        while generate runs, two streams read in turn) each get all of theirs."""
        if self._parked:
            parked = [self._parked.pop(i) for i in mine if i in self._parked]
            if parked:
                return parked
        outs = []
        for out in self.engine.step(unfinished=unfinished):
            if out.request_id in mine:
                outs.append(out)
            elif out.request_id in self._owned:
                self._parked[out.request_id] = out
        if not outs and not any(i in self.engine.requests for i in mine):
            raise RuntimeError(f"requests {sorted(mine)} are no longer in the engine (aborted "
                               f"through the engine directly?)")
        return outs

    def _release(self, ids: list[str], abort) -> None:
        """A call is over: forget its requests, aborting those in `abort` (left unfinished)."""
        for request_id in abort:
            self.engine.abort_request(request_id)
        for request_id in ids:
            self._owned.discard(request_id)
            self._parked.pop(request_id, None)

    def _run(self, ids: list[str], use_tqdm: bool | Callable,
             bar: "_Progress | None" = None) -> list[RequestOutput]:
        """Step the engine until the requests `ids` finish: their outputs, in that order.
        bar: the progress bar already made (generate's), else one is made here if use_tqdm."""
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        self._owned |= pending
        try:
            # Inside: a bar that cannot be made (tqdm.auto's "IProgress not found" in a notebook
            # without ipywidgets) left the queued requests running on in the engine.
            if bar is None and use_tqdm:
                bar = _Progress(len(ids), self.engine.stats, use_tqdm)
            while pending:
                for out in self._next_outputs(pending, unfinished=False):
                    if out.finished:
                        pending.discard(out.request_id)
                        final[out.request_id] = out
                        if bar:
                            bar.update(1)
                if bar:
                    bar.refresh()
        finally:
            self._release(ids, abort=pending)
            if bar:
                bar.close()
        return [final[i] for i in ids]


def _copyable(weights) -> Iterator:
    """load_weights' pairs, each tensor checked, as they pass into the engine's check of every
    pair before any is copied, to hold values that copy_ can read: ValueError for a meta tensor
    (no data) or a sparse or mkldnn one (copy_ into a dense param fails), which would otherwise
    fail the copy part-way, the weights before it new and the rest old."""
    for item in weights:
        tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else None
        if isinstance(tensor, torch.Tensor) and (tensor.is_meta or
                                                 tensor.layout != torch.strided):
            what = "meta" if tensor.is_meta else str(tensor.layout).removeprefix("torch.")
            raise ValueError(f"load_weights: {item[0]} is a {what} tensor; weights are dense "
                             f"tensors holding their values")
        yield item


def _delta(out: RequestOutput, sent: dict) -> RequestOutput | None:
    """What is new in `out` since `sent` recorded; None when nothing is new. (The engine's
    unfinished texts already leave out what a stop string could still cut.)"""
    outputs = []
    for c in out.outputs:
        chars, tokens, ended = sent.get((out.request_id, c.index), (0, 0, False))
        # replace: every other field (lora_request, kv_transfer_params, ...) as the whole's
        new = dataclasses.replace(c, text=c.text[chars:], token_ids=c.token_ids[tokens:],
                                  logprobs=c.logprobs[tokens:] if c.logprobs is not None else None)
        sent[(out.request_id, c.index)] = (len(c.text), len(c.token_ids), c.finished())
        # A completion that ended is sent once with its finish_reason, not again with each delta
        # of its siblings (n > 1).
        if new.text or new.token_ids or (new.finish_reason is not None and not ended):
            outputs.append(new)
    # The prompt's scores, once: with the first delta after the prompt is scored (as vLLM).
    prompt_logprobs = None
    if out.prompt_logprobs is not None and not sent.get((out.request_id, "prompt")):
        sent[(out.request_id, "prompt")] = True
        prompt_logprobs = out.prompt_logprobs
    if not outputs and not out.finished and prompt_logprobs is None:
        return None
    # The request's own fields (lora_request, metrics, ...) as the whole output's, as vLLM's
    # deltas carry them.
    return dataclasses.replace(out, outputs=outputs, prompt_logprobs=prompt_logprobs)


class _Progress:
    """A tqdm bar over finished requests, showing prompt and generation throughput."""

    def __init__(self, total: int, stats: EngineStats, use_tqdm: bool | Callable = True):
        from tqdm.auto import tqdm

        self.stats = stats
        self.start = time.perf_counter()
        self.base = (stats.prompt_tokens_computed + stats.prompt_tokens_cached, stats.generation_tokens)
        # vLLM's use_tqdm: a callable is the bar's factory, called with tqdm's arguments
        make = use_tqdm if callable(use_tqdm) else tqdm
        self.bar = make(total=total, desc="Processed prompts", dynamic_ncols=True,
                        postfix="input: 0.00 toks/s, output: 0.00 toks/s")

    def update(self, n: int) -> None:
        self.bar.update(n)

    def refresh(self) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        s = self.stats
        prompt = s.prompt_tokens_computed + s.prompt_tokens_cached - self.base[0]
        gen = s.generation_tokens - self.base[1]
        self.bar.set_postfix_str(f"input: {prompt / elapsed:.2f} toks/s, output: {gen / elapsed:.2f} toks/s",
                                 refresh=False)

    def close(self) -> None:
        self.refresh()
        self.bar.close()
