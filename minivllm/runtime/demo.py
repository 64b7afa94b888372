"""The built-in demo model: a tiny Qwen3 checkpoint with RANDOM weights and a small byte-level BPE
tokenizer trained in-process on a built-in text, written once to a cache directory.

It exists so that `minivllm generate --demo` runs end to end on a fresh machine with no
download. Its output is meaningless text: the weights are random.
"""

from __future__ import annotations

import os
import shutil
import tempfile

DEMO_VERSION = "v1"
NOTICE = ("minivllm demo model: a tiny Qwen3 with RANDOM weights and a toy tokenizer, built "
          "in-process. Its output is meaningless text; pass --model DIR for a real checkpoint.")

# The tokenizer's training text (any text will do: it only shapes the BPE merges).
_TEXT = """\
minivllm is a small, fast inference engine for language models. It keeps the key and value
cache in fixed-size blocks, schedules many requests at once, shares blocks between prompts that
begin the same way, and splits long prompts into chunks so that decoding never waits for long.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. To be, or not to be, that is the question. All happy families are alike; each unhappy
family is unhappy in its own way. It was the best of times, it was the worst of times.
Hello, my name is Ada. The capital of France is Paris. The future of AI is open. What is the
weather like today? Tell me a story about a robot who learns to paint. Once upon a time there
was a little model that could only speak nonsense, because nobody had trained it yet.
User: how are you? Assistant: I am fine, thank you. System: you are a helpful assistant.
0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } < > " ' : ; , . ! ? # @ & % $
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Model shape: small enough to build and run in a second on a CPU.
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
VOCAB_SIZE = 512


def default_demo_dir() -> str:
    """$MINIVLLM_DEMO_DIR, else <cache>/minivllm/demo-<version> with <cache> $XDG_CACHE_HOME or
    ~/.cache."""
    if os.environ.get("MINIVLLM_DEMO_DIR"):
        return os.environ["MINIVLLM_DEMO_DIR"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "minivllm", f"demo-{DEMO_VERSION}")


def build_tokenizer():
    """A byte-level BPE tokenizer (transformers PreTrainedTokenizerFast) trained on _TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"],
                                   chat_template=CHAT_TEMPLATE)


def build_demo_model(path: str, seed: int = 0) -> str:
    """Write the demo checkpoint (config, safetensors, tokenizer) to `path`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=eos,
                         pad_token_id=tokenizer.pad_token_id, **MODEL_SHAPE)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    demo_weights_(model, tokenizer, eos)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-second build needs no "Writing model shards" bar
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(NOTICE + "\n")
    return path


def demo_weights_(model, tokenizer, eos: int) -> None:
    """Fill a transformers Qwen3 model in place with the demo's random weights (from torch's
    global generator): large enough that the next-token distribution is peaked, not uniform,
    and steered to printable tokens (_prefer_printable)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        _prefer_printable(model, tokenizer, eos)


def _prefer_printable(model, tokenizer, eos: int) -> None:
    """Random weights pick stray UTF-8 bytes and control characters as often as words; steer the
    model to printable tokens instead. Hidden dimension 0 of the residual stream is made a
    constant (every embedding has it at 1, no layer writes to it), so after the final norm it is
    a positive per-position scalar, and the head's column 0 turns it into a per-token bias:
    printable tokens up, the rest down, EOS in between so that outputs sometimes end."""
    emb = model.model.embed_tokens.weight  # [V, H]
    emb[:, 0] = 4.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0, :] = 0.0  # [H, heads * D]: row 0 writes dimension 0
        layer.mlp.down_proj.weight[0, :] = 0.0
    special = set(tokenizer.all_special_ids)
    bias = []
    for i in range(emb.shape[0]):
        text = tokenizer.decode([i])
        ok = (i not in special and text != "" and "\ufffd" not in text
              and all(c.isprintable() or c == " " for c in text))
        bias.append(2.0 if ok else -2.0)
    head = model.lm_head.weight  # [V, H]
    head[:, 0] = head.new_tensor(bias)
    head[eos, 0] = 2.8  # about one EOS per 150 tokens


def ensure_demo_model(path: str | None = None) -> str:
    """The demo checkpoint's directory, building it first if it is not there yet. Built in a
    temporary directory and renamed into place, so concurrent callers never see half of it."""
    path = path or default_demo_dir()
    if os.path.isfile(os.path.join(path, "README.md")):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=parent)
    try:
        build_demo_model(tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.isfile(os.path.join(path, "README.md")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path
