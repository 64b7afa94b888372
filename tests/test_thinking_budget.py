"""thinking_token_budget (SamplingParams; runtime/reasoning.ThinkBudget, the engine's sampling
rows), against vLLM's: vllm/sampling_params.py (validate_thinking_token_budget),
vllm/v1/engine/input_processor.py (a budget needs a reasoning parser),
vllm/v1/sample/thinking_budget_state.py (ThinkingBudgetStateHolder: a think block counts the
tokens after its <think>, a prompt's own included where the prompt opened it; once it holds the
budget the next token is forced to be </think>; each later <think> opens a block with the whole
budget again, vLLM PRs 43757 and 45984) and its end-to-end check
tests/entrypoints/openai/chat_completion/test_thinking_token_budget.py (the tokens between the
last <think> of prompt + output and the first </think> after it equal the budget).

The reference: transformers' own greedy decoding of the same checkpoint (tests/
test_reasoning_tools.py's tiny model, whose tokenizer has Qwen3's tags as single tokens), with the
rule applied by hand below (`rule_state`), token for token; sampled completions against the same
seeds' completions without a budget (seeded rows: identical until the forced </think>)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from minivllm import SamplingParams
from minivllm.runtime import reasoning
from minivllm.runtime.reasoning import ThinkBudget, ThinkTags, split_reasoning

from engine_helpers import make_llm
from test_reasoning_tools import USER, ids_of, llm, model_dir  # noqa: F401 (fixtures)

START, END = 512, 513  # the tiny checkpoint's <think> and </think> (checked in `tags`)
# Kinds of prompt: the template opens <think> (Qwen3-2507 thinking models'), closes it
# (enable_thinking=False), or neither (Qwen3's first models, which write <think> themselves: a
# bias on it makes this random-weights model do so, and open blocks again and again).
OPEN, CLOSED, UNDECIDED = {"thinking": "open"}, {"enable_thinking": False}, {}


def rule_state(prompt_ids, prompt_opened: bool, out) -> int | None:
    """vLLM's rule, by hand: the tokens the open think block holds after prompt + `out` (None:
    no block is open). A prompt that opened the reasoning counts its tokens after its last
    <think>; inside a block only </think> ends it (a <think> there is one more token); outside
    one a <think> opens a new block."""
    count = None
    if prompt_opened:
        count = len(prompt_ids) - 1 - max(i for i, t in enumerate(prompt_ids) if t == START)
    for t in out:
        if count is None:
            count = 0 if t == START else None
        else:
            count = None if t == END else count + 1
    return count


def forced_here(prompt_ids, prompt_opened, out, budget) -> bool:
    count = rule_state(prompt_ids, prompt_opened, out)
    return budget is not None and count is not None and count >= budget


@pytest.fixture(scope="module")
def hf_model(model_dir):  # noqa: F811
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids, opened, budget, max_tokens, bias=None):
    """transformers' greedy completion (logit_bias added as vLLM's) with the rule forcing </think>,
    and each token's raw logprob (before the bias and the forcing, vLLM's raw_logprobs)."""
    out, lps = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].float()
            raw = torch.log_softmax(logits, -1)
            for i, b in (bias or {}).items():
                logits[i] += b
            tok = END if forced_here(prompt_ids, opened, out, budget) else int(logits.argmax())
            out.append(tok)
            lps.append(float(raw[tok]))
            if tok == 2:  # the checkpoint's EOS (<|im_end|>)
                break
    return out, lps


def prompts_of(llm, kind):  # noqa: F811
    return llm.chat_prompts(USER, chat_template_kwargs=kind)[0]["prompt_token_ids"]


@pytest.fixture(scope="module")
def sync_llm(model_dir, device):  # noqa: F811
    """The same engine without asynchronous scheduling (every step set up with its ids known)."""
    return make_llm(model_dir, device, max_model_len=1024, reasoning_parser="qwen3",
                    async_scheduling=False)


def test_tags(llm):  # noqa: F811
    assert ids_of(llm, "<think>", "</think>") == [START, END]
    assert llm.engine.async_scheduling  # the fixture's engine sets steps up ahead of their ids


# -- SamplingParams and the engine's checks -------------------------------------------------


def test_the_budget_is_checked_as_vllm_checks_it():
    """vLLM's validate_thinking_token_budget: a non-negative integer, -1 (kept as None) or None;
    bools and floats are refused, whole ones too, in vLLM's words. As minivllm's other integer
    fields a numpy integer is taken (vLLM's isinstance(value, int) refuses it)."""
    assert SamplingParams().thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    assert SamplingParams(thinking_token_budget=7).thinking_token_budget == 7
    got = SamplingParams(thinking_token_budget=np.int64(3)).thinking_token_budget
    assert got == 3 and type(got) is int
    for bad in (-2, -100, 1.5, 2.0, True, False, "3", [1]):
        with pytest.raises(ValueError, match="must be a non-negative integer or -1 for "
                                             "unlimited"):
            SamplingParams(thinking_token_budget=bad)


def test_a_budget_needs_the_reasoning_parser(model_dir, device):  # noqa: F811
    """vLLM refuses a budget where no reasoning parser / reasoning config gave it the tags
    (InputProcessor._validate_params): refused before any work, a batch with one such request
    queueing none of it."""
    plain = make_llm(model_dir, device, max_model_len=1024)
    budget = SamplingParams(max_tokens=4, thinking_token_budget=3)
    with pytest.raises(ValueError, match="no reasoning parser"):
        plain.generate(["hello"], budget, use_tqdm=False)
    with pytest.raises(ValueError, match="no reasoning parser"):
        plain.generate(["hello", "world"], [SamplingParams(max_tokens=4), budget],
                       use_tqdm=False)
    assert not plain.engine.has_unfinished_requests() and not plain.engine.requests
    # -1 / None asks for nothing: served as ever.
    out = plain.generate(["hello"], SamplingParams(max_tokens=4, thinking_token_budget=-1),
                         use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# -- greedy completions against transformers with the rule --------------------------------


CASES = [  # (prompt kind, bias, budget)
    (OPEN, None, 0), (OPEN, None, 1), (OPEN, None, 2), (OPEN, None, 6),
    (UNDECIDED, {START: 2.0}, 0), (UNDECIDED, {START: 2.0}, 1), (UNDECIDED, {START: 2.0}, 3),
    (CLOSED, None, 0),
]


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_greedy_completions_follow_the_rule(llm, sync_llm, hf_model, scheduling):  # noqa: F811
    """Every case in one batch (beside a request without a budget): each completion equals
    transformers' greedy one with the rule forcing </think>, token for token; the forced tokens'
    logprobs are the model's raw ones (vLLM's raw_logprobs: taken before the forcing)."""
    engine = llm if scheduling == "async" else sync_llm
    max_tokens = 14
    prompts, params, refs = [], [], []
    for kind, bias, budget in CASES + [(OPEN, None, None)]:
        ids = prompts_of(engine, kind)
        prompts.append({"prompt_token_ids": ids})
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias=bias,
                                     thinking_token_budget=budget, logprobs=0))
        refs.append((ids, kind is OPEN, budget, bias))
    outs = engine.generate(prompts, params, use_tqdm=False)
    for (ids, opened, budget, bias), out in zip(refs, outs):
        got = out.outputs[0]
        want, lps = hf_greedy(hf_model, ids, opened, budget, max_tokens, bias)
        assert list(got.token_ids) == want, (budget, bias)
        for i, tok in enumerate(want):
            if forced_here(ids, opened, want[:i], budget):
                assert got.logprobs[i][tok].logprob == pytest.approx(lps[i], abs=1e-4)


