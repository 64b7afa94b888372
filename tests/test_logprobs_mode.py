"""vLLM's logprobs_mode (LLM(logprobs_mode=...), --logprobs-mode): what returned logprobs are
taken from. Checked against an independent plain-torch reference: transformers' logits at each
step of the engine's own output (teacher forcing), processed as vLLM v1's Sampler does (allowed
ids, min_tokens' banned stop ids, logit bias, repetition / frequency / presence penalties; then,
for rows that sample, temperature, min-p, top-k, top-p; greedy rows stop after the penalties)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from minivllm import SamplingParams
from minivllm.functional.sampling import (LOGPROBS_MODES, SamplingRow, make_sampling_batch,
                                          sample)

from engine_helpers import make_llm
from test_engine import hf_model, tiny_dir  # noqa: F401 (fixtures: seed 0, std 0.3)

MODES = LOGPROBS_MODES
N = 3  # top logprobs asked


PROMPTS = [[5, 17, 33, 2, 41, 8], [60, 3, 3, 90, 12], [7, 70, 21, 14], [1, 2, 3, 4, 5, 6, 7],
           [44, 45, 46], [99, 0, 50, 25, 75], [11, 22, 33]]

# Mixed in one batch: greedy and sampled rows, with and without truncation, penalties, logit
# bias, allowed ids, min_tokens (its stop id banned), and a row asking no logprobs.
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, logprobs=N, ignore_eos=True),
    # Greedy with top-k / top-p / min-p set: vLLM's greedy params carry none of them.
    SamplingParams(temperature=0.0, max_tokens=6, logprobs=N, ignore_eos=True, top_k=4,
                   top_p=0.5, min_p=0.2, repetition_penalty=1.3, presence_penalty=0.4,
                   frequency_penalty=0.3, logit_bias={9: 2.5, 10: -1.0}),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02, max_tokens=6, logprobs=N,
                   seed=11, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.5,
                   presence_penalty=0.2),
    SamplingParams(temperature=1.3, max_tokens=6, logprobs=N, seed=5, ignore_eos=True,
                   logit_bias={3: 3.0}, stop_token_ids=[30], min_tokens=4),
    SamplingParams(temperature=0.6, top_p=0.7, max_tokens=6, logprobs=N, seed=7, ignore_eos=True,
                   allowed_token_ids=list(range(20, 60))),
    SamplingParams(temperature=1.0, top_k=5, max_tokens=6, seed=3, ignore_eos=True),  # no logprobs
    SamplingParams(temperature=0.9, min_p=0.1, max_tokens=6, logprobs=N, seed=13, ignore_eos=True),
]


def reference_scores(logits: torch.Tensor, p: SamplingParams, prompt, output, mode: str):
    """One step's [V] values under `mode`, vLLM's definitions, in plain torch (fp64)."""
    x = logits.double().clone()
    if mode == "raw_logits":
        return x
    if mode == "raw_logprobs":
        return torch.log_softmax(x, -1)
    v = x.shape[0]
    if p.allowed_token_ids:
        keep = torch.zeros(v, dtype=torch.bool)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = -math.inf
    if p.min_tokens and len(output) < p.min_tokens:
        for t in p.stop_token_ids or ():
            x[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    # vLLM's apply_penalties: repetition (prompt and output ids), then frequency, presence.
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=v).double() \
        if output else torch.zeros(v, dtype=torch.float64)
    seen = counts > 0
    seen[list(prompt)] = True
    r = p.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).double()
    if p.temperature >= 1e-5:
        x = x / p.temperature
        if p.min_p > 0:
            probs = torch.softmax(x, -1)
            x[probs < p.min_p * probs.max()] = -math.inf
        if 0 < p.top_k < v:
            kth = torch.sort(x, descending=True).values[p.top_k - 1]
            x[x < kth] = -math.inf
        if p.top_p < 1:
            # vLLM's _apply_top_k_top_p: ascending sort, drop ids whose cumulative mass (they
            # and the ones below them) is <= 1 - top_p, never the top one.
            s, idx = torch.sort(x, descending=False)
            cum = torch.softmax(s, -1).cumsum(-1)
            drop = cum <= 1 - p.top_p
            drop[-1] = False
            x[idx[drop]] = -math.inf
    return torch.log_softmax(x, -1) if mode == "processed_logprobs" else x


def hf_step_logits(hf_model, prompt, output):
    """transformers' logits for each step of `output`, teacher-forced: [len(output), V] fp32."""
    with torch.no_grad():
        ids = torch.tensor([list(prompt) + list(output)])
        logits = hf_model(ids).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(output)]


