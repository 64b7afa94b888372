"""Engine-level tests from session 50's mutation round over minivllm/runtime: the real LLMEngine
(checks, scheduling, stop rules, statistics, outputs) over a scripted model runner that "samples"
a script chosen by the test, so that every expectation is known token by token from the rules the
engine documents (vLLM's), not read back from the code."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.runtime.config import EngineConfig
from minivllm.runtime.engine import LLMEngine

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint
from scripted_runner import Scripted, ScriptedAsync

# -- a scripted engine: the real LLMEngine (scheduling, stop checks, statistics, outputs) over a
# runner that "samples" a script, so that the expectation is known token by token -----------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=0), tmp_path_factory.mktemp("tiny") / "model")


def scripted_engine(tiny_dir, scripts, *, asynchronous=False, **kw):
    kw = dict(device="cpu", num_kv_blocks=32, block_size=4, max_model_len=64,
              attention_backend="reference") | kw
    config = EngineConfig.create(tiny_dir, **kw)
    runner = (ScriptedAsync if asynchronous else Scripted)(config, scripts)
    return LLMEngine(config, None, runner=runner), runner


def run_all(engine):
    outs = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            outs[o.request_id] = o
    else:
        raise AssertionError("never finished")
    return outs


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("kw, sees_prompt", [(dict(presence_penalty=0.5), False),
                                             (dict(frequency_penalty=-0.5), False),
                                             (dict(repetition_penalty=1.3), True)])
def test_penalised_rows_see_every_generated_id_and_the_prompt_for_repetition(tiny_dir, kw, sees_prompt,
                                                                             asynchronous):
    """Penalties act on the ids generated so far (all of them: with asynchronous scheduling the
    pending one is taken from the last step's tokens), the repetition penalty on the prompt's
    too: the k-th sampled row sees script[:k] and, for repetition, the prompt; asynchronously,
    each row after the first holds all but the last, which is pending."""
    script = [5, 6, 7, 8, 9]
    prompt = [1, 2, 3, 4, 2]
    eng, runner = scripted_engine(tiny_dir, {3: script}, asynchronous=asynchronous)
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(seed=3, max_tokens=5, **kw))
    out = run_all(eng)["0"]
    assert out.outputs[0].token_ids == script
    assert runner.output_ids == [tuple(script[:k]) for k in range(5)]
    held = [tuple(script[:k - 1 if asynchronous and k else k]) for k in range(5)]
    assert [tuple(r.output_ids) for r in runner.rows] == held
    assert [tuple(r.prompt_ids) for r in runner.rows] == [tuple(prompt) if sees_prompt else ()] * 5


def test_step_statistics_count_every_sequence_and_token_of_a_step(tiny_dir):
    """Step 1 under a 4-token budget holds A (1 token), B (1 token) and the first 2 tokens of C's
    10-token prompt: 3 sequences and 4 tokens, though only 2 sample; no later step holds more."""
    eng, _ = scripted_engine(tiny_dir, {1: [7], 2: [8], 3: [9, 9]}, max_num_batched_tokens=4)
    eng.add_requests([{"prompt_token_ids": [5]}, {"prompt_token_ids": [6]},
                      {"prompt_token_ids": list(range(10, 20))}],
                     [SamplingParams(seed=1, max_tokens=1), SamplingParams(seed=2, max_tokens=1),
                      SamplingParams(seed=3, max_tokens=2)])
    run_all(eng)
    s = eng.stats
    assert (s.max_step_seqs, s.max_step_tokens, s.prompt_tokens_computed, s.generation_tokens) == \
        (3, 4, 12, 4)


def test_num_cached_tokens_reports_the_prompts_cached_blocks(tiny_dir):
    """A second request with the first one's 11-token prompt finds its 2 full blocks of 4 (not
    the block holding the last token, which must be computed): 8 cached tokens; the first, 0."""
    eng, _ = scripted_engine(tiny_dir, {1: [7, 7], 2: [8, 8]})
    prompt = {"prompt_token_ids": list(range(20, 31))}
    eng.add_request(prompt, SamplingParams(seed=1, max_tokens=2))
    first = run_all(eng)["0"]
    eng.add_request(prompt, SamplingParams(seed=2, max_tokens=2))
    second = run_all(eng)["1"]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 8)
    assert eng.stats.prompt_tokens_cached == 8


def test_a_top_k_past_the_vocabulary_samples_as_top_k_off(tiny_dir, device):
    """top_k larger than the vocabulary (even past int64) keeps every id: the same seeded draws
    as top_k=0 (off), instead of an overflow once the step has started."""
    llm = make_llm(tiny_dir, device, num_kv_blocks=16, block_size=4, max_model_len=32)
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    outs = [llm.generate(prompt, SamplingParams(temperature=1.0, top_k=k, seed=5, max_tokens=6,
                                                ignore_eos=True), use_tqdm=False)[0]
            for k in (0, 101, 2 ** 70)]
    ids = [o.outputs[0].token_ids for o in outs]
    assert len(ids[0]) == 6 and ids[0] == ids[1] == ids[2]


def test_finished_requests_leave_the_engine(tiny_dir):
    """Once a request's last output is returned, the engine holds nothing of it (no request
    entry, no sequence, no block)."""
    eng, _ = scripted_engine(tiny_dir, {1: [7, 8], 2: [9, 9, 9]})
    eng.add_requests([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}],
                     [SamplingParams(seed=1, max_tokens=2), SamplingParams(seed=2, max_tokens=3)])
    outs = run_all(eng)
    assert sorted(outs) == ["0", "1"] and all(o.finished for o in outs.values())
    assert eng.requests == {} and eng.scheduler.sequences == []
    assert eng.block_manager.num_free == eng.num_blocks


def test_add_requests_refuses_prompts_and_params_of_different_lengths(tiny_dir):
    eng, _ = scripted_engine(tiny_dir, {})
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        eng.add_requests([{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}], [SamplingParams()])
    assert eng.requests == {} and not eng.has_unfinished_requests()


def test_the_tokenizers_eos_comes_first_whatever_the_ids(tmp_path):
    """read_eos_ids: the tokenizer's EOS is the EOS proper (first; stop_reason None), then the
    config's, then generation_config.json's, each once, in that order (not sorted)."""
    from types import SimpleNamespace

    from minivllm.runtime.engine import read_eos_ids

    got = read_eos_ids(str(tmp_path), SimpleNamespace(eos_token_ids=(50, 5)),
                       SimpleNamespace(eos_token_id=60), {"eos_token_id": [3, 60, 5]})
    assert got == (60, 50, 5, 3)
    got = read_eos_ids(str(tmp_path), SimpleNamespace(eos_token_ids=(50,)), None, {"eos_token_id": 3})
    assert got == (50, 3)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_kth_sampled_token_is_drawn_at_step_k_synchronous_or_not(tiny_dir, asynchronous):
    """The sampler's step of a row is the number of tokens its sequence generated before it,
    pending ones included: with asynchronous scheduling too, completion i samples script[k]
    as its k-th token (the seeded stream does not repeat or skip a draw)."""
    scripts = {1: [10, 11, 12, 13, 14, 15], 2: [20, 21, 22, 23, 24, 25]}
    eng, _ = scripted_engine(tiny_dir, scripts, asynchronous=asynchronous)
    eng.add_requests([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6, 7, 8]}],
                     [SamplingParams(seed=1, max_tokens=6), SamplingParams(seed=2, max_tokens=5)])
    outs = run_all(eng)
    assert outs["0"].outputs[0].token_ids == scripts[1]
    assert outs["1"].outputs[0].token_ids == scripts[2][:5]


class CharTokenizer:
    eos_token_id = None

    def encode(self, text):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return "".join(chr(48 + i % 40) for i in ids)


@pytest.mark.parametrize("prompt", ["", {"prompt": ""}, {"prompt_token_ids": []}])
def test_an_empty_prompt_is_refused_in_every_form(tiny_dir, prompt):
    config = EngineConfig.create(tiny_dir, device="cpu", num_kv_blocks=8, block_size=4,
                                 max_model_len=32, attention_backend="reference")
    eng = LLMEngine(config, CharTokenizer(), runner=Scripted(config, {}))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(prompt, SamplingParams())
    assert not eng.has_unfinished_requests()
    assert eng.add_request({"prompt": "ab"}, SamplingParams()) == "0"


def test_stream_refuses_a_params_list_of_another_length(tiny_dir, device):
    """As generate does: two prompts with one SamplingParams in a list is an error, raised by
    stream() itself (not a silently dropped prompt)."""
    llm = make_llm(tiny_dir, device, num_kv_blocks=16, block_size=4, max_model_len=32)
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.stream([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}], [sp])
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        llm.stream([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}], [sp] * 3)
    assert not llm.engine.has_unfinished_requests()


def test_generate_returns_outputs_in_input_order(tiny_dir, device):
    """Requests that finish in another order (the later ones shorter) come back as given."""
    llm = make_llm(tiny_dir, device, num_kv_blocks=32, block_size=4, max_model_len=40)
    prompts = [{"prompt_token_ids": [1] * 3}, {"prompt_token_ids": [2] * 9},
               {"prompt_token_ids": [3] * 6}]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 1, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outs] == [7, 1, 3]


def test_streamed_logprobs_hold_only_the_new_tokens(tiny_dir, device):
    """Each streamed delta holds one logprobs entry per new token id, keyed by that id; joined,
    they equal generate's (same seed)."""
    llm = make_llm(tiny_dir, device, num_kv_blocks=32, block_size=4, max_model_len=40)
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=5, logprobs=2, ignore_eos=True)
    prompt = {"prompt_token_ids": [4, 5, 6]}
    ids, lps = [], []
    for delta in llm.stream(prompt, sp):
        for c in delta.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
            ids += c.token_ids
            lps += c.logprobs
    whole = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert ids == whole.token_ids and len(ids) == 5
    assert [{k: v.logprob for k, v in d.items()} for d in lps] == \
        [{k: v.logprob for k, v in d.items()} for d in whole.logprobs]


