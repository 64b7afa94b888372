"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

add_requests checks every request before any is queued (a bad one raises ValueError and leaves
the engine as it was); step() schedules, runs the model runner, records the sampled tokens,
detokenizes incrementally and applies stop strings, and returns the outputs of the requests the
step touched.

With asynchronous scheduling (the default, on one device and under tensor parallelism), step()
schedules and launches step N+1 before it reads step N's tokens: the host's work for one step
(scheduling, building the batch, detokenizing, stop checks) runs while the device computes the
other, instead of the device waiting for it. A token still being sampled stands as PENDING in its
sequence and is fed to the next step from the device (see Scheduler.advance / resolve). The
outputs are the same as with synchronous steps; what changes is that a sequence an EOS or stop
token ends computes one more token, which is dropped, and that step() returns a step's outputs one
call later.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import reprlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch

from ..functional.classify import activate, classifier_logits
from ..functional.pooling import pooled_embedding
from ..functional.sampling import SamplingRow
from ..state.batch import DecodeChunks, SeqChunk
from ..state.classifier import ClassifierHead
from ..state.config import FP8_DTYPES
from ..state.load import check_hf_weights
from ..state.values import as_int
from .bad_words import banned_by_bad_words, bad_word_ids
from .block_manager import BlockManager
from .classify import ClassificationOutput, ClassificationRequestOutput, load_head
from .config import EngineConfig
from .detokenizer import detokenize_incrementally, find_stop_string, prompt_offsets
from .executor import make_executor
from .generation_config import FILE as GEN_FILE, eos_ids_of, read_generation_config
from . import reasoning
from .guide import CompiledGuide, Guide, GuideCache, bits_constraint
from .lora import LoRARequest, LoRASlots
from .metrics import EngineMetrics
from .outputs import CompletionOutput, Logprob, RequestOutput
from .pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from .runner import ModelRunner, PromptScores, StepInput, StepResult, trace_range
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import PENDING, PLACEHOLDER, Sequence, Status, check_cache_salt
from .sleep import TAGS, check_level, check_tags
from .spec_decode import ngram_propose

log = logging.getLogger("minivllm")

_GOLDEN = 0x9E3779B97F4A7C15
_NEVER_SAMPLED = SamplingParams(max_tokens=1)  # an embedding's sequence's (enqueue_pooling)


@dataclass
class EngineStats:
    """Counters since the engine started (tokens, not time: tests assert on them)."""

    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt positions run through the model (recomputes included)
    prompt_tokens_cached: int = 0  # prompt positions found in the prefix cache at first admission
    tokens_recomputed: int = 0  # generated positions run again after a preemption
    generation_tokens: int = 0  # tokens sampled
    preemptions: int = 0
    max_step_tokens: int = 0
    max_step_seqs: int = 0
    # Speculative decoding (runtime/spec_decode.py): draft tokens proposed and run, and those
    # accepted (their acceptance rate is spec_accepted_tokens / spec_draft_tokens).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # vLLM's spec-decode metrics: drafts (a sequence's step with draft tokens), and how many
    # drafts had their token at each position accepted (index 0: the first draft token).
    spec_drafts: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams | PoolingParams
    seqs: list[Sequence] = field(default_factory=list)
    # A prompt given as embeddings (prompt_embeds): its prompt_ids are placeholders, and its
    # output's prompt_token_ids None.
    embeds: bool = False
    # A pooling request's result, once its step is read: the embedding, or the classifier's
    # probabilities (or score).
    pooled: list[float] | None = None
    lora_request: LoRARequest | None = None  # what it was queued with, for its outputs

    @property
    def pooling(self) -> bool:
        return isinstance(self.params, PoolingParams)

    @property
    def task(self) -> str | None:
        """A pooling request's task ("embed", "classify" or "score"); None for a generation."""
        return (self.params.task or "embed") if self.pooling else None

    @property
    def finished(self) -> bool:
        # A pooling request's sequence ends when its last step is launched; the request, when
        # that step's hidden state is read.
        if self.pooling:
            return self.pooled is not None
        return all(s.finished for s in self.seqs)


def read_eos_ids(model_dir: str, model_config, tokenizer, generation_config: dict | None = None
                 ) -> tuple[int, ...]:
    """EOS ids: the tokenizer's, the config's and generation_config.json's (Qwen3 lists two;
    the file read from model_dir unless given, as LLM's generation_config may name another).
    The first is the EOS proper (the tokenizer's, else the config's first): a completion it ends
    has stop_reason None, one the others end that id, as vLLM, which treats those as stop ids."""
    ids = []
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    ids.extend(model_config.eos_token_ids)
    if generation_config is None:
        generation_config = read_generation_config(model_dir)
    ids.extend(eos_ids_of(generation_config, os.path.join(model_dir, GEN_FILE)))
    return tuple(dict.fromkeys(int(i) for i in ids))


def check_lora_ids(lora_requests) -> None:
    """ValueError where one call's lora requests give one lora_int_id two adapters: checked
    before any request is queued, since enqueue binds each id to its adapter in turn."""
    seen: dict[int, LoRARequest] = {}
    for lr in lora_requests:
        if isinstance(lr, LoRARequest):
            first = seen.setdefault(lr.lora_int_id, lr)
            if first.lora_path != lr.lora_path:
                raise ValueError(f"lora_int_id {lr.lora_int_id} names adapter "
                                 f"{first.lora_path!r} and {lr.lora_path!r}: one id per adapter")


def prompt_cache_salt(prompt: Any) -> str | None:
    """A prompt dict's cache_salt (vLLM's TextPrompt / TokensPrompt / EmbedsPrompt key), checked
    before any other work on the prompt; None where it gives none (or None)."""
    return check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None


def tokenize_prompts(tokenizer, prompts: list, add_special_tokens: bool = True) -> list:
    """The text prompts among `prompts` (a str, or a {"prompt"} dict, vLLM's cache_salt beside
    it or not) as {"prompt", "prompt_token_ids"} (the salt kept), tokenized as the engine
    tokenizes them, or without the tokenizer's special tokens (add_special_tokens=False: vLLM's
    request field and tokenization_kwargs), for callers that must know their ids first. Token
    ids, embeddings, texts without a tokenizer and malformed prompts are left as they are, for
    the engine's checks to take or name."""
    if tokenizer is None:
        return prompts
    special = {} if add_special_tokens else {"add_special_tokens": False}
    out = []
    for p in prompts:
        if isinstance(p, str):
            p = {"prompt": p}
        elif not (isinstance(p, dict) and set(p) <= {"prompt", "cache_salt"} and
                  isinstance(p.get("prompt"), str)):
            out.append(p)
            continue
        out.append({**p, "prompt_token_ids": tokenizer.encode(p["prompt"], **special)})
    return out


