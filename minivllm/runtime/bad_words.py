"""bad_words (vLLM's): words a request must not generate, as token-id sequences. The last id of
a word is banned whenever the output so far ends with the word's other ids."""

from __future__ import annotations


def bad_word_ids(words: tuple[str, ...], tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each word as vLLM tokenizes it: as written (leading spaces stripped), and again after a
    space where that gives a different first token in as many tokens (the word inside a
    sentence, for tokenizers that fold the space into the token)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def banned_by_bad_words(words: tuple[tuple[int, ...], ...], output_ids: list[int]
                        ) -> tuple[int, ...]:
    """The ids the next token must not be: each word's last id where the output (generated ids
    only, as vLLM) ends with the word's other ids."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= len(output_ids) and \
                (not prefix or tuple(output_ids[len(output_ids) - len(prefix):]) == prefix):
            banned.append(word[-1])
    return tuple(banned)
