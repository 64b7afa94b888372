"""What the engine hands back, shaped like vLLM's RequestOutput / CompletionOutput / Logprob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .lora import LoRARequest


@dataclass
class Logprob:
    """One token's log probability: under the model's raw distribution by default, else as the
    engine's logprobs_mode says (a logit, or the processed distribution); prompt logprobs are
    always raw. rank: a top-N entry's position (1 the most likely); the sampled id's, when not
    among them, vLLM v1's count of ids at least as likely (ties included)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token_id: Logprob}, the sampled id first, then the top-N ids.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first (nothing precedes it), then as SampleLogprobs with the
# prompt's own id in the sampled id's place.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request. finish_reason: None while running, then "stop" (EOS, a stop
    id or a stop string; stop_reason says which: None for the tokenizer's EOS, the id for
    generation_config.json's other EOS ids, as in vLLM; a stop string that the step's
    text completes names the reason even when a stop id or the length limit ended it at that
    step, as in vLLM) or "length" (max_tokens or max_model_len). token_ids keep the token that
    stopped the completion (the stop id, or the one that completed a stop string); text leaves
    out a stop id's text and cuts at the stop string (include_stop_str_in_output keeps both),
    and leaves out a last character whose bytes are not all generated yet. While running, text
    holds back the last len(longest stop string) - 1 characters (none with
    include_stop_str_in_output), so that no text is shown that a stop string then cuts. In a
    streamed output, text / token_ids / logprobs hold only what is new."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    # vLLM's MoE routing replay (enable_return_routed_experts), which minivllm has not: None,
    # as vLLM's without it.
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # None, as vLLM v1's output processor leaves it (the request's adapter is on RequestOutput).
    lora_request: LoRARequest | None = None
    kv_transfer_params: dict[str, Any] | None = None  # no disaggregated prefill here: None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        # vLLM's: no lora_request, finish_reason and stop_reason unquoted.
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids}, routed_experts={self.routed_experts}, "
                f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
                f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason}, "
                f"kv_transfer_params={self.kv_transfer_params})")


@dataclass
class RequestOutput:
    """The outputs of one request: `outputs` holds its n completions (index order).
    prompt_logprobs: with SamplingParams.prompt_logprobs, once the whole prompt is scored (else
    None). num_cached_tokens: prompt tokens found in the prefix cache when it was first
    scheduled. lora_request: the LoRARequest the request ran under (None: the base model).
    metrics: None; vLLM v1 gives a RequestStateStats only with log stats on, off by default in
    its LLM (minivllm's metrics are LLM.get_metrics()'). encoder_prompt,
    encoder_prompt_token_ids: None, as vLLM's for a decoder-only model; kv_transfer_params:
    None (no disaggregated prefill). Unlike vLLM's, positional arguments follow the fields
    here (outputs before prompt_logprobs): pass them by name."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None for a prompt given as embeddings (prompt_embeds)
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: Any = None
    lora_request: LoRARequest | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of this request into this one (vLLM's RequestOutput.add):
        aggregate=True appends a delta's text, token ids and logprobs to the completion of its
        index (a stream's deltas into the whole), False replaces that completion; a completion
        of a new index is appended. prompt_logprobs are kept as they are, as vLLM's."""
        if aggregate:  # checked before anything is merged
            have = {c.index: c.logprobs is not None for c in self.outputs}
            for nxt in next_output.outputs:
                if nxt.logprobs and not have.get(nxt.index, True):
                    raise ValueError(f"completion {nxt.index} has no logprobs to extend with "
                                     f"the next output's")
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params
        for nxt in next_output.outputs:
            for i, mine in enumerate(self.outputs):
                if mine.index != nxt.index:
                    continue
                if aggregate:
                    mine.text += nxt.text
                    mine.token_ids = [*mine.token_ids, *nxt.token_ids]
                    if nxt.logprobs:
                        mine.logprobs = [*mine.logprobs, *nxt.logprobs]
                    mine.cumulative_logprob = nxt.cumulative_logprob
                    mine.finish_reason = nxt.finish_reason
                    mine.stop_reason = nxt.stop_reason
                    mine.kv_transfer_params = nxt.kv_transfer_params
                else:
                    self.outputs[i] = nxt
                break
            else:
                self.outputs.append(nxt)

    def __repr__(self) -> str:
        # vLLM's field order and form (request_id unquoted).
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"encoder_prompt={self.encoder_prompt!r}, "
                f"encoder_prompt_token_ids={self.encoder_prompt_token_ids}, "
                f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
                f"finished={self.finished}, metrics={self.metrics}, "
                f"lora_request={self.lora_request}, num_cached_tokens={self.num_cached_tokens}, "
                f"kv_transfer_params={self.kv_transfer_params})")