def count_between_markers(full_ids) -> int:
    """vLLM's end-to-end count: tokens after the last <think> of prompt + output up to the first
    </think> after it."""
    last = max(i for i, t in enumerate(full_ids) if t == START)
    rest = full_ids[last + 1:]
    return rest.index(END) if END in rest else len(rest)


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 9])
def test_an_opened_prompt_counts_its_own_thinking_tokens(llm, budget):  # noqa: F811
    """A prompt that opened <think> ("<think>\\n": one token after it) counts that token: the
    reasoning holds budget - 1 generated tokens (none at 0 and 1) and </think> comes; a longer
    opened think in the prompt spends more. The answer follows the </think>."""
    ids = prompts_of(llm, OPEN)
    longer = ids + [100, 101, 102]  # four tokens after the prompt's <think>
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": longer}],
                        SamplingParams(temperature=0, max_tokens=16,
                                       thinking_token_budget=budget), use_tqdm=False)
    for prompt, out in zip((ids, longer), outs):
        got = list(out.outputs[0].token_ids)
        spent = len(prompt) - 1 - prompt.index(START)
        assert got.index(END) == max(budget - spent, 0)
        assert count_between_markers(prompt + got) == max(budget, spent)
        # The answer goes on after it, and the split ends the reasoning there.
        assert len(got) > got.index(END) + 1
        _, answer = split_reasoning(out.outputs[0].text, reasoning.REASONING)
        assert answer


