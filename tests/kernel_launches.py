"""Compiling, for a Hopper GPU, every Triton kernel the CPU suite launched under the interpreter.

The interpreter runs a kernel as Python over numpy, so it accepts code that Triton's compiler
rejects: in session 64 a kernel passed every CPU test and failed to compile on the GPU (a name
bound to a scalar before a loop and to a block inside it: a loop-carried variable of two types).
The CPU machine's Triton wheel carries the NVIDIA backend and ptxas, so the compiler itself can
run here, given each launch's argument types and constexprs, which `record` keeps.

In the suite (tests/conftest.py installs `record` under the interpreter) each distinct launch is
kept once: its kernel, the Triton type of each argument as the JIT would specialize it (a pointer's
dtype, i32 / i64, an int 1 made a constant), its constexprs and num_warps / num_stages.
tests/test_zz_kernels_compile.py, last in the suite, hands them to this file run as a script,
in a child process without the interpreter (where the kernels are JITFunctions), which compiles
each for sm_90 (one process a core) and prints the failures. What only a GPU launches (inline
PTX, cooperative grids, its tiles) the interpreter never runs: `as_on_a_gpu` makes the wrappers
choose as on an H100 and records their launches without running them, for the same check.
"""

from __future__ import annotations

import inspect
import json
import os
import sys

LAUNCHES: dict[str, dict] = {}  # a launch's JSON -> the launch


def _constexpr_value(value):
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a constexpr of type {type(value).__name__}: teach kernel_launches it")


def record(fn, args: tuple, kwargs: dict) -> None:
    """Keep one launch of the interpreted kernel `fn` (an InterpretedFunction) with these
    arguments (a tensor is kept as its pointer type only)."""
    from triton.runtime.jit import mangle_type

    params = inspect.signature(fn.fn).parameters
    bound = dict(zip(params, args))
    options = {}
    for name, value in kwargs.items():
        (bound if name in params else options)[name] = value
    signature, constexprs = {}, {}
    for name, param in params.items():
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation):
            signature[name] = "constexpr"
            constexprs[name] = _constexpr_value(value)
            continue
        signature[name] = mangle_type(value, specialize=True)
        if signature[name] == "constexpr":  # an int 1, None: the JIT makes them constants
            constexprs[name] = value
    launch = {"module": fn.fn.__module__, "name": fn.fn.__name__, "signature": signature,
              "constexprs": constexprs,
              "options": {k: options[k] for k in ("num_warps", "num_stages") if k in options}}
    LAUNCHES.setdefault(json.dumps(launch, sort_keys=True), launch)


DRY_RUN = False  # record launches without running them (as_on_a_gpu)


def as_on_a_gpu(monkeypatch) -> None:
    """From now on (a monkeypatch's scope) the kernel wrappers choose as on an H100 (runs_ptx
    true: inline PTX, cooperative grids, the GPU's tiles; 132 SMs; capability 9.0) and every
    launch is recorded, not run: the interpreter cannot run those variants (PTX, programs that
    wait on each other), so their outputs stay unwritten. For the compile check only."""
    import minivllm.kernels.launch as launch

    as_on_h100 = [(launch.runs_ptx, lambda device: True), (launch.num_sms, lambda device: 132),
                  (launch.cuda_capability, lambda device: (9, 0))]
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in ("minivllm", "benchmarks") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            for original, replacement in as_on_h100:
                if value is original:  # wherever a module imported it by name
                    monkeypatch.setattr(module, attr, replacement)
    monkeypatch.setattr(sys.modules[__name__], "DRY_RUN", True)


def install() -> None:
    """Record every launch of an interpreted kernel that runs through from now on (one that
    raises, as a test of bad input may want, is not compiled)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        out = None if DRY_RUN else run(self, *args, grid=grid, warmup=warmup, **kwargs)
        record(self, args, kwargs)
        return out

    InterpretedFunction.run = recording_run


def _root_cause(e: BaseException) -> BaseException:
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return e


def constexprs(launch: dict) -> dict:
    """A recorded launch's constexprs as the compiler takes them (dtypes back from their names)."""
    import triton.language as tl

    return {k: tl.dtype(v["dtype"]) if isinstance(v, dict) else v
            for k, v in launch["constexprs"].items()}


def compile_for_sm90(launch: dict):
    """One recorded launch compiled for sm_90 (run without TRITON_INTERPRET): Triton's compiled
    kernel (its PTX in .asm["ptx"])."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    return triton.compile(ASTSource(fn, launch["signature"], constexprs(launch)),
                          target=GPUTarget("cuda", 90, 32), options=launch["options"])


def compile_one(launch: dict) -> str | None:
    """Compile one launch for sm_90 (run without TRITON_INTERPRET). -> None, or what failed."""
    try:
        compile_for_sm90(launch)
    except Exception as e:  # every failure, each named; the compiler raises many kinds
        root = _root_cause(e)
        return (f"{launch['module']}.{launch['name']} {launch['constexprs']}:\n"
                f"{str(e)[-1200:]}\n  because {type(root).__name__}: {str(root)[-600:]}")
    return None


if __name__ == "__main__":
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(os.cpu_count()) as pool:
        failures = [f for f in pool.map(compile_one, json.load(open(sys.argv[1])), chunksize=4)
                    if f]
    print("\n\n".join(failures))
    sys.exit(1 if failures else 0)