# -- EngineConfig's ranges ------------------------------------------------------------------------


def test_engine_config_ranges_include_their_ends(tiny_dir):
    """max_model_len up to max_position_embeddings (512 here) and no further; max_logprobs 0
    (vLLM: no logprobs asked for more than that); gpu_memory_utilization in (0, 1]; a
    kv_cache_dtype other than the model's dtype only in fp8; on CPU the default step budget is
    512 tokens (the reference attention's memory grows with tokens x context)."""
    create = lambda **kw: EngineConfig.create(tiny_dir, device="cpu", **kw)  # noqa: E731
    assert create(max_model_len=512).max_model_len == 512
    with pytest.raises(ValueError, match="max_position_embeddings"):
        create(max_model_len=513)
    assert create(max_logprobs=0).max_logprobs == 0
    assert create(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    for bad in (0, 0.0, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            create(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        create(dtype="float32", kv_cache_dtype="bfloat16")
    assert create().max_num_batched_tokens == 512


def _bos_tokenizer():
    """A word-level tokenizer whose encode() adds a BOS "<s>" (as Llama's do), with a chat
    template that writes "<s>" itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "user", "hi", "assistant", ":"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
    return fast


def test_chat_prompts_hold_the_templates_special_tokens_once(tiny_dir, device, tmp_path):
    """The chat template writes the BOS itself: the prompt's ids are its text's tokens, with no
    second BOS from encode() (vLLM: add_special_tokens=False for chat); and LLM(tokenizer=dir)
    takes the tokenizer from that directory, not the model's (which has none)."""
    tok = _bos_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    llm = make_llm(tiny_dir, device, num_kv_blocks=16, block_size=4, max_model_len=32,
                   tokenizer=str(tmp_path / "tok"))
    assert llm.get_tokenizer() is not None and llm.get_tokenizer().bos_token == "<s>"
    [prompt] = llm.chat_prompts([{"role": "user", "content": "hi"}])
    assert prompt["prompt"] == "<s>user : hi assistant :"
    assert prompt["prompt_token_ids"] == [1, 3, 6, 4, 5, 6]