@pytest.fixture(scope="module")
def outputs(tiny_dir, device):
    """Each mode's outputs of the mixed batch, and the prompt logprobs of one request."""
    got = {}
    for mode in MODES:
        llm = make_llm(tiny_dir, device, logprobs_mode=mode)
        assert llm.config.logprobs_mode == mode
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        scored = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                              SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
        got[mode] = ([o.outputs[0] for o in outs], scored.prompt_logprobs)
        del llm
    return got


def test_the_mode_never_changes_the_tokens(outputs):
    tokens = {mode: [c.token_ids for c in outs] for mode, (outs, _) in outputs.items()}
    for mode in MODES[1:]:
        assert tokens[mode] == tokens[MODES[0]]
    assert all(len(t) == 6 for t in tokens[MODES[0]])


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_of_each_mode_match_the_reference(outputs, hf_model, mode):
    outs, _ = outputs[mode]
    for prompt, p, c in zip(PROMPTS, PARAMS, outs):
        if p.logprobs is None:
            assert c.logprobs is None and c.cumulative_logprob is None
            continue
        logits = hf_step_logits(hf_model, prompt, c.token_ids)
        total = 0.0
        for t, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            ref = reference_scores(logits[t], p, prompt, c.token_ids[:t], mode)
            lp = entry[tok]
            # The sampled token's value and rank (vLLM's: ids >= it, ties counted).
            assert math.isfinite(ref[tok]), (mode, t)
            assert lp.logprob == pytest.approx(ref[tok].item(), abs=2e-4), (mode, p, t)
            assert lp.rank == int((ref >= ref[tok] - 1e-9).sum()), (mode, t)
            # The top N: the reference's N best ids, with their values. Where truncation leaves
            # fewer than N finite values, the rest of the top N are -inf ties, any id of which
            # is a right answer (the GPU's top-k picks other ids than the CPU's).
            top = ref.topk(N)
            want = {int(i): v.item() for i, v in zip(top.indices, top.values)
                    if math.isfinite(v.item())}
            assert set(want) <= set(entry) and len(entry) <= N + 1
            for i in want:
                assert entry[i].logprob == pytest.approx(want[i], abs=2e-4)
            for i in set(entry) - set(want) - {tok}:
                assert entry[i].logprob == -math.inf and ref[i] == -math.inf, (mode, t, i)
            if p.temperature == 0:  # greedy: the arg-max of the processed logits
                assert tok == int(reference_scores(logits[t], p, prompt, c.token_ids[:t],
                                                   "processed_logits").argmax())
            total += lp.logprob
        # cumulative_logprob is the sum of the returned values, whatever they are (vLLM's).
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_processed_logprobs_differ_where_processing_does(outputs):
    """Not a vacuous check: the processed values of a penalised / tempered / truncated row are
    not the raw ones, those of a plain greedy row are."""
    raw, _ = outputs["raw_logprobs"]
    proc, _ = outputs["processed_logprobs"]
    plain = [e[t].logprob for e, t in zip(proc[0].logprobs, proc[0].token_ids)]
    assert plain == pytest.approx([e[t].logprob for e, t in zip(raw[0].logprobs, raw[0].token_ids)],
                                  abs=1e-5)
    for k in (1, 2, 3, 4, 6):
        a = [e[t].logprob for e, t in zip(proc[k].logprobs, proc[k].token_ids)]
        b = [e[t].logprob for e, t in zip(raw[k].logprobs, raw[k].token_ids)]
        assert a != pytest.approx(b, abs=1e-3), k


def test_prompt_logprobs_stay_raw_in_every_mode(outputs, hf_model):
    logits = hf_step_logits(hf_model, PROMPTS[0][:1], PROMPTS[0][1:])
    for mode in MODES:
        _, scored = outputs[mode]
        assert scored[0] is None
        for t, entry in enumerate(scored[1:]):
            ref = torch.log_softmax(logits[t].double(), -1)
            for i, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[i].item(), abs=2e-4), mode


