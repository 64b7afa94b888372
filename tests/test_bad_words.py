"""SamplingParams.bad_words (vLLM's): a word's last token is banned wherever the output ends
with the word's other tokens, so the output never holds a bad word's tokens; checked on the demo
model's byte-level BPE tokenizer against greedy decoding without them."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.runtime.bad_words import bad_word_ids, banned_by_bad_words
from minivllm.runtime.demo import ensure_demo_model

from engine_helpers import make_llm

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="module")
def llm(demo_dir, device):
    return make_llm(demo_dir, device)


def holds(ids, word):
    return any(tuple(ids[i:i + len(word)]) == word for i in range(len(ids) - len(word) + 1))


def test_bans_follow_the_output_tail():
    words = ((7,), (3, 4), (1, 2, 5))
    assert banned_by_bad_words(words, []) == (7,)
    assert banned_by_bad_words(words, [9, 3]) == (7, 4)
    assert banned_by_bad_words(words, [1, 2]) == (7, 5)
    assert banned_by_bad_words(words, [2]) == (7,)  # the prefix must be whole
    assert banned_by_bad_words(words, [9, 2]) == (7,)
    assert banned_by_bad_words(words, [4, 1, 2]) == (7, 5)
    assert banned_by_bad_words(words, [1, 2, 3]) == (7, 4)


def test_words_are_tokenized_as_vllm_does(llm):
    tok = llm.get_tokenizer()
    ids = bad_word_ids(("fox", " quick brown"), tok)
    bare = tuple(tok.encode("fox", add_special_tokens=False))
    spaced = tuple(tok.encode(" fox", add_special_tokens=False))
    want = [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])
    bare2 = tuple(tok.encode("quick brown", add_special_tokens=False))
    spaced2 = tuple(tok.encode(" quick brown", add_special_tokens=False))
    want += [bare2] + ([spaced2] if spaced2[0] != bare2[0] and len(spaced2) == len(bare2) else [])
    assert ids == tuple(want)


def test_greedy_output_steers_around_a_bad_word(llm):
    """The greedy output without bad words, and with a word made of two of its own tokens: the
    same up to the word's first token, then another token where the word would complete."""
    tok = llm.get_tokenizer()
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = llm.generate([PROMPT], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    for k in range(len(free) - 1):
        text = tok.decode(free[k:k + 2])
        if text.strip() and bad_word_ids((text,), tok)[0] == tuple(free[k:k + 2]) and \
                not holds(free[:k + 1], tuple(free[k:k + 2])):
            break
    else:
        pytest.skip("no two-token stretch of the output tokenizes back to itself")
    out = llm.generate([PROMPT], SamplingParams(bad_words=[text], **greedy),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out[:k + 1] == free[:k + 1] and out[k + 1] != free[k + 1]
    for word in bad_word_ids((text,), tok):
        assert not holds(out, word)
    # A one-token word never appears; sampling too.
    single = tok.decode(free[:1])
    words = bad_word_ids((single,), tok)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True,
                             bad_words=single)
    for params in (SamplingParams(bad_words=[single], **greedy), sampled):
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        assert not any(holds(out, w) for w in words)


def test_a_request_whose_bad_words_ban_every_allowed_id_is_refused(llm):
    tok = llm.get_tokenizer()
    allowed = bad_word_ids(("the",), tok)[0] + bad_word_ids(("is",), tok)[0]
    assert len(allowed) == 2  # one token each in the demo tokenizer
    with pytest.raises(ValueError, match="bad_words ban every id this request may sample"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=list(allowed),
                                              bad_words=["the", "is"]), use_tqdm=False)
    # One of them left: the output is that id throughout.
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, allowed_token_ids=list(allowed),
                                                bad_words=["the"]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [allowed[1]] * 3


def test_bad_words_need_a_tokenizer(tmp_path, device):
    from hf_tiny import make_hf_model, save_checkpoint

    llm = make_llm(save_checkpoint(make_hf_model(), tmp_path / "m"), device)
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(bad_words=["x"]),
                     use_tqdm=False)


@pytest.mark.parametrize("words", [[""], ["  "], [3], "", 5, [None]])
def test_bad_values_are_refused(words):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=words)


def test_words_are_tokenized_once_however_many_requests_share_them(llm, monkeypatch):
    """A request's bad words are read when it is checked and when it is queued; requests that
    share a list (here 3 prompts, n=2, then the same list again) tokenize it once: each word
    bare and after a space (bad_word_ids), with the ids bad_word_ids gives."""
    tok = llm.get_tokenizer()
    words = ["lazy dog", "jumps"]  # no other test's: the engine's cache has not seen them
    forms = {w for word in words for w in (word, " " + word)}
    calls = []
    encode = tok.encode

    def counting(text, *args, **kwargs):
        if text in forms:
            calls.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", counting)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2, bad_words=words)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sorted(calls) == sorted(forms)
    llm.generate(prompts[:1], params, use_tqdm=False)
    assert sorted(calls) == sorted(forms)
    monkeypatch.undo()
    banned = bad_word_ids(tuple(words), tok)
    for seq in (c.token_ids for out in outs for c in out.outputs):
        assert not any(holds(seq, w) for w in banned)
