"""Incremental detokenization and stop strings, as functions of what they read.

Decoding a growing sequence from scratch every step costs O(length) per token; instead each step
decodes a short window: the text of ids[prefix_offset:] minus the text of
ids[prefix_offset:read_offset]. The window starts a few tokens before the new ones so that
tokenizers that drop or merge leading spaces decode the new tokens in context, and it does not
advance while the text ends in an incomplete UTF-8 character (U+FFFD), which a later byte-level
token will complete.

The window starts in the prompt (prompt_offsets): at its last complete character, so that an
output whose first tokens complete a character the prompt began shows that character (as vLLM's
DecodeStream, primed with the prompt, does) instead of dropping it.
"""

from __future__ import annotations


# How far before its 5 tokens of context prompt_offsets looks for a character's start.
_LOOK_BACK = 8


def _decode_kwargs(tokenizer, skip_special_tokens: bool,
                   spaces_between_special_tokens: bool) -> dict:
    """tokenizer.decode's keywords (spaces_between_special_tokens only when off: fast tokenizers
    take no such argument otherwise). A tokenizer that cleans up tokenization spaces (" ." to
    ".", " 's" to "'s": tokenizer_config.json's clean_up_tokenization_spaces) is told not to:
    vLLM's detokenizers (DecodeStream, convert_tokens_to_string) never do, and a window whose
    text the clean-up shortens (" it '" then " it 's" to " it's") reads as no new text, so the
    token's characters were lost."""
    kwargs = dict(skip_special_tokens=skip_special_tokens)
    if not spaces_between_special_tokens:
        kwargs["spaces_between_special_tokens"] = False
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        kwargs["clean_up_tokenization_spaces"] = False
    return kwargs


def detokenize_incrementally(tokenizer, ids: list[int], prefix_offset: int, read_offset: int, *,
                             skip_special_tokens: bool = True,
                             spaces_between_special_tokens: bool = True,
                             end: int | None = None) -> tuple[str, int, int]:
    """-> (new text, new prefix_offset, new read_offset) after ids[read_offset:end] were added
    (end: default all of ids; what follows it is not known yet)."""
    end = len(ids) if end is None else end
    kwargs = _decode_kwargs(tokenizer, skip_special_tokens, spaces_between_special_tokens)
    prefix_text = tokenizer.decode(ids[prefix_offset:read_offset], **kwargs)
    text = tokenizer.decode(ids[prefix_offset:end], **kwargs)
    if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
        return text[len(prefix_text):], read_offset, end
    return "", prefix_offset, read_offset


def prompt_offsets(tokenizer, ids: list[int], prompt_len: int, *, skip_special_tokens: bool = True,
                   spaces_between_special_tokens: bool = True) -> tuple[int, int]:
    """The (prefix_offset, read_offset) to start detokenizing the output at: read_offset is the
    prompt's end, or, when the prompt ends inside a character (its text ends in U+FFFD), the
    token boundary before that character, so that the output's text starts with the whole
    character once a generated token completes it. prefix_offset is 5 tokens before it, or
    where the character there starts (its text does not start with U+FFFD, as vLLM primes its
    DecodeStream with a prompt suffix whose text holds none): a byte-fallback tokenizer decodes a
    run of byte tokens that is not valid UTF-8 as a whole to U+FFFD throughout, so a window
    starting inside a character of such a run took a whole last character for an unfinished
    one (the output's text began with it again) and the output's bytes that continue the run
    for U+FFFD. Looks back a few tokens only (a character is at most 4 bytes); a prompt ending
    in more invalid bytes than that keeps its end."""
    kwargs = _decode_kwargs(tokenizer, skip_special_tokens, spaces_between_special_tokens)
    lowest = max(prompt_len - 4, 0)
    for read in range(prompt_len, lowest - 1, -1):
        if read == 0:
            return 0, 0
        prefix = max(read - 5, 0)
        text = tokenizer.decode(ids[prefix:read], **kwargs)
        for start in range(prefix - 1, max(prefix - _LOOK_BACK, 0) - 1, -1):
            if not text.startswith("\ufffd"):
                break
            window = tokenizer.decode(ids[start:read], **kwargs)
            if not window.startswith("\ufffd"):
                prefix, text = start, window
        if not text.endswith("\ufffd"):
            return prefix, read
    return max(prompt_len - 5, 0), prompt_len


def find_stop_string(text: str, num_new_chars: int, stops: tuple[str, ...]
                     ) -> tuple[int, str] | None:
    """The earliest stop string that the last `num_new_chars` characters of `text` complete:
    (its start index, the string), or None. Only the tail is searched: earlier text was searched
    when it was new."""
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
