"""The text path (incremental detokenization, stop strings, stop ids, finish reasons, streaming)
against an independent oracle of vLLM's documented semantics.

Most tests drive a real LLMEngine whose model runner is scripted (it "samples" a given id list),
so that any token sequence can be fed through the engine's real scheduling and postprocessing,
synchronous and asynchronous; one test runs the demo model itself. The oracle below never
decodes incrementally: it decodes whole id lists with tokenizer.decode and applies vLLM v1's
rules (vllm/v1/engine/detokenizer.py, vllm/v1/core/sched/utils.py check_stop,
vllm/v1/engine/output_processor.py):
  - the text of k output tokens is decode(prompt + out[:k]) minus the prompt's text, both cut
    back to the last point where the text does not end in U+FFFD (an unfinished character is
    held back until a later token completes it; vLLM's DecodeStream, primed with the prompt);
  - EOS (unless ignore_eos) and stop_token_ids stop once min_tokens are out, before the length
    checks; the stopping token stays in token_ids and out of the text unless
    include_stop_str_in_output; stop_reason is the id (None for the EOS proper, the first of
    the engine's eos_ids: vLLM treats generation_config.json's other EOS ids as stop ids);
  - stop strings are searched in the output text only, in the characters new this step (plus
    len(stop) - 1 before them), only once more than min_tokens tokens are out; the text is cut
    before the stop string (after it with include_stop_str_in_output), token_ids keep the token
    that completed it, finish_reason "stop", stop_reason the string, even when a stop token or
    the length limit ended the request at the same step;
  - while streaming, len(longest stop string) - 1 characters are held back (none with
    include_stop_str_in_output).
One deliberate difference is kept (minivllm's choice, documented in detokenizer.find_stop_string):
when one step completes several stop strings, the one that starts first wins (vLLM: the first in
the list).
"""

from __future__ import annotations

import json
import math

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

from minivllm import LLM, SamplingParams
from minivllm.runtime.config import EngineConfig
from minivllm.runtime.demo import _TEXT, build_tokenizer, ensure_demo_model
from minivllm.runtime.engine import _GOLDEN, LLMEngine
from minivllm.runtime.runner import StepResult, TokenLogprobs

from scripted_runner import Scripted, ScriptedAsync, lp_of

# -- tokenizers ------------------------------------------------------------------------------------


def build_byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (Llama's decoder: "▁" for spaces, <0xNN> byte-fallback tokens for
    characters outside its vocabulary, the leading space stripped) trained on ASCII text, so that
    every non-ASCII character is spelt as 2-4 byte tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    text = _TEXT.replace("\n", " ")
    alphabet = sorted(set(text.replace(" ", "▁")) | {"▁"})
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=150, special_tokens=specials, initial_alphabet=alphabet,
        limit_alphabet=len(alphabet), show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


BYTE_LEVEL = build_tokenizer()  # the demo model's byte-level BPE (Qwen's kind)
BYTE_FALLBACK = build_byte_fallback_tokenizer()
TOKENIZERS = {"byte_level": BYTE_LEVEL, "byte_fallback": BYTE_FALLBACK}


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_the_tokenizers_split_characters_into_bytes():
    """The premise of the multi-byte tests: a character spread over several tokens, each of
    which decodes alone to U+FFFD."""
    for tok in TOKENIZERS.values():
        ids = enc(tok, "€")
        assert len(ids) >= 3 and all("\ufffd" in tok.decode([i]) for i in ids[-3:])
        assert tok.decode(ids).strip() == "€"
    assert any(t.startswith("<0x") for t in BYTE_FALLBACK.convert_ids_to_tokens(enc(BYTE_FALLBACK, "日本")))


# -- a scripted engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config(demo_dir):
    return EngineConfig.create(demo_dir, device="cpu", num_kv_blocks=64, max_model_len=512,
                               attention_backend="reference", async_scheduling=True)


def make_engine(config, tok, scripts, async_scheduling: bool) -> LLMEngine:
    runner = (ScriptedAsync if async_scheduling else Scripted)(config, scripts)
    eng = LLMEngine(config, tok, runner=runner)
    assert eng.async_scheduling == async_scheduling
    return eng