def test_no_budget_and_minus_one_change_nothing(llm):  # noqa: F811
    """-1 and None: no limit, the completion is the one without the field (a bias makes the
    model open think blocks again and again, which no budget ends)."""
    ids = prompts_of(llm, UNDECIDED)
    outs = [llm.generate([{"prompt_token_ids": ids}],
                         SamplingParams(temperature=0, max_tokens=12, logit_bias={START: 2.0},
                                        **kw), use_tqdm=False)[0].outputs[0].token_ids
            for kw in ({}, {"thinking_token_budget": None}, {"thinking_token_budget": -1})]
    assert outs[0] == outs[1] == outs[2] and END not in outs[0]


def test_sampled_completions_each_keep_their_budget(llm):  # noqa: F811
    """n=3 sampled, seeded: each completion is the same seed's completion without a budget up
    to the forced </think> (the seeded rows draw the same), </think> where the rule puts it,
    and the rule holds at every later token too (a <think> the answer writes opens a block
    the budget holds again)."""
    ids = prompts_of(llm, OPEN)
    budget = 5
    base = dict(temperature=1.0, seed=11, n=3, max_tokens=20)
    free = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**base),
                        use_tqdm=False)[0].outputs
    held = llm.generate([{"prompt_token_ids": ids}],
                        SamplingParams(**base, thinking_token_budget=budget),
                        use_tqdm=False)[0].outputs
    assert len(held) == 3
    for f, h in zip(free, held):
        f, h = list(f.token_ids), list(h.token_ids)
        cut = budget - 1  # "<think>\n" spent one
        assert END not in f[:cut]  # (else this seed ended its reasoning on its own)
        assert h[:cut] == f[:cut] and h[cut] == END
        for i, tok in enumerate(h):
            if forced_here(ids, True, h[:i], budget):
                assert tok == END


def test_the_forced_token_wins_over_the_requests_other_constraints(llm):  # noqa: F811
    """vLLM sets the forced token's logit after every other processor: allowed_token_ids
    without </think>, a bias against it, bad_words and min_tokens' ban of a stop id do not
    keep it out; the other steps keep them."""
    ids = prompts_of(llm, OPEN)
    allowed = [100, 242, 265]
    cases = [dict(allowed_token_ids=allowed), dict(logit_bias={END: -100.0}),
             dict(bad_words=["</think>"]), dict(min_tokens=8, stop_token_ids=[END])]
    outs = llm.generate([{"prompt_token_ids": ids}] * len(cases),
                        [SamplingParams(temperature=0, max_tokens=8, thinking_token_budget=4,
                                        **kw) for kw in cases], use_tqdm=False)
    for kw, out in zip(cases, outs):
        got = list(out.outputs[0].token_ids)
        assert got[3] == END and END not in got[:3] + got[4:], kw
        if "allowed_token_ids" in kw:
            assert set(got[:3] + got[4:]) <= set(allowed)


