"""A briefly trained Qwen3 checkpoint, for agreement checks that random weights cannot give.

Random weights (transformers' init, std 0.02) give nearly flat next-token distributions: the
top-2 margin of most positions is within bf16's rounding of the logits, so even transformers in
bf16 picks another arg-max than its own fp32 on 2-5% of positions (BENCHMARKS.md: issue 2, and
session 23 under "Engine speed").
No trained Qwen3 checkpoint can be downloaded here, so this trains one: a transformers
Qwen3ForCausalLM of the requested shape learns a synthetic language for a few hundred steps,
after which its predictions are decided by what it learned, as a trained model's are.

The language is a second-order Markov chain over `states` token ids drawn from the vocabulary:
the next token is one of `len(probs)` successors with probabilities `probs` (0.7 the most likely
by default, a top-2 log-odds of ~1.5 nats once learned), and which successors depends on the
current token and on the class (index mod `classes`) of the token before it, so that predicting
it needs attention to the previous position, not only the current token's embedding. Held-out
sequences drawn from it are the teacher-forced inputs.

    python benchmarks/synthetic_lm.py --shape qwen3-0.6b --out /tmp/trained
    python benchmarks/agreement.py --checkpoint /tmp/trained --positions 512
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

import torch

from minivllm.state import SHAPES

LANGUAGE_FILE = "synthetic_language.pt"
PROBS = (0.7, 0.15, 0.1, 0.05)
CLASSES = 2


@dataclass(frozen=True)
class MarkovLanguage:
    tokens: torch.Tensor  # [states] the vocabulary ids the language uses, distinct
    # [states, classes, branches]: the states that may follow (state, class of the state before)
    successors: torch.Tensor
    probs: torch.Tensor  # [branches] fp64, sums to 1: the chance of each successor column

    def entropy(self) -> float:
        """Nats a token: the loss a model that learned the chain exactly reaches."""
        return float(-(self.probs * self.probs.log()).sum())

    def save(self, path: str) -> None:
        torch.save({"tokens": self.tokens, "successors": self.successors, "probs": self.probs}, path)

    @staticmethod
    def load(path: str) -> "MarkovLanguage":
        d = torch.load(path)
        return MarkovLanguage(d["tokens"], d["successors"], d["probs"])


def make_language(vocab_size: int, states: int, seed: int, probs: tuple[float, ...] = PROBS,
                  classes: int = CLASSES) -> MarkovLanguage:
    """A chain over `states` distinct ids of [0, vocab_size); each (state, class) pair's
    successors are distinct states, so the most likely next token is unique."""
    if not 2 <= states <= vocab_size:
        raise ValueError(f"states must be in [2, vocab_size={vocab_size}], got {states}")
    if not len(probs) <= states or abs(sum(probs) - 1) > 1e-9 or min(probs) <= 0:
        raise ValueError(f"probs must be positive, sum to 1 and be at most `states` many: {probs}")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(vocab_size, generator=g)[:states]
    if not 1 <= classes <= states:
        raise ValueError(f"classes must be in [1, states={states}], got {classes}")
    successors = torch.stack([torch.randperm(states, generator=g)[:len(probs)]
                              for _ in range(states * classes)]).view(states, classes, len(probs))
    return MarkovLanguage(tokens, successors, torch.tensor(probs, dtype=torch.float64))


def sample(lang: MarkovLanguage, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids [batch, length]: a uniform first state, then the chain (the first state's
    predecessor counts as class 0)."""
    classes = lang.successors.shape[1]
    state = torch.randint(0, len(lang.tokens), (batch,), generator=generator)
    before = torch.zeros_like(state)
    states = [state]
    for _ in range(length - 1):
        branch = torch.multinomial(lang.probs, batch, replacement=True, generator=generator)
        state, before = lang.successors[state, before % classes, branch], state
        states.append(state)
    return lang.tokens[torch.stack(states, dim=1)]