def seeds(base: int, n: int) -> list[int]:
    """The sampler seeds of a request's n completions (LLMEngine.enqueue)."""
    return [base if i == 0 else (base + i * _GOLDEN) & ((1 << 64) - 1) for i in range(n)]


def complete(config, tok, prompt, outs: list[list[int]], params: SamplingParams, async_scheduling):
    """Run one request whose completion i samples outs[i]: (final RequestOutput, every output
    the engine returned for it, the engine)."""
    assert params.seed is not None and params.n == len(outs)
    scripts = dict(zip(seeds(params.seed, params.n), outs))
    eng = make_engine(config, tok, scripts, async_scheduling)
    rid = eng.add_request({"prompt_token_ids": prompt}, params)
    seen = []
    while eng.has_unfinished_requests():
        seen += [o for o in eng.step() if o.request_id == rid]
    assert seen and seen[-1].finished and not eng.requests
    return seen[-1], seen, eng


# -- the oracle ------------------------------------------------------------------------------------


def in_context_text(tok, prompt, out, skip_special_tokens=True) -> str:
    """What the output adds to the prompt's text: decode(prompt + out) minus decode(prompt), each
    cut back to its last complete character (a prompt ending mid-character has its character
    completed by the output)."""
    def decode(ids):
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def upto_complete(ids):  # the text at the last token boundary not inside a character
        for m in range(len(ids), -1, -1):
            if m == 0 or not (s := decode(ids[:m])).endswith("\ufffd"):
                return "" if m == 0 else s
    base = upto_complete(prompt)
    full = upto_complete(prompt + out)
    if len(full) < len(base):  # nothing complete since the prompt's last complete character
        full = base
    assert full.startswith(base), (base, full)
    return full[len(base):]


def oracle(tok, prompt, out, p: SamplingParams, eos_ids, max_model_len=math.inf):
    """vLLM's result for a completion that samples `out`: (token_ids, text, finish_reason,
    stop_reason); None if `out` runs out before the completion ends."""
    def text(k):
        return in_context_text(tok, prompt, out[:k], p.skip_special_tokens)

    max_tokens = p.max_tokens or math.inf
    for k in range(1, len(out) + 1):
        tok_id, finish, reason = out[k - 1], None, None
        if k >= p.min_tokens:  # (the sampler masked these ids before)
            if not p.ignore_eos and tok_id in eos_ids:  # the tokenizer's EOS gives no reason
                finish, reason = "stop", None if tok_id == tok.eos_token_id else tok_id
            elif tok_id in p.stop_ids:
                finish, reason = "stop", tok_id
        shown = text(k - 1) if finish == "stop" and not p.include_stop_str_in_output else text(k)
        if p.stop_strings and k > p.min_tokens:
            before = len(text(k - 1))
            hits = [(i, s) for s in p.stop_strings
                    if (i := shown.find(s, max(0, before + 1 - len(s)))) >= 0]
            if hits and len(shown) > before:
                at, s = min(hits, key=lambda h: h[0])  # min keeps list order among ties
                shown = shown[:at + len(s)] if p.include_stop_str_in_output else shown[:at]
                finish, reason = "stop", s
        if finish is None and (k >= max_tokens or len(prompt) + k >= max_model_len):
            finish = "length"
        if finish is not None:
            return out[:k], shown, finish, reason
    return None


def check(completion, expected, label=""):
    token_ids, text, finish, reason = expected
    got = (completion.token_ids, completion.text, completion.finish_reason, completion.stop_reason)
    assert got == (token_ids, text, finish, reason), label


def check_progress(seen, final):
    """Every output on the way is a prefix of the final one: nothing shown is taken back (no text
    that a stop string cuts, no U+FFFD that a later token turns into a character)."""
    for out in seen:
        for c, f in zip(out.outputs, final.outputs):
            assert f.text.startswith(c.text)
            assert f.token_ids[:len(c.token_ids)] == c.token_ids
            if c.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)


# -- scripts ---------------------------------------------------------------------------------------

MULTIBYTE = " one two STOP héllo €uro 日本語 😀 x. end, fin"
PROMPT = "Please stop here:"


def script(tok, text=MULTIBYTE):
    return enc(tok, text)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