@pytest.mark.parametrize("mode", MODES)
def test_sampled_token_is_finite_and_ranks_agree_in_the_sampler(mode):
    """sample() alone, many seeds and a heavily truncated batch: the sampled token's value is
    finite in every mode, its rank is its place among the returned representation."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g) * 3
    rows = [SamplingRow(temperature=0.7, top_k=3, top_p=0.5, min_p=0.3, seed=s, logprobs=5,
                        output_ids=(1, 2), presence_penalty=1.0) for s in range(4)] + \
           [SamplingRow(temperature=0.0, top_k=2, logprobs=5, banned_ids=(int(logits[4].argmax()),)),
            SamplingRow(temperature=2.0, seed=9, logprobs=5, logit_bias=((7, 5.0),)),
            SamplingRow(temperature=1.0, seed=1),
            SamplingRow(temperature=0.5, top_p=0.3, seed=4, logprobs=2, allowed_ids=(1, 3, 5))]
    for step in range(5):
        sb = make_sampling_batch(rows, vocab_size=50, steps=[step] * len(rows),
                                 logprobs_mode=mode)
        out = sample(logits, sb, kernel=False)
        assert torch.isfinite(out.logprobs).all()
        assert (out.ranks >= 1).all()
        assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    # The greedy row banned its arg-max: the processed value of its token is its rank-1 value.
    if mode.startswith("processed"):
        assert int(out.ranks[4]) == 1


def test_raw_logprobs_is_the_default_and_unchanged(tiny_dir, device, outputs):
    llm = make_llm(tiny_dir, device)
    assert llm.config.logprobs_mode == "raw_logprobs"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    raw, _ = outputs["raw_logprobs"]
    for o, c in zip(outs, raw):
        assert o.outputs[0].token_ids == c.token_ids
        if c.logprobs is not None:
            assert [{i: (lp.logprob, lp.rank) for i, lp in e.items()} for e in o.outputs[0].logprobs] \
                == [{i: (lp.logprob, lp.rank) for i, lp in e.items()} for e in c.logprobs]


@pytest.mark.parametrize("bad", ["processed", "raw", "RAW_LOGPROBS", None, 1])
def test_a_bad_mode_is_refused_naming_the_four(tiny_dir, device, bad):
    from minivllm import LLM

    with pytest.raises(ValueError) as e:
        LLM(tiny_dir, device=device, logprobs_mode=bad)
    for mode in MODES:
        assert repr(mode) in str(e.value)
    with pytest.raises(ValueError, match="processed_logits"):
        make_sampling_batch([SamplingRow()], vocab_size=10, logprobs_mode=bad)


def test_cli_logprobs_mode_flag(capsys):
    """generate --logprobs-mode raw_logits returns the raw logits (the API's, same mode); serve
    shares the flag (its engine is built by the same _make_llm); a bad value is argparse's
    error, naming the choices."""
    from minivllm.cli import build_parser, main
    from minivllm.runtime.demo import ensure_demo_model
    from hf_tiny import DEVICE

    argv = ["generate", "--demo", "-p", "Hello", "--max-tokens", "4", "--ignore-eos",
            "--temperature", "0", "--logprobs", "2", "--json", "--logprobs-mode", "raw_logits"]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    llm = make_llm(ensure_demo_model(), DEVICE, logprobs_mode="raw_logits")
    want = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                  logprobs=2), use_tqdm=False)[0].outputs[0]
    assert row["token_ids"] == want.token_ids
    got = [e[str(t)] for e, t in zip(row["logprobs"], row["token_ids"])]
    assert got == pytest.approx([e[t].logprob for e, t in zip(want.logprobs, want.token_ids)],
                                abs=1e-5)
    assert any(v > 0 for v in got)  # logits, not logprobs
    args = build_parser().parse_args(["serve", "--demo", "--logprobs-mode", "processed_logprobs"])
    assert args.logprobs_mode == "processed_logprobs"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--demo", "--logprobs-mode", "bogus"])
    assert "processed_logits" in capsys.readouterr().err


def test_server_returns_the_modes_values(device):
    """The OpenAI server over an engine in raw_logits mode: a completion's logprobs are the
    engine's logits."""
    import threading
    import urllib.request

    from minivllm.runtime.demo import ensure_demo_model
    from minivllm.runtime.server import OpenAIServer

    llm = make_llm(ensure_demo_model(), device, max_model_len=256, logprobs_mode="raw_logits")
    want = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                  logprobs=1), use_tqdm=False)[0].outputs[0]
    srv = OpenAIServer(llm, port=0, model_name="tiny")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = srv.address
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0,
                "logprobs": 1, "ignore_eos": True}
        req = urllib.request.Request(f"http://{host}:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            lp = json.loads(r.read())["choices"][0]["logprobs"]
    finally:
        srv.shutdown()
        thread.join(timeout=10)
    assert lp["token_logprobs"] == pytest.approx(
        [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-5)


def test_tp2_engine_returns_the_modes_values(tiny_dir, outputs):
    """LLM(tensor_parallel_size=2) on CPU (gloo, a spawned worker): the mode travels with the
    config to every rank, and the processed logprobs are the TP=1 engine's."""
    from minivllm import LLM

    with LLM(tiny_dir, tensor_parallel_size=2, device="cpu", attention_backend="reference",
             num_kv_blocks=64, logprobs_mode="processed_logprobs") as llm:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                   PARAMS, use_tqdm=False)]
    want, _ = outputs["processed_logprobs"]
    for c, w in zip(outs, want):
        assert c.token_ids == w.token_ids
        if w.logprobs is not None:
            torch.testing.assert_close([e[t].logprob for e, t in zip(c.logprobs, c.token_ids)],
                                       [e[t].logprob for e, t in zip(w.logprobs, w.token_ids)],
                                       rtol=0, atol=1e-5)