def most_likely_next(lang: MarkovLanguage, ids: torch.Tensor) -> torch.Tensor:
    """ids: [n], a sequence of the language's tokens from its start -> [n], the chain's arg-max
    successor at each position."""
    index = torch.full((int(lang.tokens.max()) + 1,), -1, dtype=torch.long)
    index[lang.tokens] = torch.arange(len(lang.tokens))
    state = index[ids]
    if (state < 0).any():
        raise ValueError("ids holds tokens the language does not use")
    before = torch.cat([state.new_zeros(1), state[:-1]])
    classes = lang.successors.shape[1]
    return lang.tokens[lang.successors[state, before % classes, int(lang.probs.argmax())]]


def train(model, lang: MarkovLanguage, *, steps: int, batch: int, length: int, lr: float,
          seed: int, log_every: int = 50) -> list[float]:
    """Train `model` (a transformers causal LM with fp32 weights) on the language, in place;
    bf16 autocast on CUDA. AdamW, linear warm-up over a tenth of the steps, then cosine to a
    tenth of lr; gradients clipped to norm 1. Returns the loss of every step."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, steps // 10)

    def lr_at(step: int) -> float:
        if step < warm:
            return lr * (step + 1) / warm
        t = (step - warm) / max(1, steps - warm)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids = sample(lang, batch, length, g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step}: loss {losses[-1]:.3f} (the chain's entropy {lang.entropy():.3f})",
                  flush=True)
    model.eval()
    return losses


def shape_of(name: str, layers: int | None = None, vocab_size: int | None = None) -> dict:
    """SHAPES[name], with its layer count or vocabulary overridden where given."""
    shape = dict(SHAPES[name])
    shape.update({k: v for k, v in (("num_layers", layers), ("vocab_size", vocab_size)) if v})
    return shape


def qwen3_config(shape: dict, init_std: float = 0.02):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                       intermediate_size=shape["intermediate_size"],
                       num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                       num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                       tie_word_embeddings=shape["tie_word_embeddings"], rope_theta=1_000_000.0,
                       max_position_embeddings=40960, rms_norm_eps=1e-6,
                       initializer_range=init_std, eos_token_id=None, bos_token_id=None)


def write_trained_checkpoint(out: str, shape: dict, *, states: int, classes: int, steps: int,
                             batch: int, length: int, lr: float, seed: int, dtype: torch.dtype,
                             device: torch.device) -> dict:
    """Train a Qwen3ForCausalLM of `shape` on a fresh language and save it (in `dtype`) and the
    language (LANGUAGE_FILE) to `out`. Returns what happened, for the caller's JSON."""
    from transformers import Qwen3ForCausalLM

    t0 = time.perf_counter()
    lang = make_language(shape["vocab_size"], states, seed, classes=classes)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(qwen3_config(shape))
    losses = train(model, lang, steps=steps, batch=batch, length=length, lr=lr, seed=seed + 1)
    os.makedirs(out, exist_ok=True)
    model.to(dtype).save_pretrained(out)
    lang.save(os.path.join(out, LANGUAGE_FILE))
    tail = losses[-max(1, steps // 10):]
    return {"states": states, "classes": classes, "steps": steps, "batch": batch, "length": length,
            "lr": lr, "seed": seed, "first_loss": losses[0], "final_loss": sum(tail) / len(tail),
            "entropy": lang.entropy(), "train_seconds": time.perf_counter() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--vocab-size", type=int, default=None, help="override the shape's vocabulary")
    ap.add_argument("--states", type=int, default=1024, help="token ids the language uses")
    ap.add_argument("--classes", type=int, default=CLASSES,
                    help="classes of the token before that select the successors (1: a bigram chain)")
    # The defaults are session 23's run on the H200 (BENCHMARKS.md): ~95 s there at the 0.6B shape.
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--length", type=int, default=128,
                    help="training sequence length; positions far past it are predicted less well")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help="the saved checkpoint's dtype")
    ap.add_argument("--out", required=True, help="directory for the checkpoint")
    args = ap.parse_args()
    from minivllm.state import parse_dtype

    shape = shape_of(args.shape, args.layers, args.vocab_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = write_trained_checkpoint(args.out, shape, states=args.states, classes=args.classes,
                                      steps=args.steps, batch=args.batch, length=args.length, lr=args.lr,
                                      seed=args.seed, dtype=parse_dtype(args.dtype), device=device)
    print(json.dumps({"shape": args.shape, **result}, indent=1))


if __name__ == "__main__":
    main()