def test_text_is_the_decode_of_the_tokens(config, tok_name, async_scheduling):
    """No stop: the final text is the tokenizer's decode of the output ids (the byte-level BPE's
    decode of the output alone; in context for the leading-space-stripping byte-fallback one), and
    every output on the way is a prefix of it, free of U+FFFD."""
    tok = TOKENIZERS[tok_name]
    prompt, out = enc(tok, PROMPT), script(tok)
    params = SamplingParams(seed=1, max_tokens=len(out), logprobs=1)
    final, seen, _ = complete(config, tok, prompt, [out], params, async_scheduling)
    c = final.outputs[0]
    assert c.token_ids == out and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == in_context_text(tok, prompt, out)
    if tok is BYTE_LEVEL:
        assert c.text == tok.decode(out, skip_special_tokens=True) == MULTIBYTE
    else:  # the output alone decodes with its leading space stripped; after the prompt, not
        assert c.text == tok.decode(prompt + out)[len(tok.decode(prompt)):]
        assert c.text == " " + tok.decode(out)
    check_progress(seen, final)
    assert not any("\ufffd" in o.outputs[0].text for o in seen)
    # Some steps show nothing new: a character is shown only once all its bytes are out.
    texts = [o.outputs[0].text for o in seen]
    assert len(set(texts)) < len(texts)
    assert [round(e[t].logprob, 6) for e, t in zip(c.logprobs, c.token_ids)] == \
        [round(lp_of(i), 6) for i in range(len(out))]
    assert c.cumulative_logprob == pytest.approx(sum(lp_of(i) for i in range(len(out))))


@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
def test_a_prompt_ending_inside_a_character(config, tok_name):
    """A prompt whose last tokens are the first bytes of a character: the output's first tokens
    complete it, and the output text starts with that whole character (vLLM's DecodeStream,
    primed with the prompt, does the same). It used to be dropped, with the text after it for
    byte-fallback tokens."""
    tok = TOKENIZERS[tok_name]
    full = enc(tok, "Hello € x yz w")
    euro = [i for i, t in enumerate(full) if "\ufffd" in tok.decode([t])]
    assert len(euro) == 3
    for cut in (euro[1], euro[2]):  # 1 or 2 of the character's 3 bytes in the prompt
        prompt, out = full[:cut], full[cut:]
        assert tok.decode(prompt).endswith("\ufffd")
        final, seen, _ = complete(config, tok, prompt, [out],
                                  SamplingParams(seed=3, max_tokens=len(out)), False)
        want = in_context_text(tok, prompt, out)
        assert want.startswith("€ x")
        assert final.outputs[0].text == want, cut
        check_progress(seen, final)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_output_ending_inside_a_character_leaves_it_out(config, async_scheduling):
    """max_tokens reached between a character's bytes: the text keeps the unfinished character
    out (vLLM never flushes it either), where tokenizer.decode shows U+FFFD."""
    tok = BYTE_LEVEL
    out = enc(tok, " ab €")[:-1]
    final, seen, _ = complete(config, tok, enc(tok, PROMPT), [out],
                              SamplingParams(seed=6, max_tokens=len(out)), async_scheduling)
    c = final.outputs[0]
    assert tok.decode(out) == " ab \ufffd"
    assert (c.text, c.token_ids, c.finish_reason) == (" ab ", out, "length")
    check_progress(seen, final)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