class CheckedPrompt(NamedTuple):
    """A prompt that check_request (or check_pooling_request) accepted, as enqueue takes it:
    its text (None where it came as ids or embeddings), its ids (or {"prompt_embeds"}' [T,
    hidden] on the host), and vLLM's cache_salt (None: unsalted; a prompt of embeddings keeps
    none, as its blocks are never shared at all)."""

    text: str | None
    ids: list[int] | torch.Tensor
    cache_salt: str | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, runner: ModelRunner | None = None,
                 generation_config: dict | None = None, reasoning_parser: str | None = None,
                 classifier: ClassifierHead | None = None):
        self.config = config
        self.tokenizer = tokenizer
        # With a reasoning parser, structured outputs constrain the answer, not the reasoning:
        # the ids of <think> and </think> (runtime/reasoning.py).
        self.think_tags = (reasoning.think_tags(tokenizer)
                           if reasoning.check_parser(reasoning_parser) else None)
        # A ModelRunner, or at tensor_parallel_size > 1 an executor that drives one per rank
        # (under torchrun, ranks > 0 serve rank 0 inside make_executor and then exit).
        self.runner = runner if runner is not None else make_executor(config)
        self.model_config = self.runner.model_config
        self.vocab_size = self.model_config.vocab_size
        # A classifier's head (runtime/classify.py), applied to the pooled hidden states of
        # classify and score requests: the one given (LLM loads it before the weights), else
        # the checkpoint's, when the config names one.
        if classifier is None and config.classifier is not None:
            classifier = load_head(config.model, config.classifier,
                                   self.model_config.hidden_size, tokenizer)
        self.classifier = classifier
        self.num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(self.num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        # An fp8 cache's decode kernel is latency-bound, so its launch's tail counts: +3.7% with
        # the longest contexts first; a 16-bit cache's kernel reads at the copy rate: -0.3% there
        # (session 14).
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=config.max_model_len,
                                   longest_decodes_first=config.cache_dtype in FP8_DTYPES,
                                   policy=config.scheduling_policy,
                                   speculator=self._propose if config.speculative else None,
                                   max_loras=config.max_loras if config.enable_lora else None)
        # LoRA (runtime/lora.py): which adapter each of the runner's slots holds, and the
        # adapters read from disk, by lora_int_id (request, adapter), least recently used first.
        self.loras = LoRASlots(config.max_loras) if config.enable_lora else None
        self._adapters: OrderedDict = OrderedDict()
        self._lora_ids: dict[int, LoRARequest] = {}  # id -> the adapter it names (check_lora)
        # (id, path) -> adapters read by check_request's check, not yet bound to their id: a
        # call refused later binds nothing; enqueue takes them from here (never read twice).
        self._lora_reads: OrderedDict = OrderedDict()
        # id -> the lora_name it last came with, for /metrics' adapter lists; unlike _lora_ids
        # kept past remove_lora, whose adapter's running requests finish under its name.
        self.lora_names: dict[int, str] = {}
        self.eos_ids = read_eos_ids(config.model, self.model_config, tokenizer, generation_config)
        self.rng = random.Random(config.seed)
        # Structured outputs' compiled constraints (runtime/guide.py), made at the first.
        self._guides: GuideCache | None = None
        # bad_words as token ids, by the words: a request's are read when it is checked and
        # again when it is queued, and requests often share a list (one SamplingParams for a
        # batch's prompts, a beam search's every step), so each list is tokenized once while
        # it is among the most recent. The ids are immutable tuples, shared by the sequences.
        self._bad_word_ids = functools.lru_cache(maxsize=64)(
            functools.partial(bad_word_ids, tokenizer=tokenizer))
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        # vLLM's metrics (runtime/metrics.py; serve's /metrics), or None: not recorded (serve
        # --disable-log-stats). The sequences the scheduler ended since they were last recorded,
        # and the token streak: the sequences that got a token in the last step that read
        # tokens, and when (_record_token_times).
        self.metrics: EngineMetrics | None = EngineMetrics(config.max_model_len)
        self._finished_seqs: list[Sequence] = []
        self.scheduler.on_finish = self._finished_seqs.append
        self._streak: list[Sequence] = []
        self._streak_time = 0.0
        # Asynchronous scheduling needs a runner that can launch a step without waiting for it
        # (a ModelRunner, and the tensor-parallel executor).
        # Speculative decoding records each step before the next is scheduled (EngineConfig turns
        # asynchronous scheduling off with it; an EngineConfig built by hand is held to it too).
        self.async_scheduling = (config.async_scheduling and hasattr(self.runner, "launch")
                                 and config.speculative is None)
        self.in_flight = None  # (SchedulerOutput, PendingStep) of the launched, unread step
        # A launched step whose tokens an interrupt (Ctrl-C) kept from being read: they wait in
        # its own host buffers, and the next step() reads them first (_resolve).
        self.unread = None
        # Outputs of a step read while a later one failed, for the next step() to return.
        self.undelivered: list[RequestOutput] = []
        self._next_seq_id = 0
        self._next_request_id = 0
        self.sleeping: set[str] = set()  # the sleep mode's tags asleep (runtime/sleep.py)
        capacity = self.num_blocks * config.block_size
        if capacity < config.max_model_len:
            log.warning("minivllm: the KV cache holds %d tokens, less than max_model_len=%d; "
                        "requests that could outgrow it are refused", capacity, config.max_model_len)

    # -- requests --------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            # vLLM's prompt dicts also carry multi_modal_data, ...: asked for and dropped
            # without a word, they would change what the request means. cache_salt is read by
            # the callers (prompt_cache_salt).
            if "prompt_embeds" in prompt:  # check_request takes them before coming here
                raise ValueError("prompt_embeds are taken by generate (LLM.generate, stream), "
                                 "with enable_prompt_embeds=True; not here")
            unknown = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids",
                                                     "cache_salt"}))
            if unknown:
                raise ValueError(f"a prompt dict holds 'prompt' and / or 'prompt_token_ids' "
                                 f"(and 'cache_salt'); minivllm does not take {unknown}")
            if "prompt_token_ids" in prompt:
                ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"a prompt dict's 'prompt' must be a string, got "
                                     f"{type(text).__name__}")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        else:
            raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass {'prompt_token_ids': [...]}")
            ids = self.tokenizer.encode(text)
        given = ids
        if hasattr(ids, "tolist"):  # an array or tensor: a 0-d one gives a single int
            ids = ids.tolist()
        if isinstance(ids, (str, bytes, set, frozenset, dict)) or not hasattr(ids, "__len__"):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {reprlib.repr(given)}")
        ids = list(ids)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        # Plain ints (the common case) are checked by min / max at C speed: a beam search
        # submits each beam's whole prefix again every step. Anything else goes one by one.
        if all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < self.vocab_size:
            return text, ids
        for k, given_id in enumerate(ids):
            t = as_int(given_id)  # ints, and numpy / torch integer scalars
            if t is None:
                # a bounded repr: a nested list of a million ids is no error message
                raise ValueError(f"prompt_token_ids holds {given_id!r:.80}, not an int token "
                                 f"id")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {self.vocab_size})")
            ids[k] = t
        return text, ids

    def check_lora(self, lora_request: LoRARequest | None, *, bind: bool = True):
        """The adapter (state.lora.LoRAAdapter) of a request's lora_request, read and checked
        once per lora_int_id (kept while recently used); None for None. ValueError when this
        engine has no LoRA, or the adapter cannot be served (state.lora.load_adapter's).
        bind=False (check_request's): checked only, the id not bound to the adapter, so that a
        call refused after this check leaves the engine as it was."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if not self.config.enable_lora:
            raise ValueError(f"a request for LoRA adapter {lora_request.lora_name!r}, but LoRA "
                             f"is not enabled: LLM(..., enable_lora=True) (serve --enable-lora)")
        lid = lora_request.lora_int_id
        # The id's adapter, kept after its weights leave self._adapters (its slot and cached
        # prefix blocks may still hold them) until remove_lora.
        first = self._lora_ids.get(lid)
        if first is not None and first.lora_path != lora_request.lora_path:
            raise ValueError(f"lora_int_id {lid} is adapter {first.lora_name!r} at "
                             f"{first.lora_path!r}, not {lora_request.lora_path!r}: one "
                             f"id per adapter")
        known = self._adapters.get(lid)
        if known is not None:
            if bind:
                self._adapters.move_to_end(lid)
                self.lora_names[lid] = lora_request.lora_name  # for the metrics' adapter lists
            return known[1]
        from ..state.lora import load_adapter

        key = (lid, lora_request.lora_path)
        adapter = self._lora_reads.pop(key, None) if bind else self._lora_reads.get(key)
        if adapter is None:
            # In the slots' dtype: a weight past its range (inf there) would spoil every row
            adapter = load_adapter(lora_request.lora_path, self.model_config,
                                   self.config.max_lora_rank, dtype=self.config.dtype)
        if first is None:  # a new id, or one remove_lora forgot: nothing of an earlier adapter
            self._clear_lora_id(lid, adapter.path, forget=bind)  # under it may serve this one
        if not bind:
            self._lora_reads[key] = adapter
            while len(self._lora_reads) > max(2 * self.config.max_loras, 8):
                self._lora_reads.popitem(last=False)
            return adapter
        self._adapters[lid] = (lora_request, adapter)
        self.lora_names[lid] = lora_request.lora_name
        self._lora_ids[lid] = lora_request
        # Those in slots are re-read only if also pushed out of here (running sequences hold
        # their own adapter).
        while len(self._adapters) > max(2 * self.config.max_loras, 8):
            self._adapters.popitem(last=False)
        return adapter

    def _clear_lora_id(self, lid: int, path: str, *, forget: bool = True) -> None:
        """Before adapter `path` takes id lid: forget lid's slot and prefix-cache blocks (an
        earlier adapter's, removed; not with forget=False, a check only). ValueError while
        sequences of another adapter under lid still run (their slot holds its weights)."""
        users = [seq for seq in self.scheduler.sequences if seq.lora_id == lid]
        if users:
            if users[0].lora.path != path:
                raise ValueError(f"lora_int_id {lid} was removed, and requests of its adapter "
                                 f"at {users[0].lora.path!r} still run: give adapter {path!r} "
                                 f"another id, or wait for them to finish")
            return  # the same adapter: its slot and cached blocks hold its weights
        if not forget:
            return
        self.loras.forget(lid)
        self.block_manager.forget_root(-lid)

    def load_weights(self, weights) -> None:
        """Copy new weights (an iterable of (Hugging Face name, tensor) pairs, any subset of the
        model's) into the model in place, then forget the prefix cache, whose blocks hold K/V the
        old weights computed. Every pair is checked before any is copied
        (state.load.check_hf_weights): a ValueError changes nothing. Refused while requests are
        unfinished: their K/V so far is the old weights', their next tokens would be the new
        ones' (vLLM lets it happen; a sequence of mixed weights is no policy's sample)."""
        if self.has_unfinished_requests():
            raise ValueError("load_weights while requests are unfinished would mix weights: "
                             "their KV cache holds the old weights' keys and values, their next "
                             "tokens would be the new weights'; finish or abort them first")
        if "weights" in self.sleeping:
            raise ValueError("load_weights while the weights sleep (their memory is freed): "
                             "wake_up(tags=['weights']) first")
        checked = check_hf_weights(self.runner.params, weights)
        self.runner.load_weights(checked)
        # No sequence holds a block now: every registered one is forgotten.
        self.block_manager.reset_prefix_cache()

    # -- sleep mode (runtime/sleep.py) -------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: free the device memory of the weights (level 1: copied to the host
        first; level 2: discarded, for load_weights to fill after wake_up) and of the KV cache,
        whose prefix cache is forgotten; a draft model's weights and cache with the target's.
        Refused (ValueError, nothing changed) without enable_sleep_mode, for a level other than
        1 or 2, for level 2 with a draft model (whose weights load_weights would not refill:
        runtime/sleep.py), and while requests are unfinished. An engine asleep already stays as
        it is, with a warning (vLLM's). A sleep that fails raises with the engine awake and
        usable, its prefix cache forgotten, unless level 2 had begun discarding the weights:
        then it sleeps, as after level 2 (ModelRunner.sleep)."""
        self._check_sleep_mode("sleep")
        spec = self.config.speculative
        check_level(level, draft_model=spec is not None and spec.method == "draft_model")
        if self.sleeping:
            log.warning("minivllm: sleep: the engine is sleeping already (%s); nothing done",
                        ", ".join(sorted(self.sleeping)))
            return
        if self.has_unfinished_requests():
            raise ValueError("sleep while requests are unfinished would lose their KV cache: "
                             "finish or abort them first")
        self._drain()
        try:
            self.runner.sleep(level)
        except BaseException:
            # The runner gave back what it had freed, the cache as zeros, and is awake; or, failed
            # in level 2's discard of the weights, sleeps (ModelRunner.sleep). Either way the
            # cache's K/V is gone.
            self.block_manager.reset_prefix_cache()
            asleep = getattr(self.runner, "asleep", None)
            if isinstance(asleep, dict) and asleep:
                self._fell_asleep(level)
            raise
        self._fell_asleep(level)

    def _fell_asleep(self, level: int) -> None:
        self.sleeping = set(TAGS)
        # No sequence holds a block now: every registered one, whose K/V is gone, is forgotten.
        self.block_manager.reset_prefix_cache()
        if level == 2 and self.loras is not None:
            # The slots' weights are discarded (zeros once awake): every adapter is written again.
            self.loras = LoRASlots(self.config.max_loras)

    def wake_up(self, tags=None) -> None:
        """vLLM's wake_up: take back the memory of `tags` ("weights", "kv_cache"; None: all
        that sleeps), the weights as they were (level 1) or zeros (level 2), the KV cache
        zeroed; once both are awake, the CUDA graphs are captured again (runtime/sleep.py says
        why). ValueError without enable_sleep_mode or for another tag. A tag awake already is
        left as it is, with a warning (vLLM's), and the others named are woken: a staged wake-up
        that names both tags after the weights' is still whole (vLLM issue 44395's workflows)."""
        self._check_sleep_mode("wake_up")
        given, tags = tags, check_tags(tags)
        awake = [t for t in tags if t not in self.sleeping]
        if awake and (given is not None or not self.sleeping):  # None: all that sleeps
            log.warning("minivllm: wake_up: %s %s not sleeping", ", ".join(awake),
                        "is" if len(awake) == 1 else "are")
        tags = tuple(t for t in tags if t in self.sleeping)
        if not tags:
            return
        try:
            self.runner.wake_up(tags)
        except BaseException:
            self.sleeping = self._asleep_after_failure(tags)
            raise
        self.sleeping -= set(tags)

    def _asleep_after_failure(self, tags: tuple[str, ...]) -> set[str]:
        """What sleeps after runner.wake_up(tags) raised: the tags the runner has not restored
        (it forgets a tag once its memory is back: ModelRunner.asleep; a TPExecutor's is rank
        0's, the engine stopped by then, as after any failure of its), so that a retry wakes
        only those and load_weights takes weights that are back. Where the runner restored
        every tag and failed after (capturing its graphs again), the call's tags stay asleep:
        steps must wait for a wake_up that captures them (the runner does so once nothing
        sleeps). A runner that does not say keeps them all asleep."""
        asleep = getattr(self.runner, "asleep", None)
        if not isinstance(asleep, dict):
            return set(self.sleeping)
        left = {t for t in self.sleeping if t in asleep}
        return left or set(tags)

    def is_sleeping(self) -> bool:
        """Whether any of the weights and the KV cache sleeps (vLLM's is_sleeping)."""
        return bool(self.sleeping)

    def _check_sleep_mode(self, what: str) -> None:
        if not self.config.enable_sleep_mode:
            raise ValueError(f"{what} needs sleep mode: LLM(..., enable_sleep_mode=True)")

    def _check_awake(self) -> None:
        """ValueError for a request while anything sleeps (its memory is freed)."""
        if self.sleeping:
            raise ValueError(f"the engine is sleeping ({', '.join(sorted(self.sleeping))} "
                             f"freed by sleep()): wake_up() before adding requests")

    def _drain(self) -> None:
        """Read the launched step whose tokens are unread (asynchronous scheduling: one for
        finished sequences' extra tokens may remain after the last request finished), as the
        next step() would, its outputs kept for that step()."""
        while self.in_flight is not None or self.unread is not None:
            self.undelivered = self.step()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests (vLLM's add_lora): ValueError if it
        cannot be served (check_lora's). It goes into a slot when a step first uses it."""
        self.check_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter `lora_id` (vLLM's remove_lora): its weights read from disk, and its
        slot unless an unfinished sequence uses it. Such sequences hold the adapter (Sequence.
        lora) and finish with it; its slot, never evicted while one of them runs, is then the
        least recently used one's to give. False if the engine does not know the id."""
        if self.loras is None:
            return False
        known = self._adapters.pop(lora_id, None) is not None
        for key in [k for k in self._lora_reads if k[0] == lora_id]:
            del self._lora_reads[key]
        known = self._lora_ids.pop(lora_id, None) is not None or known
        in_slot = lora_id in self.loras.slot_of
        if in_slot and not any(seq.lora_id == lora_id for seq in self.scheduler.sequences):
            self.loras.forget(lora_id)  # free for the next adapter (no step reads it)
        return known or in_slot

    def list_loras(self) -> set[int]:
        """The ids of the adapters the engine holds, read or in a slot (vLLM's list_loras)."""
        return set() if self.loras is None else set(self._adapters) | set(self.loras.slot_of)

    def check_request(self, prompt: Any, params: SamplingParams,
                      lora_request: LoRARequest | None = None
                      ) -> tuple[str | None, list[int] | torch.Tensor]:
        """ValueError unless the request can run; returns it as a CheckedPrompt for enqueue: its
        text and ids, or for {"prompt_embeds": tensor} (vLLM's EmbedsPrompt) the embeddings [T,
        hidden] on the host in the model's dtype, and a prompt dict's "cache_salt" (vLLM's: the
        request's prefix-cache blocks are shared only with requests of the same salt).
        lora_request: its LoRA adapter (None: the base model), read and checked here."""
        self._check_awake()
        if self.config.runner == "pooling":  # vLLM's words
            raise ValueError("LLM.generate() is only supported for generative models. Try "
                             "passing `runner=\"generate\"` to use the model as a generative "
                             "model.")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        salt = prompt_cache_salt(prompt)
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            text, ids = None, self._prompt_embeds(prompt, params)
        else:
            text, ids = self._prompt_ids(prompt)
        # On embeddings too: the last k rows, as the last k ids of a prompt of ids.
        ids = self._truncated(ids, params.truncate_prompt_tokens)
        max_len = self.config.max_model_len
        # vLLM's LLM's words (v1 InputProcessor._validate_prompt_len); its server says it in
        # its own before the engine (openai_api.check_room).
        if len(ids) > max_len:
            raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the maximum "
                             f"model length of {max_len}. Make sure that `max_model_len` is no "
                             f"smaller than the number of text tokens.")
        if len(ids) == max_len:
            raise ValueError(f"The decoder prompt (length {len(ids)}) plus the number of "
                             f"requested output tokens (at least 1) is longer than the maximum "
                             f"model length of {max_len}. Make sure that `max_model_len` is no "
                             f"smaller than the number of text tokens (prompt + requested output "
                             f"tokens).")
        self._check_params(params)
        # The most tokens the sequence ever holds in the cache (its last token is never fed back).
        longest = min(len(ids) + (params.max_tokens or max_len), max_len) - 1
        self._check_fits(f"this request can never fit the KV cache: it may grow to {longest} "
                         f"tokens", longest, "lower max_tokens or raise num_kv_blocks")
        self.check_lora(lora_request, bind=False)  # bound by enqueue, once the call is accepted
        return CheckedPrompt(text, ids, salt if isinstance(ids, list) else None)

    def _prompt_embeds(self, prompt: dict, params: SamplingParams) -> torch.Tensor:
        """A {"prompt_embeds": [T, hidden]} prompt's embeddings checked, on the host in the
        model's dtype (a sequence's steps slice them chunk by chunk): ValueError / TypeError for
        what cannot run, before any work. What vLLM refuses with them is refused here too:
        prompt_logprobs (there are no prompt ids to score)."""
        if not self.config.enable_prompt_embeds:
            raise ValueError("prompt_embeds prompts need LLM(..., enable_prompt_embeds=True)")
        unknown = sorted(map(str, set(prompt) - {"prompt_embeds", "cache_salt"}))
        if unknown:
            raise ValueError(f"a prompt_embeds prompt holds 'prompt_embeds' (and 'cache_salt') "
                             f"only (vLLM's EmbedsPrompt); minivllm does not take {unknown} "
                             f"with it")
        embeds = prompt["prompt_embeds"]
        if not isinstance(embeds, torch.Tensor):
            raise TypeError(f"prompt_embeds must be a torch.Tensor [tokens, hidden_size], got "
                            f"{type(embeds).__name__}")
        hidden = self.config.model_config.hidden_size
        if embeds.ndim != 2 or embeds.shape[1] != hidden:
            raise ValueError(f"prompt_embeds must be [tokens, hidden_size={hidden}], got shape "
                             f"{list(embeds.shape)}")
        if embeds.shape[0] == 0:
            raise ValueError("the prompt is empty (prompt_embeds has no rows)")
        if not embeds.dtype.is_floating_point:
            raise TypeError(f"prompt_embeds must be a floating-point tensor, got {embeds.dtype}")
        if embeds.layout != torch.strided:
            raise TypeError(f"prompt_embeds must be a dense tensor, got layout {embeds.layout}")
        if embeds.is_meta:
            raise ValueError("prompt_embeds is on the meta device: it holds no values")
        # The engine's own copy (as vLLM's engine takes them): a caller refilling its tensor
        # later changes no queued request, nor what was checked below.
        embeds = embeds.detach().to("cpu", self.config.dtype, copy=True,
                                    memory_format=torch.contiguous_format)
        if not torch.isfinite(embeds).all():  # a NaN would spread over the whole batch's rows
            raise ValueError(f"prompt_embeds holds non-finite values (in {self.config.dtype})")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available with prompt_embeds (no prompt "
                             "token ids to score)")
        return embeds

    def _truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """The prompt ids truncate_prompt_tokens keeps: as vLLM, the last k (-1: max_model_len)."""
        if keep is None:
            return ids
        max_len = self.config.max_model_len
        if keep > max_len:
            raise ValueError(f"truncate_prompt_tokens={keep} exceeds max_model_len={max_len}")
        return ids[-(max_len if keep == -1 else keep):]

    def _check_fits(self, what: str, tokens: int, remedy: str) -> None:
        """ValueError (`what` it says, then the blocks) unless the cache can hold `tokens`."""
        need = self.block_manager.blocks_for(tokens)
        if need > self.num_blocks:
            raise ValueError(f"{what} ({need} blocks of {self.config.block_size}) and the cache "
                             f"has {self.num_blocks} blocks; {remedy}")

    def _check_params(self, params: SamplingParams) -> None:
        """ValueError for what this engine cannot serve of `params`, whatever the prompt."""
        for name in ("logprobs", "prompt_logprobs"):
            n = self._num_logprobs(getattr(params, name))
            if n is not None and n > self.config.max_logprobs:
                raise ValueError(f"{name}={getattr(params, name)} asks for {n} logprobs, more "
                                 f"than max_logprobs={self.config.max_logprobs}")
        if params.thinking_token_budget is not None and self.think_tags is None:
            # vLLM refuses it too (InputProcessor._validate_params), in its words.
            raise ValueError("thinking_token_budget is set but this engine has no reasoning "
                             "parser: start it with reasoning_parser=\"qwen3\" (serve "
                             "--reasoning-parser qwen3) to use thinking_token_budget")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none")
        if params.bad_word_texts and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this engine has none")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, and this engine has none")
            self._guide(params)
        bad_words = self._bad_words(params)
        for what, named in (("stop token id", params.stop_ids),
                            ("logit_bias token id", [i for i, _ in params.bias_pairs]),
                            ("allowed token id", params.allowed_ids),
                            ("bad_words token id", [i for word in bad_words for i in word])):
            for i in named:
                if i >= self.vocab_size:
                    raise ValueError(f"{what} {i} is outside the vocabulary [0, {self.vocab_size})")
        # A row left with no id at all has nothing to sample: one-token bad words are banned
        # always, stop and EOS ids before min_tokens.
        sampleable = set(params.allowed_ids) or range(self.vocab_size)
        what = "allowed_token_ids" if params.allowed_ids else "vocabulary ids"
        banned = {word[0] for word in bad_words if len(word) == 1}
        if banned and all(i in banned for i in sampleable):
            raise ValueError(f"bad_words ban every id this request may sample (its {what})")
        if params.min_tokens > 0:
            banned |= set(params.stop_ids) | set(self.eos_ids)
            if all(i in banned for i in sampleable):
                raise ValueError(f"min_tokens={params.min_tokens} bans every id this request may "
                                 f"sample: its {what} are all stop, EOS or bad-word ids")

    def _num_logprobs(self, n: int | None) -> int | None:
        """logprobs / prompt_logprobs as a count: -1 is the whole vocabulary (as vLLM)."""
        return self.vocab_size if n == -1 else n

    def add_requests(self, prompts: list, params: list[SamplingParams],
                     priority: list[int] | None = None,
                     lora_requests: list[LoRARequest | None] | None = None) -> list[str]:
        """Queue requests, all or none: every one is checked before any is queued. priority:
        one per request, lower first (the "priority" scheduling policy; None: all 0).
        lora_requests: one per request (None: the base model), or None: all the base model."""
        return [self.enqueue(*request)
                for request in self.check_requests(prompts, params, priority, lora_requests)]

    def check_requests(self, prompts: list, params: list[SamplingParams],
                       priority: list[int] | None = None,
                       lora_requests: list[LoRARequest | None] | None = None) -> list[tuple]:
        """add_requests' checks, all of them, queueing nothing: each request's arguments to
        enqueue, (CheckedPrompt, SamplingParams, priority, LoRARequest or None)."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        priority = self.check_priority(priority, len(prompts))
        if lora_requests is None:
            lora_requests = [None] * len(prompts)
        elif len(lora_requests) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(lora_requests)} lora requests")
        check_lora_ids(lora_requests)
        checked = [self.check_request(p, sp, lr)
                   for p, sp, lr in zip(prompts, params, lora_requests)]
        return list(zip(checked, params, priority, lora_requests))

    def add_request(self, prompt: Any, params: SamplingParams, priority: int = 0) -> str:
        return self.add_requests([prompt], [params], [priority])[0]

    def check_priority(self, priority, n: int) -> list[int]:
        """The requests' priorities (n of them): integers, and 0 unless the scheduling policy is
        "priority" (vLLM's check)."""
        if priority is None:
            return [0] * n
        if isinstance(priority, (str, bytes, dict)) or not hasattr(priority, "__len__"):
            raise TypeError(f"priority must be a list of integers, one per prompt, got "
                            f"{type(priority).__name__}")
        if len(priority) != n:
            raise ValueError(f"{n} prompts but {len(priority)} priorities")
        out = []
        for p in priority:
            if as_int(p) is None:
                raise TypeError(f"a priority must be an integer, got {p!r}")
            if p != 0 and self.config.scheduling_policy != "priority":
                raise ValueError(f"Got priority {p} but Priority scheduling is not enabled.")
            out.append(as_int(p))
        return out

    def enqueue(self, prompt: CheckedPrompt, params: SamplingParams,
                priority: int = 0, lora_request: LoRARequest | None = None, *,
                arrival_time: float | None = None) -> str:
        """Queue a request that check_request accepted, as the CheckedPrompt it returned (and
        the lora_request it was checked with). arrival_time: when it arrived (time.monotonic();
        default now), which its time to first token and end-to-end latency count from."""
        lora = self.check_lora(lora_request)  # read by check_request: found, not read again
        lora_id = lora_request.lora_int_id if lora is not None else 0
        text, ids, salt = prompt
        embeds = None
        if isinstance(ids, torch.Tensor):  # check_request's prompt_embeds: placeholder ids
            embeds, ids = ids, [PLACEHOLDER] * len(ids)
        request = self._new_request(text, ids, params)
        request.embeds = embeds is not None
        request.lora_request = lora_request
        queued = time.monotonic()
        arrival = queued if arrival_time is None else arrival_time
        request_id = request.request_id
        base = params.seed if params.seed is not None else self.rng.getrandbits(63)
        bad_words = self._bad_words(params)
        compiled = self._guide(params)
        tags = self.think_tags
        # A prompt of embeddings shows no tags: a completion of it starts undecided.
        phase = (tags.prompt_phase(ids if embeds is None else []) if tags is not None
                 else reasoning.ANSWER)
        for i in range(params.n):
            seed = base if i == 0 else (base + i * _GOLDEN) & ((1 << 64) - 1)
            seq = Sequence(self._next_seq_id, request_id, i, ids, params, seed,
                           eos_ids=self.eos_ids, bad_words=bad_words,
                           guide=Guide(compiled, phase, tags) if compiled is not None else None,
                           priority=priority, lora=lora, lora_id=lora_id,
                           prompt_embeds=embeds, cache_salt=salt)
            seq.arrival_time, seq.queued_time = arrival, queued
            self._next_seq_id += 1
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def _guide(self, params: SamplingParams) -> CompiledGuide | None:
        if params.structured_outputs is None:
            return None
        if self._guides is None:
            self._guides = GuideCache(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._guides.get(params.structured_outputs.key)

    def _bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        return self._bad_word_ids(params.bad_word_texts) if params.bad_word_texts else ()

    # -- pooling requests: embeddings, classifications, scores (runtime/pooling.py) --------------

    def check_pooling_request(self, prompt: Any, params: PoolingParams
                              ) -> tuple[str | None, list[int]]:
        """ValueError unless the pooling request can run; returns (prompt text, prompt ids).
        Its prompt may fill max_model_len: nothing is generated after it. The engine takes
        embedding requests whatever its runner, beside generations (LLM.embed, as vLLM's API,
        only under runner="pooling"); classify and score requests (params.task) need the
        classifier head of a pooling LLM that has one."""
        self._check_awake()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling params must be a PoolingParams, got {type(params).__name__}")
        task = params.task or "embed"
        params.check_task(task)
        salt = prompt_cache_salt(prompt)
        if task != "embed" and self.classifier is None:
            raise ValueError(f"a {task} request needs a classifier head, and this model has "
                             f"none (a Qwen3ForSequenceClassification checkpoint, or hf_overrides "
                             f"that make one, has)")
        text, ids = self._prompt_ids(prompt)
        ids = self._truncated(ids, params.truncate_prompt_tokens)
        max_len = self.config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={max_len}")
        hidden = self.model_config.hidden_size
        if params.dimensions is not None and params.dimensions > hidden:
            raise ValueError(f"dimensions={params.dimensions} exceeds the model's hidden_size "
                             f"({hidden}), the embedding's full size")
        self._check_fits(f"this prompt can never fit the KV cache: its {len(ids)} tokens",
                         len(ids), "raise num_kv_blocks")
        return CheckedPrompt(text, ids, salt)

    def enqueue_pooling(self, prompt: CheckedPrompt, params: PoolingParams, *,
                        arrival_time: float | None = None) -> str:
        """Queue a pooling request that check_pooling_request accepted: one sequence, its
        prompt, pooled at its last token (it samples nothing). arrival_time: as enqueue's."""
        text, ids, salt = prompt
        request = self._new_request(text, ids, params)
        # The sampling parameters of a sequence that never samples: no penalties, no logprobs,
        # one token at most (its length limit is then its prompt's).
        seq = Sequence(self._next_seq_id, request.request_id, 0, ids, _NEVER_SAMPLED, 0,
                       pooling=True, cache_salt=salt)
        seq.queued_time = time.monotonic()
        seq.arrival_time = seq.queued_time if arrival_time is None else arrival_time
        self._next_seq_id += 1
        request.seqs.append(seq)
        self.scheduler.add(seq)
        self.requests[request.request_id] = request
        return request.request_id

    def _new_request(self, text: str | None, ids: list[int], params) -> Request:
        self._check_awake()
        request = Request(str(self._next_request_id), text, ids, params)
        self._next_request_id += 1
        return request

    def add_pooling_requests(self, prompts: list, params: list[PoolingParams], *,
                             arrival_time: float | None = None) -> list[str]:
        """Queue pooling requests, all or none: every one is checked before any is queued."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} pooling params")
        checked = [self.check_pooling_request(p, pp) for p, pp in zip(prompts, params)]
        return [self.enqueue_pooling(prompt, pp, arrival_time=arrival_time)
                for prompt, pp in zip(checked, params)]

    def _record_pooled(self, pooled: list, hidden, now: float) -> int:
        """Each pooled chunk's request gets its result from its row of `hidden` ([rows, hidden]
        fp32, on the host): an embedding cut to its dimensions, normalised unless it says not
        to; a classifier's logits, activated unless it says not to (the score task takes the
        head's cross-encoder activation). Returns the prompt tokens this counted (metrics: a
        pooling request counts its prompt, and ends as "stop", when its result comes, as vLLM)."""
        m, counted = self.metrics, 0
        for chunk, h in zip(pooled, hidden):
            request = self.requests.get(chunk.seq.request_id)
            if request is None:  # aborted while its step ran
                continue
            if m is not None:
                counted += m.count_prompt(chunk.seq)
                m.finish_sequence(chunk.seq, "stop", now, now)
            p, task = request.params, request.task
            if task == "embed":
                request.pooled = pooled_embedding(
                    h, p.dimensions, p.normalizes(self.config.normalize_embeddings)).tolist()
                continue
            head = self.classifier
            logits = classifier_logits(h, head.weight)  # [num_labels]
            kind = (head.config.score_activation if task == "score"
                    else head.config.classify_activation)
            request.pooled = (activate(logits, kind) if p.activates() else logits).tolist()
        return counted

    def abort_request(self, request_id: str | list[str], reason: str = "abort") -> None:
        """End the request, or each of an iterable of request ids (vLLM's abort_request takes
        both), freeing its blocks. An id the engine does not hold (unknown, finished, aborted
        already) is skipped, as vLLM's; TypeError, before any is aborted, for an id that is no
        string (an int matched no id and was skipped: the request ran on). reason: its metrics'
        finished_reason ("error" where a failure ends it)."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        try:
            ids = list(ids)
        except TypeError:
            raise TypeError(f"request_id must be a string or an iterable of strings, got "
                            f"{type(request_id).__name__}") from None
        for i in ids:
            if not isinstance(i, str):
                raise TypeError(f"a request id is a string, got {type(i).__name__} {i!r:.40}")
        for i in ids:
            self._abort_one(i, reason)

    def _abort_one(self, request_id: str, reason: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            for seq in request.seqs:
                if seq.finish_reason == "pooled":  # its step ran, its result never read
                    self._finished_seqs.append(seq)
                self.scheduler.finish(seq, reason)
            self._record_finished(time.monotonic(), aborted=reason)
            self._request_done(request)

    def has_unfinished_requests(self) -> bool:
        # A step still in flight then holds only finished sequences' extra tokens, to be dropped,
        # unless it pools: an embedding's request finishes when that step is read.
        return self.scheduler.has_unfinished() or any(
            launched is not None and launched[0].pooled
            for launched in (self.in_flight, self.unread))

    # -- one step --------------------------------------------------------------------------------

    def _propose(self, seq: Sequence, most: int) -> list[int]:
        """Up to `most` draft tokens for decoding seq (the scheduler's speculator): none for a
        sequence whose sampling row reads its output or changes from step to step (penalties,
        multi-token bad words, structured outputs, min_tokens not yet out, a
        thinking_token_budget, which forces </think> at some step), whose drafts' rows
        would differ from the row its next tokens get. With a draft model, as many placeholders
        as it will draft: the step's inputs take the draft's tokens on the device
        (_draft_tokens), and out.drafts gets them with the step's result (_take_drafts)."""
        if seq.reads_output or seq.penalised or seq.pooling or \
                seq.num_output < seq.params.min_tokens or \
                seq.params.thinking_token_budget is not None:
            return []
        spec = self.config.speculative
        if spec.method == "draft_model":
            # Placeholders: the draft model drafts once the step's tables hold their slots
            # (_draft_tokens).
            return [0] * min(most, spec.num_speculative_tokens)
        # A prompt of embeddings has placeholder ids: only the generated ones are context.
        context = seq.token_ids if seq.prompt_embeds is None else seq.output_ids
        return ngram_propose(context, min(most, spec.num_speculative_tokens),
                             spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _draft_tokens(self, out: SchedulerOutput) -> torch.Tensor:
        """The draft model's drafts for the step's placeholders (ModelRunner.propose), now that
        the scheduler has grown each drafting sequence's table for them: [len(out.drafts), k] on
        the device, a row per drafting sequence in out.drafts' order, queued and not waited for
        (the step reads them on the device; _take_drafts puts them in out.drafts after it). A
        drafting sequence is a decode: its last token, at position num_computed, is its one to
        compute."""
        seqs = list(out.drafts)
        return self.runner.propose([seq.token_ids[-1] for seq in seqs],
                                   [seq.num_computed for seq in seqs],
                                   [seq.block_table for seq in seqs],
                                   [len(out.drafts[seq]) for seq in seqs])

    @staticmethod
    def _take_drafts(out: SchedulerOutput, result: StepResult) -> None:
        """Replace the step's placeholder drafts with the draft model's, which came back with its
        sampled tokens (rows in out.drafts' order, as _draft_tokens gave them)."""
        for seq, row in zip(out.drafts, result.drafts):
            out.drafts[seq] = row[:len(out.drafts[seq])]

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        """seq's row for this step. Its `step` is 0: StepInput.steps carries every row's step, so
        that a row that only the step would change (no penalty, no banned ids) is built once per
        sequence and reused (building one costs more than the rest of a decode step's host work
        for that sequence)."""
        p = seq.params
        think, forced = None, False
        if p.thinking_token_budget is not None:
            think, forced = self._think_budget(seq)
        reads = seq.reads_output if think is None else think.reads_ids
        plain = not (reads or seq.penalised) and seq.num_output >= p.min_tokens
        if plain:
            kept = seq.sampling_row if think is None else think.row
            if kept is not None:
                return self._forced_row(kept, think) if forced else kept
        banned = ()
        if seq.num_output < p.min_tokens:
            # EOS too with ignore_eos, as vLLM's (its all_stop_token_ids always hold EOS).
            banned = tuple(i for i in (*seq.eos_ids, *p.stop_ids) if i < self.vocab_size)
        if seq.bad_words:
            banned += banned_by_bad_words(seq.bad_words, seq.output_ids)
        # As an array, which make_sampling_batch copies whole (made once: a row without
        # penalties is kept for the sequence's later steps).
        allowed = np.asarray(p.allowed_ids, dtype=np.int64) if p.allowed_ids else ()
        bits = None
        if seq.guide is not None:  # structured outputs: the constraint, packed
            bits = seq.guide.bits(seq.output_ids, self.vocab_size)
            # The constraint stays whole beside allowed_token_ids inside it: the raw logprobs
            # are those of the constrained logits, as vLLM's (sampling.constrained_logits).
            _, allowed = bits_constraint(bits, allowed)
        row = SamplingRow(
            temperature=p.temperature, top_k=min(p.top_k, self.vocab_size), top_p=p.top_p,
            min_p=p.min_p,  # top_k past the vocabulary is off (and may not fit in int64)
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, seed=seq.seed, step=0,
            # Known ids only: a pending one the runner takes on the device (StepInput.pending_ids).
            output_ids=seq.output_array() if seq.penalised else (),
            # A prompt of embeddings has no ids to penalise: only its generated ones are.
            prompt_ids=seq.prompt_array() if p.repetition_penalty != 1 and
            seq.prompt_embeds is None else (),
            banned_ids=banned, logit_bias=p.bias_pairs, allowed_ids=allowed, allowed_bits=bits,
            logprobs=self._num_logprobs(p.logprobs))
        if plain:
            # A budget's row is kept by its state: step_input reuses sampling_row unasked.
            if think is None:
                seq.sampling_row = row
            else:
                think.row = row
        return self._forced_row(row, think) if forced else row

    def _think_budget(self, seq: Sequence) -> tuple[reasoning.ThinkBudget, bool]:
        """seq's thinking_token_budget state, advanced over its known ids, and whether this
        step's token is forced to be </think>. Sets seq.reads_output for the next step: a step
        is set up while the previous step's token is unread (asynchronous scheduling), and where
        that token decides the step after this one, the engine reads it first."""
        think = seq.think_budget
        if think is None:
            # A prompt of embeddings shows no tags (as enqueue's phase).
            think = seq.think_budget = reasoning.ThinkBudget(
                self.think_tags, seq.params.thinking_token_budget, seq.prompt_ids,
                shows_tags=seq.prompt_embeds is None)
            think.reads_ids = seq.reads_output  # multi-token bad words, a structured output
        think.advance(seq.token_ids, seq.num_known)
        forced = think.forced(seq.num_pending)
        seq.reads_output = think.reads_ids or think.needs_known(seq.num_pending)
        return think, forced

    @staticmethod
    def _forced_row(row: SamplingRow, think: reasoning.ThinkBudget) -> SamplingRow:
        """`row` made to sample </think> only (vLLM sets its logit to 1e9 after every other
        processor): its one allowed id, nothing banned, biased or constrained beside it;
        penalties and logprobs as ever (the raw logprobs are the model's)."""
        return attrs.evolve(row, banned_ids=(), logit_bias=(), allowed_bits=None,
                            allowed_ids=np.asarray([think.end], dtype=np.int64))

    def step_input(self, out: SchedulerOutput, prev: SchedulerOutput | None = None,
                   draft_ids: torch.Tensor | None = None) -> StepInput:
        """The runner's view of a scheduled step. prev: the launched step whose tokens are still
        pending; a chunk ending in one of them has it fed back from the device. draft_ids: a
        draft model's drafts (_draft_tokens), still on the device: out.drafts holds
        placeholders, which the step's inputs take from there (StepInput.drafted).

        The chunks hold the sequences' live block tables, not copies: the runner consumes a
        StepInput before launch() / execute() return (see StepInput), and tables change only
        after that, when the next step is scheduled."""
        # Runs for each sequence each step: chunks unpacked, properties read as what they compute.
        sampled = [c.seq for c in out.sampled]
        scores, drafted = None, []
        prev_row = {} if prev is None else {c.seq: r for r, c in enumerate(prev.sampled)}
        if out.num_tokens == len(out.chunks) == len(sampled):
            # A decode step (one token a sequence, each sampled): as columns, and a sequence
            # with a pending token is at it.
            chunks = DecodeChunks([seq.token_ids[start] for seq, start, _, _ in out.chunks],
                                  [c.start for c in out.chunks],
                                  [seq.block_table for seq in sampled])
            fed_back = [(i, prev_row[seq]) for i, seq in enumerate(sampled) if seq.num_pending]
        else:
            # A speculative step's chunk with drafts wants logits at each of its tokens.
            drafts = out.drafts
            chunks = [SeqChunk(seq.token_ids[start:start + n] + d, start, seq.block_table, want,
                               len(d) + 1) if (d := drafts.get(seq)) else
                      SeqChunk(seq.token_ids[start:start + n], start, seq.block_table, want)
                      for seq, start, n, want in out.chunks]
            fed_back, offset, scored, pooled = [], 0, [], []
            if draft_ids is not None:
                draft_row = {seq: i * draft_ids.shape[1] for i, seq in enumerate(drafts)}
            for seq, start, n, _ in out.chunks:
                if drafts and seq in drafts:  # a decode's: no prompt to score, nothing pooled
                    if draft_ids is not None:  # its placeholders' ids, from the device
                        first = draft_row[seq]
                        drafted += [(offset + n + r, first + r) for r in range(len(drafts[seq]))]
                    offset += n + len(drafts[seq])
                    continue
                if seq.prompt_logprobs is not None:
                    scored += self._prompt_positions(seq, start, n, offset)
                offset += n
                if seq.pooling and start + n == len(seq.token_ids):  # out.pooled's, in order
                    pooled.append(offset - 1)
                if seq.num_pending and start + n == len(seq.token_ids):
                    fed_back.append((offset - 1, prev_row[seq]))
            if scored:
                out.scored = [(seq, pos) for seq, pos, _ in scored]
                scores = PromptScores(rows=tuple(row for _, _, row in scored),
                                      targets=tuple(seq.token_ids[pos] for seq, pos, _ in scored),
                                      n=max(self._num_logprobs(seq.params.prompt_logprobs)
                                            for seq, _, _ in scored))
        # A sequence's kept row is reusable for good: only plain rows are kept (_sampling_row).
        rows = [row if (row := seq.sampling_row) is not None else self._sampling_row(seq)
                for seq in sampled]
        steps = tuple([len(seq.token_ids) - seq.prompt_len for seq in sampled])  # num_output
        if out.drafts:
            # A row per logits row: a chunk with d drafts samples d + 1 tokens, its row at
            # steps num_output ... num_output + d (as the steps without drafts would).
            rows, steps = self._spec_rows(sampled, rows, steps, out.drafts)
        lora_slots = self._lora_slots(out) if self.loras is not None else None
        # A penalised row holds its known output ids: a pending one comes from the device.
        pending_ids = tuple([(r, seq.num_known - seq.prompt_len, prev_row[seq])
                             for r, seq in enumerate(sampled) if seq.penalised and
                             seq.num_pending]) if prev_row else ()
        return StepInput(chunks, rows, tuple(fed_back), steps, scores,
                         tuple(pooled) if out.pooled else (), lora_slots,
                         self._step_embeds(out), draft_ids, tuple(drafted), pending_ids)

    @staticmethod
    def _step_embeds(out: SchedulerOutput) -> tuple[tuple[int, torch.Tensor], ...]:
        """StepInput.embeds: for each chunk computing prompt positions of a prompt given as
        embeddings, (its first row in the step, those positions' embeddings). Such chunks are
        among out.prefills (they compute prompt positions), which most steps have none of;
        only then are the rows counted over every chunk (drafts included)."""
        if not any(c.seq.prompt_embeds is not None for c in out.prefills):
            return ()
        pieces, row = [], 0
        for seq, start, n, _ in out.chunks:
            if seq.prompt_embeds is not None and start < seq.prompt_len:
                # Generated tokens past the prompt (a recompute after preemption) keep their ids.
                pieces.append((row, seq.prompt_embeds[start:min(start + n, seq.prompt_len)]))
            row += n + len(out.drafts.get(seq, ()))
        return tuple(pieces)

    def _lora_slots(self, out: SchedulerOutput) -> tuple[int, ...] | None:
        """Each chunk's LoRA slot (-1: the base model), the step's adapters put in slots
        first (LoRASlots: never evicting one a running sequence uses); None when no chunk uses
        an adapter."""
        seqs = [c.seq for c in out.chunks]
        needed = {seq.lora_id: seq.lora for seq in seqs if seq.lora_id}
        if not needed:
            return None
        in_use = [seq.lora_id for seq in self.scheduler.running if seq.lora_id]
        slot_of, loads = self.loras.assign(needed, in_use)
        for slot, lid in loads:
            try:
                self.runner.set_lora(slot, needed[lid])
            except BaseException:
                self.loras.forget(lid)  # its slot holds part of it: written again when needed
                raise
        return tuple(slot_of[seq.lora_id] if seq.lora_id else -1 for seq in seqs)

    @staticmethod
    def _spec_rows(sampled: list[Sequence], rows: list[SamplingRow], steps: tuple[int, ...],
                   drafts: dict) -> tuple[list[SamplingRow], tuple[int, ...]]:
        all_rows, all_steps = [], []
        for seq, row, step in zip(sampled, rows, steps):
            d = len(drafts.get(seq, ()))
            all_rows += [row] * (d + 1)
            all_steps += range(step, step + d + 1)
        return all_rows, tuple(all_steps)

    @staticmethod
    def _prompt_positions(seq: Sequence, start: int, n: int, offset: int) -> list[tuple]:
        """(seq, position, row) for each prompt position that seq's chunk (tokens start ...
        start + n - 1, rows offset ... of the step) can score and that is not scored yet: the
        row of token p - 1 scores token p. Steps read in order append in order, and a preempted
        sequence comes back two steps later at the earliest (a step that preempts admits
        nothing), when every step that scored it has been read: so its recompute scores no
        position again."""
        first = max(start + 1, len(seq.prompt_logprobs))
        return [(seq, pos, offset + pos - 1 - start)
                for pos in range(first, min(start + n + 1, seq.prompt_len))]

    def step(self, *, unfinished: bool = True) -> list[RequestOutput]:
        """Run one scheduled step; the outputs of the requests it touched (finished included;
        with unfinished=False only the finished ones, which saves building the others). With
        asynchronous scheduling these are the previous step's, read after this one is launched."""
        done, self.undelivered = self.undelivered, []
        try:
            if self.unread is not None:
                launched, self.unread = self.unread, None
                return done + self._resolve(launched, unfinished)
            if self.async_scheduling:
                return done + self._step_async(unfinished)
            return done + self._step_sync(unfinished)
        except BaseException:
            # This step failed too: keep the earlier step's outputs for the next step(), ahead of
            # any this one read (their requests are gone from self.requests: dropped here, a
            # finished request's last output would never be delivered).
            self.undelivered = done + self.undelivered
            raise

    def _step_sync(self, unfinished: bool) -> list[RequestOutput]:
        # The named ranges show up in a torch.profiler trace (minivllm bench --trace).
        with trace_range("schedule"):
            out = self.scheduler.schedule()
        if out.empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule anything")
            return []
        draft_ids = None
        try:
            if out.drafts and getattr(self.runner, "draft_params", None) is not None:
                # Queued, not waited for: the host builds and launches the step while the
                # draft's rounds run.
                with trace_range("draft"):
                    draft_ids = self._draft_tokens(out)
            with trace_range("step_input"):
                step_input = self.step_input(out, draft_ids=draft_ids)
            result = self.runner.execute(step_input)
        except BaseException:  # an error or Ctrl-C: the step is not recorded, so it runs again
            self.scheduler.abandon(out)
            raise
        if draft_ids is not None:
            self._take_drafts(out, result)
        self._count(out)
        self.scheduler.bm.commit()
        if out.drafts:  # a speculative step's tokens are recorded one at a time (_record_spec)
            self.scheduler.advance(out)
            return self._finish_step(out, None, result, unfinished)
        with trace_range("update"):
            seqs = self.scheduler.update(out, result.token_ids)
        return self._finish_step(out, seqs, result, unfinished)

    def _step_async(self, unfinished: bool) -> list[RequestOutput]:
        prev = self.in_flight
        if prev is not None and any(s.reads_output for s in self.scheduler.running):
            # Multi-token bad words and structured outputs read the generated ids on the host:
            # the pending ones first. (Penalties count them on the device: StepInput.pending_ids.)
            self.in_flight = None
            return self._resolve(prev, unfinished)
        with trace_range("schedule"):
            out = self.scheduler.schedule()
        if not out.empty:
            try:
                with trace_range("step_input"):
                    step_input = self.step_input(out, prev[0] if prev is not None else None)
                pending = self.runner.launch(step_input)
            except BaseException:  # an error or Ctrl-C: the step is not recorded, so it runs again
                self.scheduler.abandon(out)
                if prev is not None:
                    # The launch may have run in part and rewritten the device's last tokens,
                    # which the next step would feed back: read prev's now, from its own host
                    # buffers, so that the next step takes them from the host.
                    self.in_flight = None
                    try:
                        self.undelivered += self._resolve(prev, True)
                    except Exception:  # e.g. a dead worker fails both: the first error says it
                        pass
                raise
            self._count(out)
            self.scheduler.bm.commit()
            self.scheduler.advance(out)
            self.in_flight = (out, pending)
        elif prev is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule anything")
            return []
        else:
            self.in_flight = None
        return self._resolve(prev, unfinished) if prev is not None else []

    def _resolve(self, launched, unfinished: bool) -> list[RequestOutput]:
        out, pending = launched
        try:
            result = pending.result()
        except KeyboardInterrupt:  # while waiting: the next step() reads the tokens
            self.unread = launched
            raise
        except BaseException:  # a device or worker error: the tokens are lost for good
            self._lose(out)
            raise
        with trace_range("update"):
            seqs = self.scheduler.resolve(out, result.token_ids)
        if result.logprobs is not None and len(seqs) != len(result.logprobs):
            keep = {s.seq_id for s in seqs}
            result = StepResult(token_ids=[t for c, t in zip(out.sampled, result.token_ids)
                                           if c.seq.seq_id in keep],
                                logprobs=[lp for c, lp in zip(out.sampled, result.logprobs)
                                          if c.seq.seq_id in keep],
                                scores=result.scores, pooled=result.pooled)
        return self._finish_step(out, seqs, result, unfinished)

    def _lose(self, out: SchedulerOutput) -> None:
        """Launched step `out`'s result raised (a device or worker error): its tokens, and those
        of the step launched after it (self.in_flight, whose inputs took out's from the device),
        are lost. Undo both, as the synchronous path's Scheduler.abandon undoes a step that never
        ran, so that later steps run their sequences again and give what they would have given:
        each sequence they scheduled that has not ended drops its pending tokens and is
        preempted (recomputed from its prompt, its blocks freed); an embedding they ended waits
        again; and the prefix cache forgets every block no sequence holds now, among them those
        whose K/V the lost steps were to write (registered when they were scheduled, and held by
        their sequences only). A later abort finds every request in place."""
        lost = [out]
        if self.in_flight is not None:
            lost.append(self.in_flight[0])
            self.in_flight = None
        sched, seen = self.scheduler, set()
        for step in lost:
            for chunk in step.chunks:
                seq = chunk.seq
                if seq.seq_id in seen:
                    continue
                seen.add(seq.seq_id)
                if seq.num_pending:  # (a sequence preempted since keeps them too)
                    del seq.token_ids[-seq.num_pending:]
                    seq.num_pending = 0
                if seq.status is Status.RUNNING:
                    sched.preempt(seq)
                elif seq.finish_reason == "pooled" and \
                        getattr(self.requests.get(seq.request_id), "pooled", 0) is None:
                    # Ended by its step (Scheduler.advance), its result never read.
                    if seq in self._finished_seqs:
                        self._finished_seqs.remove(seq)
                    seq.finish_reason, seq.num_computed = None, 0
                    seq.num_preemptions += 1
                    sched.add(seq)
        self.block_manager.reset_prefix_cache()

    def _finish_step(self, out: SchedulerOutput, seqs: list[Sequence] | None, result: StepResult,
                     unfinished: bool) -> list[RequestOutput]:
        """seqs: those that got a token (Scheduler.resolve's); None for a speculative step, whose
        sampled sequences are advanced but not resolved (_record_spec)."""
        with trace_range("postprocess"):
            now = time.monotonic()
            generated = self.stats.generation_tokens
            pooled_prompts = 0
            spec = seqs is None
            if spec:  # first: a failure before it records anything leaves nothing recorded
                seqs = self._record_spec(out, result)
            if result.scores is not None:
                self._record_scores(out.scored, result.scores)
            if result.pooled is not None:
                pooled_prompts = self._record_pooled(out.pooled, result.pooled, now)
            if not spec:
                self.stats.generation_tokens += len(seqs)
                self._postprocess(seqs, result)
            if self.metrics is not None:
                prompts = self._record_token_times(seqs, now) + pooled_prompts
                if seqs or out.pooled:  # vLLM's engine steps that output something
                    self.metrics.iteration_tokens.observe(
                        prompts + self.stats.generation_tokens - generated)
            if self._finished_seqs:
                self._record_finished(now)
        if unfinished:
            touched = dict.fromkeys(c.seq.request_id for c in out.chunks)
            touched.update(dict.fromkeys(s.request_id for s in out.preempted))
        else:  # only requests that can have finished: those with a sequence finished this step
            finished = Status.FINISHED
            touched = dict.fromkeys([c.seq.request_id for c in out.sampled
                                     if c.seq.status is finished])
            touched.update(dict.fromkeys(c.seq.request_id for c in out.pooled))
        outputs = []
        for request_id in touched:
            request = self.requests.get(request_id)
            if request is None:
                continue
            # An embedding has no partial output (as vLLM): only its finished one is returned.
            if request.finished or (unfinished and not request.pooling):
                outputs.append(self.make_output(request))
            if request.finished:
                del self.requests[request_id]
                self._request_done(request)
        return outputs

    def _record_token_times(self, seqs: list[Sequence], now: float) -> int:
        """Metrics of a step that read a token for each of `seqs` at `now`: time to first token
        and the prompt's tokens for those whose first it is, an inter-token latency for the
        others. Returns the prompt tokens counted.

        Once a step, not a token: the token streak is the sequences that got a token in the last
        step that read any (self._streak, at self._streak_time). When this step's are the same
        list (every decode step of an unchanging batch) each has the same latency, observed
        once with their count. Otherwise sets (C loops) find those that left the streak, whose
        last token time is then kept on the sequence, and those that joined it (a first token,
        a return from preemption or a skipped step), handled one by one."""
        m, prev, then = self.metrics, self._streak, self._streak_time
        counted = 0
        if seqs == prev:
            if seqs:
                m.itl.observe(now - then, len(seqs))
        else:
            before, current = set(prev), set(seqs)
            for seq in before - current:
                seq.last_token_time = then
            joined = current - before
            if len(seqs) > len(joined):
                m.itl.observe(now - then, len(seqs) - len(joined))
            for seq in joined:
                if seq.first_token_time:
                    m.itl.observe(now - seq.last_token_time)
                else:
                    seq.first_token_time = now
                    m.ttft.observe(now - seq.arrival_time)
                    counted += m.count_prompt(seq)
        self._streak, self._streak_time = seqs, now
        return counted

    def _record_finished(self, now: float, aborted: str | None = None) -> None:
        """Record the sequences the scheduler ended since the last call (vLLM's finished
        requests): those a step ended (their last token read `now`), or with `aborted`, those
        an abort ended now (their last token that of their streak, or the one they kept).
        Embeddings are recorded with their result (_record_pooled)."""
        finished = list(self._finished_seqs)
        self._finished_seqs.clear()
        m = self.metrics
        if m is None:
            return
        for seq in finished:
            reason = seq.finish_reason
            if aborted is None:
                if reason == "pooled":
                    continue
                last = now
            else:  # (one a failed step ended before the abort keeps its reason)
                if reason == "pooled":
                    reason = aborted
                last = self._streak_time if seq in self._streak else seq.last_token_time
            m.finish_sequence(seq, reason, now, last)

    def _request_done(self, request: Request) -> None:
        """A request ended (all its completions): vLLM's per-parent metrics."""
        if self.metrics is not None:
            self.metrics.finish_request(
                len(request.seqs), 0 if request.pooling else
                max(s.num_known - s.prompt_len for s in request.seqs))

    def _count_draft(self, drafted: int, accepted: int) -> None:
        """One sequence's speculative step: `drafted` draft tokens ran, the first `accepted` of
        them matched (vLLM's SpecDecodingStats.observe_draft; a step without drafts is none)."""
        stats = self.stats
        if not drafted:
            return
        stats.spec_drafts += 1
        stats.spec_draft_tokens += drafted
        stats.spec_accepted_tokens += accepted
        per_pos = stats.spec_accepted_per_pos
        per_pos.extend([0] * (accepted - len(per_pos)))
        for p in range(accepted):
            per_pos[p] += 1

    def _record_spec(self, out: SchedulerOutput, result: StepResult) -> list[Sequence]:
        """Record a speculative step (advanced, not resolved): each sampled sequence's tokens
        are its sampled ones up to and including the first that differs from its draft (all of
        them when every draft matched). They are recorded in rounds, one token a sequence a
        round, each round as a step without speculation records its tokens (stop tokens and
        lengths, then logprobs, detokenization and stop strings), so that a token that ends a
        sequence drops the ones after it. Until the first round is resolved nothing is
        recorded: a failure before (the draft's catch_up, on a failed device) undoes the step
        (_lose), as the synchronous path's abandon undoes one that never ran."""
        tokens, lps = result.token_ids, result.logprobs
        kept, i = [], 0  # per sampled chunk: (seq, its tokens, their logprobs or None)
        behind = []  # (last draft, its position, table) where every draft was accepted
        for chunk in out.sampled:
            seq = chunk.seq
            d = out.drafts.get(seq, ())
            got = tokens[i:i + len(d) + 1]
            a = 0
            while a < len(d) and got[a] == d[a]:
                a += 1
            self._count_draft(len(d), a)
            kept.append((seq, got[:a + 1], None if lps is None else lps[i:i + a + 1]))
            if d and a == len(d):
                behind.append((d[-1], chunk.start + len(d), seq.block_table))
            i += len(d) + 1
        try:
            if i != len(tokens):
                raise ValueError(f"{len(tokens)} sampled tokens for {i} sampled rows")
            if behind and getattr(self.runner, "draft_params", None) is not None:
                # Before any sequence ends and frees its blocks: the slot's K/V is queued ahead
                # of whatever reuses it.
                self.runner.catch_up(*map(list, zip(*behind)))
        except BaseException:
            self._lose(out)
            raise
        got = first = self.scheduler.resolve(out, [toks[0] for _, toks, _ in kept])
        for r in range(max(len(toks) for _, toks, _ in kept)):
            if r:
                got = []
                for seq, toks, _ in kept:
                    if len(toks) > r and not seq.finished:
                        self.scheduler.accept(seq, int(toks[r]))
                        got.append(seq)
            alive = {s.seq_id for s in got}
            round_lps = None if lps is None else \
                [lp[r] for seq, toks, lp in kept if seq.seq_id in alive and len(toks) > r]
            self.stats.generation_tokens += len(got)
            self._postprocess(got, StepResult(token_ids=[], logprobs=round_lps))
        return first  # the sequences that got a token (one or more)

    def _count(self, out: SchedulerOutput) -> None:
        s = self.stats
        s.steps += 1
        s.preemptions = self.scheduler.num_preemptions
        s.prompt_tokens_cached = self.scheduler.num_prompt_tokens_cached
        s.max_step_tokens = max(s.max_step_tokens, out.num_tokens)
        s.max_step_seqs = max(s.max_step_seqs, len(out.chunks))
        for c in out.prefills:  # a decode adds to neither count
            end = c.start + c.num_tokens
            s.prompt_tokens_computed += max(0, min(end, c.seq.prompt_len) - c.start)
            # Generated positions computed before a preemption: all of the chunk's but, when it
            # ends the sequence (wants logits), its last, the token sampled last, never fed yet.
            last = end - 1 if c.want_logits else end
            s.tokens_recomputed += max(0, last - max(c.start, c.seq.prompt_len))

    def _postprocess(self, seqs: list[Sequence], result: StepResult) -> None:
        if self.tokenizer is None and result.logprobs is None:
            return  # nothing to record (bench's random weights: every step of the run)
        for k, seq in enumerate(seqs):
            p = seq.params
            tok = seq.token_ids[seq.num_known - 1]
            if result.logprobs is not None and seq.logprobs is not None:
                lp = result.logprobs[k]
                seq.cumulative_logprob += lp.logprob
                seq.logprobs.append(self._logprob_entry(tok, lp, p.detokenize))
            if self.tokenizer is None or not p.detokenize:
                continue
            # Known tokens only (Sequence.num_output counts pending ones too).
            num_known_output = seq.num_known - seq.prompt_len
            if num_known_output == 1 and seq.prompt_embeds is not None:
                # A prompt of embeddings has no text: the output is decoded on its own.
                seq.prefix_offset = seq.read_offset = seq.prompt_len
            elif num_known_output == 1:  # the first: start at the prompt's last whole character
                seq.prefix_offset, seq.read_offset = prompt_offsets(
                    self.tokenizer, seq.token_ids, seq.prompt_len,
                    skip_special_tokens=p.skip_special_tokens,
                    spaces_between_special_tokens=p.spaces_between_special_tokens)
            end = seq.num_known
            if seq.finish_reason == "stop" and not p.include_stop_str_in_output:
                end -= 1  # the stop token (EOS, a stop id) keeps out of the text, as in vLLM
            new_text, seq.prefix_offset, seq.read_offset = detokenize_incrementally(
                self.tokenizer, seq.token_ids, seq.prefix_offset, seq.read_offset,
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens, end=end)
            seq.text += new_text
            # As vLLM: stop strings count once more than min_tokens tokens are out (as stop ids,
            # which the sampler bans for the first min_tokens), in the text new this step.
            if not p.stop_strings or not new_text or num_known_output <= p.min_tokens:
                continue
            hit = find_stop_string(seq.text, len(new_text), p.stop_strings)
            if hit is None:
                continue
            at, stop = hit
            seq.text = seq.text[:at + len(stop)] if p.include_stop_str_in_output else seq.text[:at]
            if seq.finished:
                # Ended this step by length or a stop token: the stop string names the reason
                # (vLLM's output processor overrides both).
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.scheduler.finish(seq, "stop", stop)

    def _record_scores(self, scored: list[tuple[Sequence, int]], scores: list) -> None:
        """Append each scored prompt position's entry, the prompt's id in the sampled id's place
        and the top prompt_logprobs ids (the step computed the most any of its requests asks)."""
        for (seq, pos), lp in zip(scored, scores):
            p = seq.params
            seq.prompt_logprobs.append(self._logprob_entry(
                seq.token_ids[pos], lp, p.detokenize, self._num_logprobs(p.prompt_logprobs)))

    def _logprob_entry(self, tok: int, lp, detokenize: bool, n: int | None = None) -> dict:
        """vLLM's logprobs entry for token `tok` (TokenLogprobs lp): tok first, then the first n
        (default all) top ids by position, which win for an id in both (its rank counts ties:
        the first of two tied maxima is rank 2)."""
        entry = {tok: Logprob(lp.logprob, lp.rank, self._decode_one(tok, detokenize))}
        entry.update({i: Logprob(v, r + 1, self._decode_one(i, detokenize))
                      for r, (i, v) in enumerate(zip(lp.top_ids[:n], lp.top_logprobs[:n]))})
        return entry

    def _decode_one(self, token_id: int, detokenize: bool = True) -> str | None:
        """A logprob entry's decoded_token: None without a tokenizer or with detokenize=False
        (as vLLM)."""
        if self.tokenizer is None or not detokenize:
            return None
        return self.tokenizer.decode([token_id])

    def make_output(self, request: Request
                    ) -> RequestOutput | EmbeddingRequestOutput | ClassificationRequestOutput:
        """The request's cumulative output so far (an unfinished completion's text less what a stop
        string could still cut); a pooling request's EmbeddingRequestOutput (task "embed") or
        ClassificationRequestOutput ("classify", "score") once finished."""
        if request.pooling:
            seq = request.seqs[0]
            kind, output = ((EmbeddingRequestOutput, EmbeddingOutput) if request.task == "embed"
                            else (ClassificationRequestOutput, ClassificationOutput))
            return kind(request_id=request.request_id, outputs=output(request.pooled or []),
                        prompt_token_ids=list(request.prompt_ids), finished=request.finished,
                        num_cached_tokens=max(seq.num_cached_prompt, 0))
        outputs = []
        p = request.params
        # As vLLM: an unfinished completion holds back the characters that could begin a stop
        # string (len(longest) - 1), so that no text is shown that a stop string then cuts.
        hold = (max(map(len, p.stop_strings)) - 1
                if p.stop_strings and not p.include_stop_str_in_output else 0)
        for seq in request.seqs:
            text = seq.text
            if hold and not seq.finished:
                text = text[:max(len(text) - hold, 0)]
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        cached = [s.num_cached_prompt for s in request.seqs if s.num_cached_prompt >= 0]
        scored = request.seqs[0].prompt_logprobs
        # A prompt of embeddings has no token ids: None, as vLLM's (its ids here are
        # placeholders).
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=None if request.embeds else list(request.prompt_ids),
                             outputs=outputs,
                             finished=request.finished,
                             prompt_logprobs=(list(scored) if scored is not None
                                              and len(scored) == len(request.prompt_ids) else None),
                             num_cached_tokens=cached[0] if cached else 0,
                             lora_request=request.lora_request)

    @property
    def running_sequences(self) -> list[Sequence]:
        return [s for s in self.scheduler.sequences if s.status is Status.RUNNING]
