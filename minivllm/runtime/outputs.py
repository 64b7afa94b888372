"""What the engine hands back, shaped like vLLM's RequestOutput / CompletionOutput / Logprob."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The outputs of one request: `outputs` holds its n completions (index order).
    prompt_logprobs: with SamplingParams.prompt_logprobs, once the whole prompt is scored (else
    None). num_cached_tokens: prompt tokens found in the prefix cache when it was first
    scheduled."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None for a prompt given as embeddings (prompt_embeds)
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