def test_special_tokens_in_the_output(config, tok_name, skip, spaces):
    """skip_special_tokens drops them from the text or keeps them; spaces_between_special_tokens
    changes nothing for these (fast) tokenizers, as in tokenizer.decode."""
    tok = TOKENIZERS[tok_name]
    bos = tok.convert_tokens_to_ids("<|im_start|>" if tok is BYTE_LEVEL else "<s>")
    out = enc(tok, " a b") + [bos, bos] + enc(tok, "é c") + [bos] + enc(tok, " d")
    prompt = enc(tok, PROMPT)
    params = SamplingParams(seed=4, max_tokens=len(out), skip_special_tokens=skip,
                            spaces_between_special_tokens=spaces)
    final, seen, _ = complete(config, tok, prompt, [out], params, False)
    c = final.outputs[0]
    assert c.text == in_context_text(tok, prompt, out, skip)
    ref = tok.decode(out, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    if tok is BYTE_LEVEL:
        assert c.text == ref
    assert (tok.convert_ids_to_tokens(bos) in c.text) == (not skip)
    check_progress(seen, final)


# Stop strings and ids, checked against the oracle on both tokenizers, with and without
# asynchronous scheduling. Each entry: SamplingParams keywords (the id lists by their text).
CASES = [
    dict(stop=["STOP"]),  # spans several tokens
    dict(stop=["STOP"], include_stop_str_in_output=True),
    dict(stop=["here", "stop ", ":"]),  # in the prompt only: never stops
    dict(stop=["here: one"]),  # spans the prompt and the output: never stops
    dict(stop=["two", "one t"]),  # several: the earliest completed wins
    dict(stop=["wo ST", "STOP"], include_stop_str_in_output=True),
    dict(stop=["é"]), dict(stop=["€u"]), dict(stop=["語 😀"]), dict(stop=["😀"], include_stop_str_in_output=True),
    dict(stop=["o €"]), dict(stop=["x."]), dict(stop=["fin"]),
    dict(stop=["one"], min_tokens=2), dict(stop=["one"], min_tokens=3),  # "one" ends at token 3
    dict(stop=["one", "two"], min_tokens=3),
    dict(stop=["n"], min_tokens=2),
    dict(stop=["STOP"], max_tokens=11), dict(stop=["STOP"], max_tokens=12),  # same step / before
    dict(stop_ids=[" two"]), dict(stop_ids=[" two"], include_stop_str_in_output=True),
    dict(stop_ids=[" two", " h"], min_tokens=5),
    dict(stop_ids=[" two"], stop=["two"], include_stop_str_in_output=True),  # both at one step
    dict(stop_ids=["EOS"]), dict(stop_ids=["EOS"], ignore_eos=True),
    dict(stop=["<|"], skip_special_tokens=False), dict(stop_ids=["EOS"], skip_special_tokens=False,
                                                       include_stop_str_in_output=True),
    dict(ignore_eos=True, max_tokens=40), dict(max_tokens=40),
    dict(stop_ids=["EOS"], max_tokens=7),  # EOS at the max_tokens step: "stop", as vLLM
    dict(stop=["end"], max_tokens=60),
]


def case_params(tok, kw, eos, seed=5):
    kw = dict(kw)
    ids = []
    for name in kw.pop("stop_ids", []):
        ids.append(eos if name == "EOS" else enc(tok, name)[-1])
    return SamplingParams(seed=seed, max_tokens=kw.pop("max_tokens", 200), stop_token_ids=ids or None,
                          logprobs=0, **kw)


def case_script(tok, eos):
    """MULTIBYTE with EOS after "x." (ignore_eos runs past it)."""
    head, tail = MULTIBYTE.split(" end")
    return enc(tok, head) + [eos] + enc(tok, " end" + tail)


def case_id(kw) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items())


def run_case(config, tok_name, kw, async_scheduling):
    tok = TOKENIZERS[tok_name]
    eos = tok.eos_token_id
    prompt = enc(tok, PROMPT)
    out = case_script(tok, eos) + [eos] * 4
    params = case_params(tok, kw, eos)
    eos_ids = make_engine(config, tok, {}, async_scheduling).eos_ids
    assert eos in eos_ids
    # The sampler bans these for the first min_tokens: the script must not need them there.
    assert not any(t in (*eos_ids, *params.stop_ids) for t in out[:params.min_tokens])
    final, seen, _ = complete(config, tok, prompt, [out], params, async_scheduling)
    return tok, prompt, out, params, eos_ids, final, seen


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
@pytest.mark.parametrize("kw", CASES, ids=case_id)
def test_stops_match_the_oracle(config, tok_name, kw, async_scheduling):
    """The final output: token_ids, text, finish_reason, stop_reason as the oracle says; one
    logprobs entry per token id, holding it."""
    tok, prompt, out, params, eos_ids, final, _ = run_case(config, tok_name, kw, async_scheduling)
    c = final.outputs[0]
    check(c, oracle(tok, prompt, out, params, eos_ids), kw)
    assert len(c.logprobs) == len(c.token_ids)
    assert all(t in e for e, t in zip(c.logprobs, c.token_ids))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
