"""What a structured output's masks cost the host at a Qwen3-sized vocabulary, on this CPU.

    PYTHONPATH=. python benchmarks/guide_mask_cost.py [--vocab 151000] [--json PATH]

A guided sequence's allowed ids at a state of its constraint are computed the first time any
sequence reaches that state (runtime/guide.py, CompiledGuide.bits), on the engine's thread, so
the whole batch waits for it. No Qwen3 tokenizer can be downloaded here, so this builds a
byte-level vocabulary of that size (GPT-2's alphabet, as Qwen's): the 256 bytes, then words with
and without a leading space, capitalized words, numbers, punctuation runs, CJK runs (~8,000
distinct characters) and runs of spaces up to 64. It times, for a JSON schema (a string with a
maxLength, an integer, an array of strings), json_object and the regex [a-z ]{5,40}: the first
visit of one state of each kind (the median of 5 fresh guides), and the masks of every state a
typical output walks through, one character at a time; then a step's sampling batch of 64 rows,
16 of them guided (8 in the regex's state, whose mask bans ids, 8 in the integer's, whose mask
allows them), as the engine built it every step until session 63 (the masks as id lists) and
as it builds it since (packed bitmasks, CompiledGuide.bits). Session 62 (BENCHMARKS.md)
measured these before and after the guide walked the whole vocabulary at once and the batch's
pairs were filled in C.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from minivllm.functional.sampling import SamplingRow, make_sampling_batch
from minivllm.runtime.guide import JSON_OBJECT, CompiledGuide, TokenIndex, schema_regex

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
OUTPUT = '{"name": "john smith", "age": 42, "tags": ["a b", "cd"]}'


def gpt2_alphabet() -> dict[int, str]:
    """Byte -> the character a byte-level BPE vocabulary writes it as (GPT-2's, Qwen's)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
             *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in shown:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class SyntheticByteLevelTokenizer:
    """What TokenIndex reads of a byte-level BPE tokenizer, over the given tokens' bytes."""

    class _Decoder:
        def __repr__(self):
            return "ByteLevel()"

    def __init__(self, tokens: list[bytes]):
        alphabet = gpt2_alphabet()
        self.pieces = ["".join(alphabet[b] for b in t) for t in tokens]
        self.all_special_ids: list[int] = []
        self.backend_tokenizer = type("Backend", (), {"decoder": self._Decoder()})()

    def __len__(self):
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


def synthetic_vocabulary(size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 8000)]
    words: set[bytes] = set()
    while len(words) < size - 256:
        r, w = rng.random(), "".join(rng.choice(letters) for _ in range(rng.randint(1, 9)))
        if r < 0.50:
            t = " " + w
        elif r < 0.68:
            t = w
        elif r < 0.76:
            t = " " + w.capitalize()
        elif r < 0.80:
            t = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        elif r < 0.85:
            t = "".join(rng.choice("{}[]():;,.\"'-_=+*/\\<>!?#") for _ in range(rng.randint(1, 3)))
        elif r < 0.97:
            t = "".join(rng.choice(cjk) for _ in range(rng.randint(1, 3)))
        else:
            t = " " * rng.randint(2, 64)
        if len(t.encode()) > 1:  # the single bytes come first, once
            words.add(t.encode())
    return [bytes([b]) for b in range(256)] + sorted(words)


def first_visit_ms(key, index, eos, vocab_size: int, prefix: str, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        guide = CompiledGuide(key, index, eos)
        guide.bits(guide.start, vocab_size)
        state = guide.walk(guide.start, prefix.encode())
        start = time.perf_counter()
        guide.bits(state, vocab_size)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def walk_ms(key, index, eos, vocab_size: int, text: str) -> tuple[float, float]:
    """(ms of all masks, the slowest one's ms) along `text`, one character a step."""
    guide = CompiledGuide(key, index, eos)
    state, times = guide.start, []
    for ch in text:
        start = time.perf_counter()
        guide.bits(state, vocab_size)
        times.append(time.perf_counter() - start)
        state = guide.walk(state, ch.encode())
    return 1e3 * sum(times), 1e3 * max(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tokens = synthetic_vocabulary(args.vocab)
    start = time.perf_counter()
    index = TokenIndex(SyntheticByteLevelTokenizer(tokens), len(tokens))
    chars = {c for t in index.text.values() for c in t}
    print(f"vocabulary of {len(tokens)} ids, {len(chars)} distinct characters: "
          f"indexed in {time.perf_counter() - start:.2f} s")
    vocab_size = len(tokens) + 10
    eos = (vocab_size - 1,)
    schema = ("regex", schema_regex(SCHEMA))
    regex = ("regex", "[a-z ]{5,40}")
    result = {"vocab": len(tokens), "first_visit_ms": {}, "walk_ms": {}}
    for label, key, prefix in [("a JSON string (schema)", schema, '{"name": "jo'),
                               ("a JSON string (json_object)", JSON_OBJECT, '{"name": "jo'),
                               ("an integer (schema)", schema, '{"name": "x", "age": 4'),
                               ("[a-z ]{5,40} after 7", regex, "abcdefg")]:
        ms = result["first_visit_ms"][label] = first_visit_ms(key, index, eos, vocab_size, prefix)
        print(f"first visit of {label}: {ms:.1f} ms")
    for label, key, text in [("schema", schema, OUTPUT), ("json_object", JSON_OBJECT, OUTPUT),
                             ("[a-z ]{5,40}", regex, "hello there world")]:
        total, slowest = walk_ms(key, index, eos, vocab_size, text)
        result["walk_ms"][label] = {"states": len(text), "total": total, "slowest": slowest}
        print(f"{label}: the masks of {len(text)} states {total:.0f} ms, the slowest {slowest:.1f}")
    banning = CompiledGuide(regex, index, eos)
    banned = banning.mask(banning.walk(banning.start, b"abcdefg"), vocab_size)[1]
    allowing = CompiledGuide(schema, index, eos)
    allowed = allowing.mask(allowing.walk(allowing.start, b'{"name": "x", "age": 4'),
                            vocab_size)[0]
    banning_bits = banning.bits(banning.walk(banning.start, b"abcdefg"), vocab_size)
    allowing_bits = allowing.bits(allowing.walk(allowing.start, b'{"name": "x", "age": 4'),
                                  vocab_size)
    forms = {"ids": ([dict(banned_ids=banned)] * 8 + [dict(allowed_ids=allowed)] * 8),
             "bits": ([dict(allowed_bits=banning_bits)] * 8 + [dict(allowed_bits=allowing_bits)]
                      * 8)}
    for form, guided in forms.items():
        rows = ([SamplingRow(temperature=0.7, seed=i, **kw) for i, kw in enumerate(guided)]
                + [SamplingRow(temperature=0.7, seed=i) for i in range(48)])
        times = []
        for _ in range(7):
            start = time.perf_counter()
            make_sampling_batch(rows, vocab_size=vocab_size)
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        if form == "ids":
            result["sampling_batch_ms"] = ms
        else:
            result["sampling_batch_bits_ms"] = ms
        print(f"a sampling batch of 64 rows, 8 banning {len(banned)} ids and 8 allowing "
              f"{len(allowed)}, as {form}: {ms:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
