"""SamplingParams.truncate_prompt_tokens (vLLM's): a request keeps only its prompt's last k
tokens, as if it had been given those alone."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=6, std=0.3), tmp_path_factory.mktemp("trunc") / "m")


def test_a_truncated_prompt_runs_as_its_last_tokens_alone(tiny_dir, device):
    llm = make_llm(tiny_dir, device, max_model_len=32)
    prompt = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    cut, alone = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[-9:]}],
                              [SamplingParams(truncate_prompt_tokens=9, **greedy),
                               SamplingParams(**greedy)], use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-9:]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    # Longer than max_model_len, untruncated or cut to max_model_len (-1), it cannot run.
    for keep in (None, -1):
        with pytest.raises(ValueError, match="maximum model length of 32"):  # vLLM's LLM's words
            llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(truncate_prompt_tokens=keep, **greedy), use_tqdm=False)
    # A k past max_model_len is refused (as vLLM), before any work.
    with pytest.raises(ValueError, match="truncate_prompt_tokens=33 exceeds max_model_len=32"):
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(truncate_prompt_tokens=33, **greedy), use_tqdm=False)
    assert not llm.engine.requests
    # A k longer than the prompt keeps all of it.
    whole = llm.generate([{"prompt_token_ids": prompt[:5]}],
                         SamplingParams(truncate_prompt_tokens=20, **greedy), use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt[:5]


@pytest.mark.parametrize("keep", [0, -2, 1.5, True, "3"])
def test_bad_truncations_are_refused(keep):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=keep)