def test_unfinished_outputs_hold_back_what_a_stop_string_could_cut(config, tok_name, async_scheduling):
    """Each output the engine returns before a completion ends (cumulative, as vLLM's default
    RequestOutputKind.CUMULATIVE) shows the text of its tokens less len(longest stop) - 1
    characters (none with include_stop_str_in_output), so no text it shows is cut later. It
    used to show all of it (only LLM.stream held text back)."""
    for kw in CASES:
        tok, prompt, out, params, _, final, seen = run_case(config, tok_name, kw, async_scheduling)
        hold = (max(map(len, params.stop_strings)) - 1
                if params.stop_strings and not params.include_stop_str_in_output else 0)
        for o in seen:
            c = o.outputs[0]
            if not c.finished():
                text = in_context_text(tok, prompt, c.token_ids)
                assert c.text == text[:max(0, len(text) - hold)], kw
        check_progress(seen, final)


def test_the_oracle_cases_say_what_they_claim():
    """The CASES above test what their comments say (a guard on the oracle's inputs)."""
    tok, eos = BYTE_LEVEL, BYTE_LEVEL.eos_token_id
    prompt, out = enc(tok, PROMPT), case_script(tok, eos)
    eos_ids = (eos,)

    def run(kw):
        return oracle(tok, prompt, out, case_params(tok, kw, eos), eos_ids)
    assert run(dict(stop=["here", "stop ", ":"]))[2] == "stop"  # stopped by EOS, not a string
    assert run(dict(stop=["here", "stop ", ":"]))[3] is None
    assert run(dict(stop=["one"], min_tokens=2))[1:] == (" ", "stop", "one")
    assert run(dict(stop=["one"], min_tokens=3))[1].startswith(" one two STOP")
    assert run(dict(stop=["STOP"], max_tokens=11))[2:] == ("stop", "STOP")
    assert len(run(dict(stop=["STOP"], max_tokens=11))[0]) == 11
    assert run(dict(stop=["STOP"], max_tokens=10))[2] == "length"
    assert run(dict(stop_ids=[" two"], stop=["two"], include_stop_str_in_output=True))[1:] == \
        (" one two", "stop", "two")
    r = run(dict(stop_ids=["EOS"], max_tokens=len(out[:out.index(eos) + 1])))
    assert r[0][-1] == eos and r[2:] == ("stop", None)
    assert run(dict(stop=["two", "one t"]))[3] == "one t"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_completions_stop_independently(config, async_scheduling):
    tok = BYTE_LEVEL
    eos = tok.eos_token_id
    prompt = enc(tok, PROMPT)
    outs = [enc(tok, " alpha STOP beta") + [eos], enc(tok, " ab") + [eos] + enc(tok, " cd STOP"),
            enc(tok, " €€€ gamma delta epsilon"), enc(tok, " x STO") + [eos, eos]]
    stop_id = outs[2][12]
    assert all(stop_id not in o for o in (outs[0], outs[1], outs[3], outs[2][:12]))
    params = SamplingParams(n=4, seed=9, stop=["STOP"], stop_token_ids=[stop_id],
                            max_tokens=16, logprobs=2)
    final, seen, eng = complete(config, tok, prompt, [o + [eos] * 3 for o in outs], params,
                                async_scheduling)
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    for c, out in zip(final.outputs, outs):
        check(c, oracle(tok, prompt, out, params, eng.eos_ids))
        assert len(c.logprobs) == len(c.token_ids)
        assert [round(e[t].logprob, 6) for e, t in zip(c.logprobs, c.token_ids)] == \
            [round(lp_of(i), 6) for i in range(len(c.token_ids))]
    assert [c.finish_reason for c in final.outputs] == ["stop"] * 4
    assert [c.stop_reason for c in final.outputs] == ["STOP", None, stop_id, None]


def test_min_tokens_masks_eos_and_stop_ids(config):
    """The sampler is told to ban EOS and the stop ids for the first min_tokens tokens (EOS with
    ignore_eos too, as vLLM's min_tokens processor bans its all_stop_token_ids, which always hold
    EOS), and nothing after."""
    tok = BYTE_LEVEL
    eos = tok.eos_token_id
    stop_id = enc(tok, " two")[-1]
    out = enc(tok, " a b c d e f")
    for ignore_eos in (False, True):
        params = SamplingParams(seed=11, min_tokens=3, max_tokens=len(out), ignore_eos=ignore_eos,
                                stop_token_ids=[stop_id])
        final, _, eng = complete(config, tok, enc(tok, PROMPT), [out], params, False)
        banned = {step: set(b) for (_, step), b in eng.runner.banned.items()}
        want = {stop_id} | set(eng.eos_ids)
        assert banned == {s: (want if s < 3 else set()) for s in range(len(out))}


def test_stop_strings_completed_at_one_place_resolve_to_the_first_listed():
    """Where two stop strings start at the same place, the list's order decides (as vLLM's)."""
    from minivllm.runtime.detokenizer import find_stop_string

    assert find_stop_string("xabc", 3, ("ab", "abc")) == (1, "ab")
    assert find_stop_string("xabc", 3, ("abc", "ab")) == (1, "abc")


def test_stop_strings_need_detokenize():
    """As vLLM's SamplingParams: stop strings with detokenize=False are refused."""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_detokenize_false_gives_ids_without_text(config):
    tok = BYTE_LEVEL
    eos = tok.eos_token_id
    out = enc(tok, " some text") + [eos]
    params = SamplingParams(seed=2, detokenize=False, stop_token_ids=[enc(tok, " text")[-1]])
    final, _, _ = complete(config, tok, enc(tok, PROMPT), [out], params, False)
    c = final.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("", out[:-1], "stop")


# -- streaming through LLM.stream ------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_llm(demo_dir):
    return LLM(demo_dir, device="cpu", attention_backend="reference", num_kv_blocks=64,
               max_model_len=512)


@pytest.fixture
def llm(demo_llm):
    """The demo LLM; a test may replace its engine by a scripted one."""
    engine = demo_llm.engine
    yield demo_llm
    demo_llm.engine = engine


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streaming_holds_back_what_a_stop_string_could_cut(llm, config, async_scheduling):
    """LLM.stream: the pieces concatenate to the final text; unfinished, each completion shows
    at most its text less len(longest stop) - 1 characters (vLLM's stop_buffer_length; none
    with include_stop_str_in_output, whose cut never reaches back into shown text), so nothing
    streamed is ever cut; no piece holds an unfinished character."""
    tok = BYTE_LEVEL
    eos = tok.eos_token_id
    prompt = enc(tok, PROMPT)
    outs = [script(tok) + [eos], enc(tok, " wait for it: STOPPED é") + [eos]]
    for kw in (dict(stop=["STOP", "€uro"]), dict(stop=["x. e"], include_stop_str_in_output=True),
               dict(stop=["fin"]), dict()):
        params = SamplingParams(n=2, seed=13, max_tokens=60, **kw)
        scripts = dict(zip(seeds(13, 2), [o + [eos] * 3 for o in outs]))
        llm.engine = make_engine(config, tok, scripts, async_scheduling)
        deltas = list(llm.stream({"prompt_token_ids": prompt}, params))
        hold = (0 if params.include_stop_str_in_output  # vLLM holds nothing back then
                else max(map(len, params.stop_strings), default=1) - 1)
        for i, out in enumerate(outs):
            want = oracle(tok, prompt, out, params, llm.engine.eos_ids)
            pieces = [(c.text, c.token_ids, c.finished()) for d in deltas for c in d.outputs
                      if c.index == i]
            assert "".join(p[0] for p in pieces) == want[1], kw
            assert sum((p[1] for p in pieces), []) == want[0]
            assert [p[2] for p in pieces].count(True) == 1 and pieces[-1][2]
            assert not any("\ufffd" in p[0] for p in pieces)
            # Held back: what was shown before the end leaves room for a stop string.
            shown = num_ids = 0
            for text, ids, finished in pieces:
                shown, num_ids = shown + len(text), num_ids + len(ids)
                if not finished:
                    assert shown <= max(0, len(in_context_text(tok, prompt, out[:num_ids])) - hold)
        assert deltas[-1].finished


# -- the demo model itself -------------------------------------------------------------------------


def test_real_engine_matches_the_oracle(llm):
    """The demo model, seeded sampling, n=2: a run with stop strings and stop ids taken from an
    unstopped run's own outputs matches the oracle applied to that run's tokens (seeded samples
    do not depend on the batch or on stops)."""
    tok = llm.get_tokenizer()
    prompt = "Hello, my name is"
    free = SamplingParams(n=2, seed=21, temperature=1.0, max_tokens=20, ignore_eos=True)
    full = llm.generate(prompt, free, use_tqdm=False)[0]
    outs = [c.token_ids for c in full.outputs]
    prompt_ids = full.prompt_token_ids
    for c in full.outputs:
        assert c.text == in_context_text(tok, prompt_ids, c.token_ids)
        if not tok.decode(c.token_ids).endswith("\ufffd"):
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    texts = [c.text for c in full.outputs]
    stops = [t[len(t) // 2:len(t) // 2 + 3] for t in texts if len(t) > 8][:2]
    stop_ids = [outs[1][len(outs[1]) // 3]]
    params = SamplingParams(n=2, seed=21, temperature=1.0, max_tokens=20, ignore_eos=True,
                            stop=stops, stop_token_ids=stop_ids, logprobs=1)
    for stream in (False, True):
        if stream:
            got: dict[int, list] = {}
            for d in llm.stream(prompt, params):
                for c in d.outputs:
                    g = got.setdefault(c.index, ["", [], None, None])
                    g[0] += c.text
                    g[1] += c.token_ids
                    g[2], g[3] = c.finish_reason, c.stop_reason
            results = [(got[i][1], got[i][0], got[i][2], got[i][3]) for i in range(2)]
        else:
            cut = llm.generate(prompt, params, use_tqdm=False)[0]
            results = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in cut.outputs]
            for c in cut.outputs:
                assert len(c.logprobs) == len(c.token_ids)
        for r, out in zip(results, outs):
            assert r == oracle(tok, prompt_ids, out, params, llm.engine.eos_ids)
        assert {r[3] for r in results} & {*stops, *stop_ids}  # something did stop


# -- logprobs entries --------------------------------------------------------------------------------


class TiedLogprobs(Scripted):
    """Scripted tokens whose logprobs tie the sampled id with another at the top: `top` lists the
    top-2 ids in the sampler's order, the sampled id's rank is 2 (vLLM v1's count of ids with a
    logprob >= its own)."""

    def __init__(self, config, scripts, other: int, sampled_first: bool):
        super().__init__(config, scripts)
        self.other, self.sampled_first = other, sampled_first

    def execute(self, step):
        result = super().execute(step)
        lps = []
        for t in result.token_ids:
            top = [t, self.other] if self.sampled_first else [self.other, t]
            lps.append(TokenLogprobs(-0.7, 2, top, [-0.7, -0.7]))
        return StepResult(result.token_ids, lps)


@pytest.mark.parametrize("sampled_first", [True, False])
def test_a_logprobs_entry_is_vllms_sampled_id_first_top_ranks_by_position(config, sampled_first):
    """vLLM's entry: {sampled: its rank} then the top N with ranks 1..N by position, which win for
    the sampled id when it is among them."""
    tok = BYTE_LEVEL
    out = enc(tok, " one two")
    other = enc(tok, "x")[0]
    eng = LLMEngine(config, tok, runner=TiedLogprobs(config, {5: out}, other, sampled_first))
    eng.add_request({"prompt_token_ids": enc(tok, PROMPT)},
                    SamplingParams(seed=5, max_tokens=len(out), logprobs=2, ignore_eos=True))
    final = None
    while eng.has_unfinished_requests():
        final = (eng.step() or [final])[-1]
    entries = final.outputs[0].logprobs
    assert len(entries) == len(out)
    for t, entry in zip(out, entries):
        assert list(entry) == [t, other]  # the sampled id first
        assert entry[t].rank == (1 if sampled_first else 2) and entry[other].rank == (2 if sampled_first else 1)
        assert entry[t].decoded_token == tok.decode([t])
