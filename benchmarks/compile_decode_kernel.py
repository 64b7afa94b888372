"""The decode attention kernel compiled for a GPU this machine need not have (sm_90 by default):
shared memory, registers, spills, the K/V buffers Triton's pipeliner allocates, programs an SM,
and the instruction mix of the main loop. Runs on a CPU (Triton's bundled ptxas and cuobjdump).

    python benchmarks/compile_decode_kernel.py [--cache fp8|bf16] [--configs n128w4s3,n64w4s5,n32w2s2]

Each config is n<BLOCK_N>w<WARPS>s<STAGES>[r<MAXNREG>] (as the sweeps print them; until session
14 it was written BLOCK_N:NUM_STAGES[:NUM_WARPS[:MAXNREG]]), in the engine's form at the 0.6B shape
(16 heads, 8 KV heads, head_dim 128, page 16, fused q/k norm + RoPE and store, one split; fp8:
fp16 dots and V widened by PTX, as paged_decode_attention defaults on sm_89+). What it prints
is the compiler's, not a measurement: only the GPU says which config is faster.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minivllm.kernels.decode_attention import _decode_kernel

TRITON_BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")  # ptxas, cuobjdump

# H100/H200 (sm_90): per SM
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_PROGRAM = 1024
REGISTERS_PER_SM = 65536
MAX_PROGRAMS_PER_SM = 32


def signature_and_constants(cache: str, block_n: int, page: int) -> tuple[dict, dict]:
    """The argument types and constexprs of the engine's launch at the 0.6B shape."""
    fp8 = cache == "fp8"
    bf, cache_ty = "*bf16", ("*fp8e4nv" if fp8 else "*bf16")
    types = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, k_cache_ptr=cache_ty, v_cache_ptr=cache_ty,
                 bt_ptr="*i32", ctx_ptr="*i32", slot_ptr="*i64", qw_ptr=bf, kw_ptr=bf, cos_ptr=bf,
                 sin_ptr=bf, eps="fp32", out_ptr=bf, part_out_ptr="*fp32", part_lse_ptr="*fp32",
                 scale_log2="fp32")
    consts = dict(KV_HEADS=8, GROUP=2, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, PAGE=page,
                  BLOCK_N=block_n, SPLIT=False, STORE=True, NORM_ROPE=True, PRECISION="tf32",
                  HEADS_FASTEST=True, F16_DOTS=fp8, FP8_CACHE=fp8, PTX_WIDEN=int(fp8),
                  PEEL=not fp8)
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in _decode_kernel.arg_names}
    return sig, consts


def sass_loop(sass: str) -> list[str]:
    """The instructions of the backward branch's body with the most HMMAs: the tile loop."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    best: list[str] = []
    for addr, text in ins:
        m = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if sum("HMMA" in t for t in body) > sum("HMMA" in t for t in best):
                best = body
    return best


def compile_for(kernel_fn, sig: dict, consts: dict, options: dict, arch: int, workdir: str
                ) -> tuple:
    """kernel_fn (a @triton.jit function) compiled for sm_<arch> as a launch would (pointers
    16-byte aligned), and assembled by ptxas: (the compiled kernel, its object file's path,
    its registers a thread, its spilled bytes)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel_fn.arg_names)
             if sig[a].startswith("*")}
    kernel = triton.compile(ASTSource(kernel_fn, sig, consts, attrs),
                            target=GPUTarget("cuda", arch, 32), options=options)
    ptx, obj = os.path.join(workdir, "k.ptx"), os.path.join(workdir, "k.o")
    with open(ptx, "w") as f:
        f.write(kernel.asm["ptx"])
    suffix = "a" if arch >= 90 else ""
    ptxas = subprocess.run([f"{TRITON_BIN}/ptxas", "-v", "--gpu-name", f"sm_{arch}{suffix}", ptx, "-o", obj],
                           capture_output=True, text=True, check=True).stderr
    spill = re.search(r"(\d+) bytes spill stores", ptxas)
    return (kernel, obj, int(re.search(r"Used (\d+) registers", ptxas).group(1)),
            int(spill.group(1)) if spill else 0)


def compile_one(cache: str, block_n: int, stages: int, warps: int, maxnreg: int, page: int,
                arch: int, workdir: str) -> dict:
    """One config compiled for sm_<arch>: the compiler's resources and the tile loop's SASS mix."""
    sig, consts = signature_and_constants(cache, block_n, page)
    options = dict(num_warps=warps, num_stages=stages) | ({"maxnreg": maxnreg} if maxnreg else {})
    kernel, obj, regs, spill_bytes = compile_for(_decode_kernel, sig, consts, options, arch,
                                                 workdir)
    sass = subprocess.run([f"{TRITON_BIN}/cuobjdump", "-sass", obj], capture_output=True, text=True,
                          check=True).stdout
    loop = sass_loop(sass)
    mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)
    buffers = re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", kernel.asm["ttgir"])
    shared = kernel.metadata.shared
    regs_per_program = -(-regs // 8) * 8 * 32 * warps  # allocated 8 a thread at a time
    programs = min(SMEM_PER_SM // (shared + SMEM_RESERVED_PER_PROGRAM), REGISTERS_PER_SM // regs_per_program,
                   MAX_PROGRAMS_PER_SM)
    return dict(shared=shared, registers=regs, spill_bytes=spill_bytes,
                prefetched_tiles=max((int(n) for n in buffers), default=0), programs_per_sm=programs,
                loop_instructions=len(loop), mix=mix)


def parse_configs(text: str) -> list[dict]:
    """"n32w2s3,n128w4s3r128" -> tile configs: block_n, num_warps, num_stages and, after r, a
    register cap (maxnreg). The notation the sweeps print."""
    configs = []
    for spec in text.split(","):
        m = re.fullmatch(r"n([1-9]\d*)w([1-9]\d*)s([1-9]\d*)(?:r([1-9]\d*))?", spec)
        if m is None:
            raise argparse.ArgumentTypeError(
                f"config {spec!r}: want n<BLOCK_N>w<WARPS>s<STAGES>[r<MAXNREG>], e.g. n128w4s3")
        configs.append(dict(block_n=int(m[1]), num_warps=int(m[2]), num_stages=int(m[3]))
                       | ({"maxnreg": int(m[4])} if m[4] else {}))
    return configs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--configs", type=parse_configs,
                    default="n128w4s3,n128w4s5,n64w4s3,n64w4s5,n64w4s7,n32w2s2")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for sm_90")
    args = ap.parse_args()
    tile_bytes = 2 * 128 * (1 if args.cache == "fp8" else 2)  # K and V, a token
    with tempfile.TemporaryDirectory() as workdir:
        for c in args.configs:
            block_n, stages, warps = c["block_n"], c["num_stages"], c["num_warps"]
            maxnreg = c.get("maxnreg", 0)
            r = compile_one(args.cache, block_n, stages, warps, maxnreg, args.page, args.arch, workdir)
            in_flight = r["programs_per_sm"] * r["prefetched_tiles"] * block_n * tile_bytes
            print(f"{args.cache} n{block_n}w{warps}s{stages}{f' maxnreg {maxnreg}' if maxnreg else ''}: "
                  f"{r['shared'] / 1024:.1f} KB shared, {r['registers']} registers, "
                  f"{r['spill_bytes']} bytes spilled, {r['prefetched_tiles']} tile(s) prefetched, "
                  f"{r['programs_per_sm']} programs an SM, ~{in_flight // 1024} KB of K/V in flight an SM; "
                  f"loop {r['loop_instructions']} instructions: "
                  + ", ".join(f"{k} {v}" for k, v in r["mix"].most_common(10)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
