"""Audit of speculative_config's checks (runtime/spec_decode.py, runtime/config.py): vLLM's
spellings of an n-gram config ("model": "ngram", "[ngram]"), None standing for a key not given
(vLLM's defaults), and a num_speculative_tokens no step can verify refused before any work."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.runtime.config import EngineConfig
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.spec_decode import SpeculativeConfig

from engine_helpers import make_llm
from test_spec_decode import PROMPTS, assert_same


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


def lookup(config) -> tuple:
    c = SpeculativeConfig.create(config)
    return c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min


@pytest.mark.parametrize("config", [
    {"model": "ngram", "num_speculative_tokens": 3},
    {"model": "[ngram]", "num_speculative_tokens": 3},
    {"method": "[ngram]", "num_speculative_tokens": 3},
    {"method": "ngram", "model": "[ngram]", "num_speculative_tokens": 3},
])
def test_vllms_ngram_spellings_are_ngram(config):
    """vLLM reads "model": "ngram" (or "[ngram]") without a method as n-gram speculation, and
    method "[ngram]" as "ngram"; minivllm took the first for a draft model's directory named
    "ngram" (refused: not a checkpoint directory) and refused method "[ngram]"."""
    assert lookup(config) == ("ngram", 3, 5, 5)


def test_ngram_by_model_name_runs_as_ngram(demo_dir, device):
    base = make_llm(demo_dir, device)
    llm = make_llm(demo_dir, device, speculative_config={
        "model": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    params = SamplingParams(temperature=0, max_tokens=20)
    assert_same(base.generate(PROMPTS, params, use_tqdm=False),
                llm.generate(PROMPTS, params, use_tqdm=False))
    assert llm.engine.runner.draft_params is None  # no draft model loaded
    assert llm.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("config, want", [
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": None,
      "prompt_lookup_max": None}, ("ngram", 2, 5, 5)),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
      "prompt_lookup_max": None}, ("ngram", 2, 2, 2)),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4,
      "prompt_lookup_min": None, "model": None, "draft_tensor_parallel_size": None},
     ("ngram", 2, 4, 4)),
    ({"method": None, "model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": None,
      "prompt_lookup_min": None, "draft_tensor_parallel_size": None}, ("draft_model", 2, 0, 0)),
])
def test_none_stands_for_a_key_not_given(config, want):
    """vLLM's SpeculativeConfig fields default to None: a dict with None values (a JSON null on
    the command line, a config's fields written out) takes the defaults. minivllm refused
    prompt_lookup_max None ("is required") and a draft model's None lookup bounds ("does not
    take")."""
    assert lookup(config) == want


def test_none_num_speculative_tokens_is_still_required():
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        SpeculativeConfig.create({"method": "ngram", "num_speculative_tokens": None})


@pytest.mark.parametrize("k", [10 ** 9, 64])
@pytest.mark.parametrize("draft", [False, True])
def test_a_k_no_step_can_verify_is_refused(demo_dir, k, draft):
    """A step verifies a sequence's k drafts and its token as one chunk of at most
    max_num_batched_tokens: a larger k was taken (k = 10**9: /metrics then rendered a
    per-position series for each of the 10**9 positions, a 10**6 one was 100 MB a scrape)."""
    config = {"model": demo_dir} if draft else {"method": "ngram"}
    config["num_speculative_tokens"] = k
    with pytest.raises(ValueError, match=rf"num_speculative_tokens \({k}\) must be below "
                                         r"max_num_batched_tokens \(64\)"):
        EngineConfig.create(demo_dir, device="cpu", max_num_batched_tokens=64,
                            speculative_config=config)
    config["num_speculative_tokens"] = 63
    c = EngineConfig.create(demo_dir, device="cpu", max_num_batched_tokens=64,
                            speculative_config=config)
    assert c.speculative.num_speculative_tokens == 63


def test_the_largest_k_a_step_holds_gives_identical_outputs(demo_dir, device):
    kw = dict(max_num_batched_tokens=16)
    base = make_llm(demo_dir, device, **kw)
    llm = make_llm(demo_dir, device, speculative_config={
        "method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_min": 1}, **kw)
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=30, n=2)):
        assert_same(base.generate(PROMPTS, params, use_tqdm=False),
                    llm.generate(PROMPTS, params, use_tqdm=False))
    assert llm.stats.spec_accepted_tokens > 0 and llm.stats.max_step_tokens <= 16
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks
