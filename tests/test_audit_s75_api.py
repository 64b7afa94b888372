"""What the Python API let through (session 75): bad input to LLM.chat that raised jinja's own
errors (vLLM's LLM.chat raises a ValueError) or one naming nothing, and a refused call that
left a LoRA id bound to its adapter, so that a later call a fresh engine serves was refused."""

from __future__ import annotations

import pytest
import torch

from minivllm import LoRARequest, SamplingParams
from minivllm.runtime.demo import ensure_demo_model

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint
from test_lora import write_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def demo_llm(tmp_path_factory, device):
    path = ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))
    return make_llm(path, device, num_kv_blocks=64, block_size=4, max_model_len=120)


def chat_tokens(llm, **kw):
    return llm.chat(HELLO, GREEDY, use_tqdm=False, **kw)[0].outputs[0].token_ids


@pytest.mark.parametrize("template, name", [
    ("{% if %}", "TemplateSyntaxError"),  # does not parse
    ("{{ raise_exception('no user turn') }}", "TemplateError"),  # as Qwen3's template raises
    ("{{ 1 / 0 }}", "ZeroDivisionError"),  # fails while rendering
])
def test_a_chat_template_that_fails_is_a_value_error_naming_it(demo_llm, template, name):
    """These raised jinja2's TemplateSyntaxError / TemplateError or a ZeroDivisionError, none a
    ValueError; vLLM's LLM.chat raises a ValueError for any error of the template."""
    want = chat_tokens(demo_llm)
    steps = demo_llm.stats.steps
    with pytest.raises(ValueError, match=f"chat template failed: {name}"):
        chat_tokens(demo_llm, chat_template=template)
    assert demo_llm.stats.steps == steps and not demo_llm.engine.requests
    assert chat_tokens(demo_llm) == want


@pytest.mark.parametrize("kw, match", [
    (dict(chat_template=5), "chat_template must be a Jinja template string or None, got int"),
    (dict(chat_template_kwargs="x"), "chat_template_kwargs must be a dict or None, got str"),
    (dict(chat_template_kwargs=[("enable_thinking", False)]), "chat_template_kwargs must be"),
])
def test_chat_options_of_the_wrong_type_are_named(demo_llm, kw, match):
    """Once jinja's "Can't compile non template nodes" and dict()'s "dictionary update sequence
    element #0 has length 1" (a ValueError naming no argument)."""
    with pytest.raises(TypeError, match=match):
        chat_tokens(demo_llm, **kw)
    assert not demo_llm.engine.requests


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """A tiny checkpoint and two adapters of it, A and B."""
    root = tmp_path_factory.mktemp("s75_lora")
    model = save_checkpoint(make_hf_model(seed=0, std=0.3), root / "model")
    write_adapter(str(root / "a"), model, r=4, alpha=8, targets="all-linear", seed=1)
    write_adapter(str(root / "b"), model, r=2, alpha=3, targets=["q_proj", "v_proj"], seed=3)
    return model, str(root / "a"), str(root / "b")


def lora_engine(model):
    return make_llm(model, torch.device("cpu"), enable_lora=True, max_loras=2, max_lora_rank=8)


PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}
OUT_OF_VOCAB = {"prompt_token_ids": [500]}


def lora_tokens(llm, lora):
    return llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids


@pytest.mark.parametrize("how", ["generate", "stream", "one id twice in the call"])
def test_a_refused_call_binds_no_lora_id(lora_setup, how):
    """A call refused for another prompt's fault (or for naming one id with two adapters) used
    to bind the id to its adapter while checking it: a later call giving that id another
    adapter, which a fresh engine serves, was refused ("one id per adapter")."""
    model, a, b = lora_setup
    want = lora_tokens(lora_engine(model), LoRARequest("b", 1, b))
    llm = lora_engine(model)
    with pytest.raises(ValueError):
        if how == "generate":
            llm.generate([PROMPT, OUT_OF_VOCAB], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("a", 1, a))
        elif how == "stream":
            llm.stream([PROMPT, OUT_OF_VOCAB], GREEDY, lora_request=LoRARequest("a", 1, a))
        else:
            llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False,
                         lora_request=[LoRARequest("a", 1, a), LoRARequest("b", 1, b)])
    engine = llm.engine
    assert not engine.requests and engine.stats.steps == 0
    assert engine.list_loras() == set()
    assert lora_tokens(llm, LoRARequest("b", 1, b)) == want
    # Accepted, the id is bound: another adapter under it is refused, before any work.
    with pytest.raises(ValueError, match="one id per adapter"):
        lora_tokens(llm, LoRARequest("a", 1, a))
    assert not engine.requests


def test_an_accepted_stream_binds_its_ids_at_once(lora_setup):
    """A stream's requests are queued at its first next(), its ids bound when it is made (as
    before): a call in between that gives the id another adapter is refused, and the stream
    still runs its own adapter."""
    model, a, b = lora_setup
    want = lora_tokens(lora_engine(model), LoRARequest("a", 1, a))
    llm = lora_engine(model)
    stream = llm.stream(PROMPT, GREEDY, lora_request=LoRARequest("a", 1, a))
    with pytest.raises(ValueError, match="one id per adapter"):
        lora_tokens(llm, LoRARequest("b", 1, b))
    assert [t for out in stream for c in out.outputs for t in c.token_ids] == want


def test_n_past_vllms_bound_is_refused_before_any_work():
    """SamplingParams(n=2**70) was taken, and enqueue then made sequences until the process
    ran out of memory; vLLM's SamplingParams refuses n past VLLM_MAX_N_SEQUENCES (16384)."""
    from minivllm.runtime.sampling_params import MAX_N

    assert MAX_N == 16384 and SamplingParams(n=MAX_N).n == MAX_N
    for n in (MAX_N + 1, 2**70):
        with pytest.raises(ValueError, match=r"n must be an integer in \[1, 16384\]"):
            SamplingParams(n=n)
