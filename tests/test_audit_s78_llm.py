"""Session 78's audit of the offline Python API (runtime/llm.py's LLM) against current vLLM's
vllm/entrypoints/llm.py (LLM.generate, LLM.chat, _validate_and_add_requests, _run_engine),
vllm/renderers/inputs/preprocess.py (prompt_to_seq, parse_dec_only_prompt), vllm/inputs/llm.py
(DecoderOnlyPrompt), vllm/renderers/params.py (TokenizeParams.with_kwargs) and
tests/entrypoints/llm/test_generate.py (test_multiple_priority).

What differed, each test failing before its fix:
  - a prompt given as a bare list of token ids (vLLM's DecoderOnlyPrompt `list[int]`, alone
    or as an item of the list) was refused ("a prompt is a string or ..., got int");
  - use_tqdm as a callable (vLLM's `bool | Callable[..., tqdm]`, e.g. functools.partial(tqdm,
    leave=False)) was taken for True and never called; a factory that fails must leave the
    engine as a fresh one (the bar is now made after the checks, before any request is queued);
  - generate / chat's tokenization_kwargs (vLLM's way to ask truncate_prompt_tokens now that
    SamplingParams' is deprecated; add_special_tokens) was a TypeError;
  - LLM.chat's parameters: vLLM's are positional in its order, with chat_template_content_format;
    chat_template_kwargs' "tokenize" (vLLM's own tokenize=False wins) raised transformers'
    "got multiple values for keyword argument 'tokenize'";
  - one priority for every prompt (priority=3; vLLM's test_multiple_priority) was a TypeError.

Oracles: transformers' greedy tokens of the same checkpoint (fp32 on the CPU, exact) and its
apply_chat_template, vLLM's documented equivalences (a list of ids is {"prompt_token_ids": ids}),
and a fresh engine's tokens for unseeded sampling (its seeds drawn from LLM(seed=...))."""

from __future__ import annotations

import io

import pytest
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from minivllm import SamplingParams
from minivllm.runtime.demo import VOCAB_SIZE, build_tokenizer

from engine_helpers import make_llm
from hf_tiny import hf_greedy, make_hf_model, save_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=0, std=0.3, vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, hf_model):
    """The tiny checkpoint with the demo's byte-level BPE tokenizer (same vocabulary size)."""
    path = save_checkpoint(hf_model, tmp_path_factory.mktemp("s78_llm") / "model")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir, device):
    return make_llm(model_dir, device, num_kv_blocks=64, block_size=4, max_model_len=64)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(llm) -> None:
    bm = llm.engine.block_manager
    assert not llm.engine.requests and bm.num_free == bm.num_blocks


