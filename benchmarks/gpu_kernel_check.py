"""The attention kernels and backends against the reference on a GPU: bf16 (<= 1e-2), fp16
(<= 2e-3) and fp32 (<= 1e-5, fp32 dot products), contexts beyond 8k, GQA 1/2/4/8, pages 16 and 256,
ragged lengths, a context of 1, poisoned caches and outputs, skipped slots.

    PYTHONPATH=. python benchmarks/gpu_kernel_check.py          # on the GPU machine; exit 1 on a failure
    PYTHONPATH=. python benchmarks/gpu_kernel_check.py --sass   # any machine: compile for sm_90 and
                                                                # print registers, spills, SASS op counts
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import time

import torch

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def gpu_checks(seed: int, random_cases: int, dev: torch.device, shrink: int = 1) -> int:
    """shrink > 1 divides every length (a CPU smoke run of this script under the interpreter)."""
    from minivllm.functional.attention import REFERENCE, reference_attention
    from minivllm.kernels.decode_attention import paged_decode_attention
    from minivllm.kernels.flash_attn_backend import FLASH_ATTN, flash_attn_varlen
    from minivllm.kernels.prefill_attention import varlen_prefill_attention
    from minivllm.kernels.testing import make_problem, rel_error
    from minivllm.kernels.triton_backend import TRITON

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failures = []

    def report(kind, case, dtype, err, extra=""):
        tol = TOL[dtype]
        ok = err <= tol
        name = str(dtype).replace("torch.", "")
        print(f"{'PASS' if ok else 'FAIL'} {kind:8s} {name:8s} err={err:.2e} tol={tol:.0e} {extra} {case}",
              flush=True)
        if not ok:
            failures.append((kind, case))

    def small(case):
        return dict(case, q_lens=[max(1, n // shrink) for n in case["q_lens"]],
                    cached=[c // shrink for c in case["cached"]]) if shrink > 1 else case

    def decode(case, dtype, num_splits=None):
        case = small(case)
        p = make_problem(**case, dtype=dtype, device=dev)
        ref = reference_attention(p.q, p.k, p.v, *p.clean_cache(), p.batch, p.scale)
        out = paged_decode_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.block_tables,
                                     p.batch.context_lens, p.scale,
                                     out=torch.full_like(p.q, float("nan")), num_splits=num_splits)
        report("decode", case, dtype, rel_error(out, ref), f"splits={num_splits}")

    def prefill(case, dtype, config=None):
        case = small(case)
        p = make_problem(**case, dtype=dtype, device=dev)
        ref = reference_attention(p.q, p.k, p.v, *p.clean_cache(), p.batch, p.scale)
        out = varlen_prefill_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.cu_seqlens_q,
                                       p.batch.context_lens, p.batch.block_tables, p.scale,
                                       out=torch.full_like(p.q, float("nan")), config=config)
        report("prefill", case, dtype, rel_error(out, ref), f"config={config}")

    def backend(be, case, dtype, poison=True):
        case = small(case)
        t = sum(case["q_lens"])
        skip = [i for i in range(t) if (i * 7919) % 11 == 3] if be is TRITON else []
        p = make_problem(**case, dtype=dtype, device=dev, skip=skip, poison=poison)
        k_ref, v_ref = p.clean_cache()
        ref = REFERENCE(p.q, p.k, p.v, k_ref, v_ref, p.batch, p.scale)
        k_out, v_out = p.k_cache.clone(), p.v_cache.clone()
        out = be(p.q, p.k, p.v, k_out, v_out, p.batch, p.scale)
        cache_ok = True
        for got, want in ((k_out, k_ref), (v_out, v_ref)):
            want = want.clone()
            want[p.poison] = float("nan")
            cache_ok &= bool(torch.equal(got.nan_to_num(123.0), want.nan_to_num(123.0)))
        err = rel_error(out, ref) if cache_ok else float("inf")
        report(be.name, case, dtype, err, "" if cache_ok else "CACHE WRITE MISMATCH")

    long_ctx = [1, 17, 255, 256, 257, 8193, 20000, 33000]

    def decodes(dtype, pages, groups):
        for page in pages:
            for group in groups:
                decode(dict(q_lens=[1] * len(long_ctx), cached=[c - 1 for c in long_ctx], page=page,
                            kv_heads=2, group=group, head_dim=128, seed=group), dtype)

    def prefills(dtype, pages):
        for page in pages:
            prefill(dict(q_lens=[1, 100, 333, 130], cached=[0, 9000, 17, 255], page=page, kv_heads=2,
                         group=2, head_dim=128, seed=1), dtype)
            prefill(dict(q_lens=[700, 5, 64, 129], cached=[0, 0, 64, 3], page=page, kv_heads=8,
                         group=2, head_dim=128, seed=2), dtype)

    # bf16, the engine's dtype, gets the whole matrix; fp16 and fp32 (fp32 dot products) a corner
    # each, to bound the number of compiled variants.
    decodes(torch.bfloat16, (16, 256), (1, 2, 4, 8))
    prefills(torch.bfloat16, (16, 256))
    for group in (1, 4, 8):
        prefill(dict(q_lens=[1, 77, 200], cached=[40, 8300, 0], page=16, kv_heads=1, group=group,
                     head_dim=64, seed=group), torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        for splits in (1, 7):
            decode(dict(q_lens=[1] * 3, cached=[0, 9000, 300], page=16, kv_heads=8, group=2,
                        head_dim=128, seed=5), dtype, num_splits=splits)
    for config in (dict(pack=False), dict(block_m=64, block_n=64, num_warps=4, num_stages=2),
                   dict(block_m=64, block_n=32, num_warps=4, num_stages=3),
                   dict(block_m=64, block_n=64, num_warps=4, num_stages=3, pack=False)):
        for page in (16, 256):
            prefill(dict(q_lens=[1, 100, 333, 130], cached=[0, 2000, 17, 255], page=page, kv_heads=8,
                         group=2, head_dim=128, seed=11), torch.bfloat16, config)
    decodes(torch.float16, (16,), (1, 8))
    prefills(torch.float16, (256,))
    decodes(torch.float32, (256,), (2,))
    prefills(torch.float32, (16,))

    rng = random.Random(seed)
    for i in range(random_cases):
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        b = rng.randint(1, 6)
        case = dict(page=rng.choice([16, 256, 32]), kv_heads=rng.choice([1, 2, 8]),
                    group=rng.choice([1, 2, 4, 8]), head_dim=rng.choice([64, 128]), seed=i)
        cached = [rng.choice([0, rng.randint(0, 300), rng.randint(0, 12000)]) for _ in range(b)]
        if rng.random() < 0.5:
            decode(dict(case, q_lens=[1] * b, cached=cached), dtype)
        else:
            prefill(dict(case, q_lens=[rng.randint(1, 300) for _ in range(b)], cached=cached), dtype)

    for dtype in (torch.bfloat16, torch.float32):
        backend(TRITON, dict(q_lens=[1] * 5, cached=[0, 15, 16, 4000, 9000], page=16, kv_heads=8,
                             group=2, head_dim=128, seed=7), dtype)
        backend(TRITON, dict(q_lens=[300, 1, 45], cached=[0, 77, 9000], page=256, kv_heads=8, group=2,
                             head_dim=128, seed=8), dtype)
    if dev.type != "cuda" or flash_attn_varlen() is None:
        print("SKIP flash_attn: flash_attn.cute is not importable")
    else:
        for page in (16, 256):
            for case in (dict(q_lens=[1] * 5, cached=[0, 15, 16, 4000, 9000]),
                         dict(q_lens=[300, 1, 45], cached=[0, 77, 9000])):
                # flash-attn-4 loads whole pages, so rows past a context must be finite.
                backend(FLASH_ATTN, dict(case, page=page, kv_heads=8, group=2, head_dim=128, seed=9),
                        torch.bfloat16, poison=False)
    print(f"{len(failures)} failures", flush=True)
    return 1 if failures else 0


def sass_report() -> int:
    """Compile for sm_90 without a GPU (Triton ships ptxas and cuobjdump) with the divisibility-16
    specialisation that aligned pointers and strides get at launch: registers, spills, whether the
    loads are 16 bytes wide and asynchronous, and which matrix instructions are used."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minivllm.kernels.decode_attention import _decode_kernel
    from minivllm.kernels.prefill_attention import _prefill_kernel

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    target = GPUTarget("cuda", 90, 32)

    def build(fn, types, consts, num_warps, num_stages):
        names = [n for n in fn.arg_names if n not in consts]
        sig = dict(zip(names, types)) | {c: "constexpr" for c in consts}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in zip(names, types)
                 if t.startswith("*") or (n.startswith("stride") and n != "stride_bt")}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=target, options=dict(num_warps=num_warps, num_stages=num_stages))
        path = "/tmp/minivllm_kernel.cubin"
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        res = subprocess.run([f"{bindir}/cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([f"{bindir}/cuobjdump", "-sass", path], capture_output=True, text=True).stdout
        grab = lambda key: (re.search(key + r":(\d+)", res) or [None, "?"])[1]  # noqa: E731
        n = lambda pat: len(re.findall(pat, sass))  # noqa: E731
        return (f"regs={grab('REG')} stack={grab('STACK')} smem={k.metadata.shared} spill_st={n(r'STL')} "
                f"cp.async128={n(r'LDGSTS[.A-Z]*128')} ldg128={n(r'LDG[.A-Z]*128')} "
                f"ldg16={n(r'LDG[.A-Z]*U16')} wgmma={n('HGMMA')} mma={n('HMMA')}")

    for dt, prec in (("bf16", "tf32"), ("fp32", "ieee")):
        # q, k, v, the caches; block tables, context lens, slots; q/k norm weights, cos, sin, eps;
        # out, the split partials, scale; num_splits and the 10 strides
        d_types = (["*" + dt] * 5 + ["*i32", "*i32", "*i64"] + ["*" + dt] * 4 + ["fp32", "*" + dt]
                   + ["*fp32", "*fp32", "fp32"] + ["i32"] * 11)
        for page in (16, 256):
            for bn, nw, ns in ((64, 4, 3), (128, 4, 3), (32, 4, 2), (64, 8, 3), (64, 4, 4), (32, 4, 4)):
                # the engine's form: q/k norm + RoPE and the K/V store fused, one sequence per grid row
                consts = dict(KV_HEADS=8, GROUP=2, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, PAGE=page,
                              BLOCK_N=bn, SPLIT=False, STORE=True, NORM_ROPE=True, PRECISION=prec,
                              HEADS_FASTEST=True, F16_DOTS=False, FP8_CACHE=False, PTX_WIDEN=0,
                              PEEL=True)
                print(f"decode  {dt} page={page:3d} n={bn:3d} warps={nw} stages={ns}: "
                      f"{build(_decode_kernel, d_types, consts, nw, ns)}", flush=True)
        p_types = ["*" + dt] * 5 + ["*i32"] * 3 + ["*" + dt, "fp32", "i32"] + ["i32"] * 9
        for page in (16, 256):
            configs = [(bm, bn, nw, ns, pack) for bm, bn, nw, ns in (
                (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3),
                (128, 64, 8, 2)) for pack in (1, 2)]
            if dt == "fp32":
                configs = ((32, 16, 4, 2, 2),)
            for bm, bn, nw, ns, pack in configs:
                consts = dict(KV_HEADS=8, GROUP=2, HEAD_DIM=128, BLOCK_D=128, PAGE=page, BLOCK_M=bm,
                              BLOCK_N=bn, PACK=pack, PRECISION=prec)
                try:
                    r = build(_prefill_kernel, p_types, consts, nw, ns)
                except Exception as e:  # e.g. more shared memory than the SM has
                    r = f"does not build: {type(e).__name__}"
                print(f"prefill {dt} page={page:3d} m={bm} n={bn} warps={nw} stages={ns} pack={pack}: {r}",
                      flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true", help="compile-only resource report (no GPU needed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-cases", type=int, default=8)
    ap.add_argument("--cpu-smoke", action="store_true", help="lengths / 50 on CPU, under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.sass:
        return sass_report()
    if args.cpu_smoke:
        return gpu_checks(args.seed, args.random_cases, torch.device("cpu"), shrink=50)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked (use --sass for the compile-only report)")
        return 1
    t0 = time.time()
    rc = gpu_checks(args.seed, args.random_cases, torch.device("cuda"))
    print(f"gpu_kernel_check: {time.time() - t0:.0f} s on {torch.cuda.get_device_name()}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