def test_speculative_rows_with_a_budget_decode_without_drafts(model_dir, device, llm):  # noqa: F811
    """With ngram speculation a budget's row decodes one token a step (its rows would differ
    across the drafts' positions): the outputs are those without speculation, while the
    request without a budget beside it still drafts."""
    spec = make_llm(model_dir, device, max_model_len=1024, reasoning_parser="qwen3",
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    ids = prompts_of(llm, OPEN)
    prompts = [{"prompt_token_ids": ids}] * 3
    params = [SamplingParams(temperature=0, max_tokens=24, thinking_token_budget=b)
              for b in (4, 12, None)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert spec.stats.spec_accepted_tokens > 0


def test_preempted_sequences_keep_their_count(model_dir, device, llm):  # noqa: F811
    """A cache too small for every sequence at once: sequences are preempted mid-reasoning and
    recomputed, their budgets counted as without preemption."""
    small = make_llm(model_dir, device, max_model_len=1024, reasoning_parser="qwen3",
                     num_kv_blocks=12, enable_prefix_caching=False)
    ids = prompts_of(llm, OPEN)
    prompts = [{"prompt_token_ids": ids + [100 + i]} for i in range(6)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True,
                             thinking_token_budget=10 + 3 * i) for i in range(6)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert got == want and small.stats.preemptions > 0
    for i, out in enumerate(got):
        assert out.index(END) == 10 + 3 * i - 2  # "<think>\n" and the id after it spent two


# -- asynchronous set-up: the state machine's reasoning over unread tokens ---------------------


TAGS = ThinkTags(START, END)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 4), opened=st.booleans(),
       tokens=st.lists(st.sampled_from([START, END, 7, 8]), min_size=1, max_size=30),
       overlap=st.lists(st.booleans(), min_size=30, max_size=30))
def test_a_step_set_up_ahead_of_its_ids_forces_what_the_rule_does(budget, opened, tokens,
                                                                  overlap):
    """The engine's protocol (asynchronous scheduling): a step is set up with the previous
    step's token unread unless the set-up before asked for it (needs_known); set up so, forced()
    says what the rule says with every id known. The model's tokens are any (`tokens`), except
    that a forced step's is </think>."""
    prompt = [1, START, 9, 9] if opened else [1, 2]
    state = ThinkBudget(TAGS, budget, prompt)
    out: list[int] = []
    needs_known = True  # a sequence's first step has no unread token
    for step, (token, ahead) in enumerate(zip(tokens, overlap)):
        pending = 1 if (ahead and not needs_known and out) else 0
        state.advance(prompt + out, len(prompt) + len(out) - pending)
        forced = state.forced(pending)
        needs_known = state.needs_known(pending)
        assert forced == forced_here(prompt, opened, out, budget), (step, out)
        out.append(END if forced else token)


def test_a_budget_reads_its_ids_first_only_near_its_end():
    """needs_known: far from the budget a step may be set up before the previous token is read
    (the engine keeps overlapping steps); one token before it, or outside a block with a budget
    of 0 (a <think> would be forced shut at once), the token must be read first."""
    state = ThinkBudget(TAGS, 10, [1, START])
    state.advance([1, START, 7, 7, 7], 5)
    assert not state.needs_known(0) and not state.needs_known(1)
    state.advance([1, START] + [7] * 9, 11)  # nine in the block: the next may be its tenth
    assert state.needs_known(0)
    assert not ThinkBudget(TAGS, 3, [1, 2]).needs_known(0)  # outside, budget > 0
    assert ThinkBudget(TAGS, 0, [1, 2]).needs_known(0)


def test_the_servers_field(llm):  # noqa: F811
    """The server takes vLLM's request field thinking_token_budget (completions and chat) into
    SamplingParams: the text is LLM.generate's with the same budget; a bad one is a 400 that
    names it, and the server answers as before after it."""
    from minivllm.runtime.server import OpenAIServer

    from engine_helpers import serving
    from test_server import post

    ids = prompts_of(llm, OPEN)
    want = llm.generate([{"prompt_token_ids": ids}],
                        SamplingParams(temperature=0, max_tokens=12, thinking_token_budget=2),
                        use_tqdm=False)[0].outputs[0]
    assert END in want.token_ids
    with serving(OpenAIServer(llm, port=0, model_name="tiny")) as srv:
        body = {"prompt": ids, "temperature": 0, "max_tokens": 12, "thinking_token_budget": 2}
        status, got = post(srv, "/v1/completions", body)
        assert status == 200 and got["choices"][0]["text"] == want.text
        for bad in (2.5, -3, True):
            status, got = post(srv, "/v1/completions", {**body, "thinking_token_budget": bad})
            assert status == 400 and "thinking_token_budget" in got["error"]["message"]
        status, got = post(srv, "/v1/chat/completions",
                           {"messages": USER, "max_tokens": 4, "thinking_token_budget": 0})
        assert status == 200