def test_a_list_of_token_ids_is_one_prompt(llm, hf_model, model_dir):
    """vLLM's DecoderOnlyPrompt includes list[int] ("a tokenized prompt"); prompt_to_seq takes a
    list whose items are ints for one prompt, parse_dec_only_prompt each list item for one."""
    a, b = [5, 6, 7, 8], [40, 41]
    text = "hello there"
    ids = AutoTokenizer.from_pretrained(model_dir).encode(text)
    want_a, want_b, want_t = (hf_greedy(hf_model, p, 5) for p in (a, b, ids))
    [one] = llm.generate(a, GREEDY, use_tqdm=False)
    assert (one.prompt, one.prompt_token_ids, one.outputs[0].token_ids) == (None, a, want_a)
    assert tokens(llm.generate([a, b], GREEDY, use_tqdm=False)) == [want_a, want_b]
    mixed = llm.generate([b, text, {"prompt_token_ids": a}, a], GREEDY, use_tqdm=False)
    assert tokens(mixed) == [want_b, want_t, want_a, want_a]  # input order
    assert [o.prompt for o in mixed] == [None, text, None, None]
    assert [o.prompt_token_ids for o in mixed] == [b, ids, a, a]
    for bad, match in (([[5, "x"]], "prompt_token_ids holds 'x'"), ([[]], "empty"),
                       ([5, "x"], "prompt_token_ids holds 'x'")):
        with pytest.raises(ValueError, match=match):
            llm.generate(bad, GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_use_tqdm_may_be_the_bars_factory(llm):
    """vLLM's use_tqdm: `tqdm_func = use_tqdm if callable(use_tqdm) else tqdm`, called with
    total= the requests and desc="Processed prompts"."""
    made = []

    def factory(**kw):
        made.append(kw)
        made.append(tqdm(file=io.StringIO(), **kw))
        return made[-1]

    outs = llm.generate(["hello", {"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=factory)
    assert len(outs) == 2 and len(made) == 2
    kw, bar = made
    assert kw["total"] == 2 and kw["desc"] == "Processed prompts"
    assert bar.n == 2 and bar.disable  # it counted both; closed (tqdm.close sets disable)
    pooled = llm.chat(HELLO, GREEDY, use_tqdm=factory)
    assert len(made) == 4 and made[2]["total"] == 1 and len(pooled) == 1


def test_bad_input_leaves_a_fresh_engines_tokens(model_dir, device):
    """Refused calls, a progress-bar factory that fails among them, leave the engine serving
    the next call exactly as a fresh one: no request left, every block free, and the seeds of
    unseeded requests (drawn from LLM(seed=...) at queueing) not drawn by the refused calls."""
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    prompts = ["hello there", {"prompt_token_ids": [5, 6, 7]}, {"prompt": "world"}]
    fresh = make_llm(model_dir, device, num_kv_blocks=64, block_size=4, max_model_len=64)
    want = tokens(fresh.generate(prompts, sampled, use_tqdm=False))
    used = make_llm(model_dir, device, num_kv_blocks=64, block_size=4, max_model_len=64)

    def broken_bar(**kw):
        raise RuntimeError("no terminal")

    with pytest.raises(RuntimeError, match="no terminal"):
        used.generate(prompts, sampled, use_tqdm=broken_bar)
    assert_idle(used)
    bad_calls = [
        (lambda: used.generate(prompts, [sampled]), "3 prompts but 1 sampling params"),
        (lambda: used.generate(prompts, sampled, priority=[0]), "3 prompts but 1 priorities"),
        (lambda: used.generate(prompts, sampled, lora_request=[None]), "3 prompts but 1 lora"),
        (lambda: used.generate(prompts + [{"prompt": "x", "multi_modal_data": {}}], sampled),
         "multi_modal_data"),
        (lambda: used.generate(prompts, sampled, tokenization_kwargs={"padding": True}),
         "padding"),
        (lambda: used.chat(HELLO, sampled, chat_template_content_format="openai"), "openai"),
    ]
    for call, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            call()
        assert_idle(used)
    assert tokens(used.generate(prompts, sampled, use_tqdm=False)) == want


def test_tokenization_kwargs_as_vllm(llm, hf_model, model_dir, device, tmp_path):
    """vLLM's generate / chat take tokenization_kwargs; its truncate_prompt_tokens keeps the
    last k tokens (TokenizeParams, truncation_side "left"), a request's own wins (merge_kwargs
    of the kwargs and the SamplingParams'); add_special_tokens=False tokenizes without the
    tokenizer's BOS. Keys minivllm does not take are refused by name, not ignored."""
    text = "hello there, the quick brown fox"
    ids = AutoTokenizer.from_pretrained(model_dir).encode(text)
    assert len(ids) > 5
    [cut] = llm.generate(text, GREEDY, use_tqdm=False,
                         tokenization_kwargs={"truncate_prompt_tokens": 3})
    assert cut.prompt_token_ids == ids[-3:]
    assert cut.outputs[0].token_ids == hf_greedy(hf_model, ids[-3:], 5)
    own = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=4)
    outs = llm.generate([text, text], [GREEDY, own], use_tqdm=False,
                        tokenization_kwargs={"truncate_prompt_tokens": 2})
    assert [o.prompt_token_ids for o in outs] == [ids[-2:], ids[-4:]]
    [chat] = llm.chat(HELLO, GREEDY, use_tqdm=False,
                      tokenization_kwargs={"truncate_prompt_tokens": 3})
    [whole] = llm.chat(HELLO, GREEDY, use_tqdm=False)
    assert chat.prompt_token_ids == whole.prompt_token_ids[-3:]
    with pytest.raises(ValueError, match=r"not \['max_length', 'padding'\]"):
        llm.generate(text, GREEDY, tokenization_kwargs={"padding": True, "max_length": 4})
    with pytest.raises(TypeError, match="tokenization_kwargs must be a dict"):
        llm.generate(text, GREEDY, tokenization_kwargs=[("truncate_prompt_tokens", 2)])
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate(text, GREEDY, tokenization_kwargs={"truncate_prompt_tokens": 0})
    with pytest.raises(TypeError, match="add_special_tokens must be True or False"):
        llm.generate(text, GREEDY, tokenization_kwargs={"add_special_tokens": "no"})
    assert_idle(llm)

    # add_special_tokens: a tokenizer whose encode() writes a BOS, as Llama's
    bos_dir = str(tmp_path / "bos_tok")
    bos_tokenizer().save_pretrained(bos_dir)
    oracle = AutoTokenizer.from_pretrained(bos_dir)
    bos_llm = make_llm(model_dir, device, num_kv_blocks=16, block_size=4, max_model_len=32,
                       tokenizer=bos_dir)
    with_bos, without, salted = bos_llm.generate(
        ["user hi", {"prompt": "user hi"}, {"prompt": "user hi", "cache_salt": "s"}], GREEDY,
        use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})
    assert oracle.encode("user hi") == [1, 3, 4]
    assert with_bos.prompt_token_ids == without.prompt_token_ids == [3, 4]
    assert salted.prompt_token_ids == [3, 4]  # a prompt with vLLM's cache_salt is text too
    assert with_bos.prompt == "user hi"
    assert with_bos.outputs[0].token_ids == hf_greedy(hf_model, [3, 4], 5)
    [default] = bos_llm.generate("user hi", GREEDY, use_tqdm=False,
                                 tokenization_kwargs={"add_special_tokens": True})
    assert default.prompt_token_ids == [1, 3, 4]


def bos_tokenizer():
    """A word-level tokenizer whose encode() adds a BOS "<s>" (as Llama's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "user", "hi", "assistant"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def test_chat_takes_vllms_arguments(llm, model_dir):
    """vLLM's LLM.chat(messages, sampling_params, use_tqdm, lora_request, chat_template,
    chat_template_content_format, add_generation_prompt, continue_final_message, tools,
    chat_template_kwargs, ...): positional in that order. chat_template_content_format "auto" /
    "string" render the content as a string ("openai", a list of parts, is refused by name);
    chat_template_kwargs' tokenize gives way to vLLM's own tokenize=False."""
    oracle = AutoTokenizer.from_pretrained(model_dir)
    want = oracle.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    by_name = llm.chat(HELLO, GREEDY, use_tqdm=False)
    positional = llm.chat(HELLO, GREEDY, False, None, None, "string", True, False, None, None)
    assert by_name[0].prompt == positional[0].prompt == want
    assert tokens(positional) == tokens(by_name)
    cont = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello the"}]
    [open_turn] = llm.chat(cont, GREEDY, False, None, None, "auto", False, True)
    assert open_turn.prompt == oracle.apply_chat_template(cont, tokenize=False,
                                                           continue_final_message=True)
    for kwargs in ({"tokenize": True}, {"tokenize": True, "return_dict": True}):
        [out] = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)
        assert out.prompt == want and out.prompt_token_ids == by_name[0].prompt_token_ids
    with pytest.raises(ValueError, match="chat_template_content_format='openai'"):
        llm.chat(HELLO, GREEDY, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="must be 'auto', 'string' or 'openai', got 'text'"):
        llm.chat(HELLO, GREEDY, chat_template_content_format="text")
    assert_idle(llm)


def test_one_priority_for_every_prompt(model_dir, device):
    """vLLM's test_multiple_priority: "Generate works when priority is a single value applied
    to every prompt"; a list must still match the prompts."""
    llm = make_llm(model_dir, device, num_kv_blocks=64, block_size=4, max_model_len=64,
                   scheduling_policy="priority")
    prompts = ["hello", {"prompt_token_ids": [5, 6, 7]}]
    want = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, priority=[3, 3]))
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, priority=3)) == want
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, priority=torch.tensor(0))) == \
        want
    with pytest.raises(ValueError, match="2 prompts but 0 priorities"):
        llm.generate(prompts, GREEDY, use_tqdm=False, priority=[])
    with pytest.raises(TypeError, match="priority must be a list of integers"):
        llm.generate(prompts, GREEDY, use_tqdm=False, priority=True)
    assert_idle(llm)