def test_beam_search_is_refused_under_a_logits_mode_and_kept_under_logprobs(tiny_dir, device):
    """Beam search scores each beam by the sum of its tokens' returned logprobs: in a logits
    mode those were logits, and the beams came back ranked (and scored) by summed logits, no
    probability at all. It is refused there; in either logprobs mode (greedy steps: processed
    = raw) the beams are those of the default engine."""
    from minivllm.runtime.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]

    def beams(llm):
        return [[(b.tokens, round(b.cum_logprob, 4)) for b in out.sequences]
                for out in llm.beam_search(prompts, params)]

    want = beams(make_llm(tiny_dir, device))
    assert beams(make_llm(tiny_dir, device, logprobs_mode="processed_logprobs")) == want
    for mode in ("raw_logits", "processed_logits"):
        with pytest.raises(ValueError, match=f"beam_search.*{mode}"):
            make_llm(tiny_dir, device, logprobs_mode=mode).beam_search(prompts, params)


def check_processed_logprobs_against_own_logits(llm, monkeypatch):
    """Run the mixed batch (all in one prefill step, then decode steps of every row) on `llm`
    (processed_logprobs mode), recording the logits each sampler call was given
    (runner.sample), and check each returned processed logprob against reference_scores computed
    from those very logits (fp64 on the CPU): the sampler's processing on the device, apart from
    the model's own rounding. Returns the outputs."""
    import minivllm.runtime.runner as runner_module

    calls = []
    real = runner_module.sample

    def recording(logits, sb, **kw):
        out = real(logits, sb, **kw)
        calls.append((logits.float().cpu(), out.token_ids.cpu()))
        return out

    monkeypatch.setattr(runner_module, "sample", recording)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                               PARAMS, use_tqdm=False)]
    monkeypatch.setattr(runner_module, "sample", real)
    steps = len(outs[0].token_ids)
    assert len(calls) >= steps, "one sampler call a step: the batch in one prefill step"
    for t, (logits, tokens) in enumerate(calls[:steps]):
        # the batch's rows are the requests in order (checked by the tokens they sampled)
        assert tokens[:len(PROMPTS)].tolist() == [c.token_ids[t] for c in outs], t
        for r, (prompt, p, c) in enumerate(zip(PROMPTS, PARAMS, outs)):
            if p.logprobs is None:
                continue
            ref = reference_scores(logits[r], p, prompt, c.token_ids[:t], "processed_logprobs")
            tok, entry = c.token_ids[t], c.logprobs[t]
            assert math.isfinite(ref[tok]), (r, t)
            assert entry[tok].logprob == pytest.approx(ref[tok].item(), abs=2e-3), (r, t)
            assert entry[tok].rank == int((ref >= ref[tok] - 1e-6).sum()), (r, t)
            top = ref.topk(N)
            for i, v in zip(top.indices.tolist(), top.values.tolist()):
                if v > top.values[-1].item() + 1e-4:  # not at a tie with the N-th
                    assert entry[i].logprob == pytest.approx(v, abs=2e-3), (r, t, i)
    return outs


def test_gpu_processed_logprobs_in_bf16_match_the_reference_from_the_engines_logits(
        tiny_dir, monkeypatch):
    """On CUDA in bf16 (compiled forward, CUDA graphs; the sampler's Triton kernel), the
    processed_logprobs of the mixed batch equal reference_scores of the logits the engine's own
    sampler was given: bf16 logits make transformers' fp32 ones the wrong reference (a top-p or
    min-p cut may fall elsewhere), the engine's own are exact. The tolerance (2e-3) is the
    sampler's fp32 arithmetic against the reference's fp64."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = make_llm(tiny_dir, torch.device("cuda"), graphs=True, dtype="bfloat16",
                   max_num_seqs=8, logprobs_mode="processed_logprobs")
    assert llm.engine.runner.graphs is not None
    outs = check_processed_logprobs_against_own_logits(llm, monkeypatch)
    assert all(len(c.token_ids) == 6 for c in outs)


def test_processed_logprobs_match_the_reference_from_the_engines_logits(tiny_dir, device,
                                                                         monkeypatch):
    """The GPU test's check on this device in the engine's float32 (its recording of the
    sampler's logits and the row order it assumes hold)."""
    llm = make_llm(tiny_dir, device, logprobs_mode="processed_logprobs", max_num_seqs=8)
    check_processed_logprobs_against_own_logits(llm, monkeypatch)
