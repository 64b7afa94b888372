"""Tracing Triton kernels with torch.compile on a machine without a GPU, for the kernel tests.

Dynamo sees a Triton kernel only as a @triton.jit JITFunction on a machine where torch finds a
Triton device; under TRITON_INTERPRET=1 the kernels are InterpretedFunctions, opaque to it. So on
CPU a child process imports them without the interpreter, tells torch a Triton device exists,
traces with fullgraph=True (any graph break raises) and runs AOT autograd over the graph, as the
aot_eager backend does, then stops before running it (a JIT kernel cannot run without a GPU;
the interpreted kernels' numerics are what the tests check). Without a GPU, Triton's mutation
analysis cannot lower the kernel and treats every argument as written (a logged warning). A
size marked dynamic (torch._dynamo.mark_dynamic) that the trace specializes, or pins by an
equality guard, fails the trace.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import json, torch, torch.utils._triton
torch.utils._triton.has_triton = lambda: True
from torch._dynamo.backends.common import aot_autograd

class Traced(Exception):
    pass

graphs = {}

def keep(gm, example_inputs):
    graphs["aot"] = gm
    return gm

def backend(gm, example_inputs):
    graphs["dynamo"] = gm
    # A size marked dynamic that the trace fixed to a number (dynamo would raise
    # ConstraintViolationError when it installs its guards, which Traced pre-empts), or an
    # expression of it that a guard pins to one value (a launch choice from next_pow2 of a
    # step's size, say): the compiled graph would serve one size, or one class of sizes, only.
    env = torch._guards.TracingContext.try_get().fake_mode.shape_env
    fixed = {str(k): str(v) for k, v in env.replacements.items() if v.is_number}
    fixed.update({str(g.expr): "guard" for g in env.guards if type(g.expr).__name__ == "Equality"
                  and g.expr.free_symbols})
    assert not fixed, f"sizes marked dynamic were specialized: {fixed}"
    aot_autograd(fw_compiler=keep)(gm, example_inputs)
    raise Traced

def trace(fn, *args):
    try:
        torch.compile(fn, fullgraph=True, backend=backend)(*args)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        assert isinstance(e.inner_exception, Traced), e
    count = lambda gm: sum("triton_kernel_wrapper" in str(n.target) for n in gm.graph.nodes)
    print(json.dumps({k: count(gm) for k, gm in graphs.items()}))
"""


def kernel_launches_traced(body: str) -> dict:
    """Run PRELUDE + body in a child process without the interpreter; body ends by calling
    trace(fn, *args). Returns the Triton kernel launches in dynamo's and AOT autograd's graphs,
    {"dynamo": n, "aot": n}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", PRELUDE + body], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
