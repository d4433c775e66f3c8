"""Attention kernel timing on a GPU machine: decode against the bytes it must read, prefill against the FLOPs it
must do (ours over the paged cache, and PyTorch's built-in flash kernels over contiguous K/V for comparison).

Usage: python benchmarks/kernels_bench.py [--only decode,prefill,sweep,fp8,splits,widen,qknorm,order,prefill_tiling]
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch
import triton

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/kernels_bench.py` too
from benchmarks.common import copy_bandwidth  # noqa: E402
from infertrace.engine.attention import TritonAttention  # noqa: E402
from infertrace.engine.config import DEFAULT_CUDA_GRAPH_TOKEN_SIZES
from infertrace.engine.kernels.paged_attention import paged_attention
from infertrace.engine.kernels.tiles import attention_tile_array, decode_order, max_attention_tiles


def decode_case(bs: int, ctx: int | list[int], heads: int, kv_heads: int, dim: int, splits: int,
                tiling: tuple[int, int, int] | None = None,
                kv_dtype: torch.dtype = torch.bfloat16, ordered: bool = False, **kernel_args) -> tuple[float, float]:
    """(microseconds, bytes/s of K/V read) of one decode step's attention replayed from a CUDA graph. `ctx` is every
    row's context, or a list of one per row (`bs` is then its length); `ordered` launches them longest first."""
    block_size = 16
    lens = [ctx] * bs if isinstance(ctx, int) else list(ctx)
    bs = len(lens)
    blocks_per_seq = (max(lens) + block_size - 1) // block_size
    k_cache = torch.randn(bs * blocks_per_seq + 8, block_size, kv_heads, dim, device="cuda").to(kv_dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(kv_dtype)
    block_tables = torch.randperm(bs * blocks_per_seq, device="cuda").int().view(bs, blocks_per_seq)
    q = torch.randn(bs, heads, dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(bs + 1, device="cuda", dtype=torch.int32)
    ctx_t = torch.tensor(lens, device="cuda", dtype=torch.int32)
    order = torch.from_numpy(decode_order(lens, bs)).cuda() if ordered else None
    out = torch.empty_like(q)
    fn = lambda: paged_attention(q, k_cache, v_cache, cu, ctx_t, block_tables, 1, dim**-0.5, out=out,
                                 num_splits=splits, tiling=tiling, seq_order=order, **kernel_args)
    ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")
    nbytes = 2 * sum(lens) * kv_heads * dim * k_cache.element_size()
    return ms * 1e3, nbytes / (ms * 1e-3)


def torch_varlen():
    """PyTorch's flash varlen entry point and the keyword that makes it causal, or (None, reason)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return None, f"torch.nn.attention.varlen: {exc}"
    params = inspect.signature(varlen_attn).parameters
    gqa = ", enable_gqa" if "enable_gqa" in params else ""
    if "window_size" in params:
        return (lambda *a, **k: varlen_attn(*a, window_size=(-1, 0), **k)), "window_size=(-1, 0)" + gqa
    if "is_causal" in params:
        return (lambda *a, **k: varlen_attn(*a, is_causal=True, **k)), "is_causal=True" + gqa
    return None, f"no causal switch in varlen_attn{inspect.signature(varlen_attn)}"


def prefill_case(bs: int, prefix: int, new: int, heads: int, kv_heads: int, dim: int) -> dict[str, float | str]:
    """Each of `bs` requests attends `new` query tokens over `prefix` cached tokens plus themselves (causal)."""
    block_size = 16
    ctx = prefix + new
    blocks_per_seq = -(-ctx // block_size)
    dt = torch.bfloat16
    k_cache = torch.randn(bs * blocks_per_seq, block_size, kv_heads, dim, device="cuda", dtype=dt)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(bs * blocks_per_seq, device="cuda").int().view(bs, blocks_per_seq)
    q = torch.randn(bs * new, heads, dim, device="cuda", dtype=dt)
    cu_q = torch.arange(0, bs * new + 1, new, device="cuda", dtype=torch.int32)
    ctx_t = torch.full((bs,), ctx, device="cuda", dtype=torch.int32)
    scale = dim**-0.5
    flops = 4 * bs * heads * dim * (new * prefix + new * (new + 1) / 2)
    ours = triton.testing.do_bench(lambda: paged_attention(q, k_cache, v_cache, cu_q, ctx_t, block_tables, new, scale),
                                   return_mode="median")
    result: dict[str, float | str] = {"ours_ms": ours, "ours_tflops": flops / ours / 1e9}
    varlen, how = torch_varlen()
    if varlen is None or prefix:
        result["torch"] = how if varlen is None else "n/a (contiguous K/V only here)"
        return result
    k = torch.randn(bs * ctx, kv_heads, dim, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    cu_k = torch.arange(0, bs * ctx + 1, ctx, device="cuda", dtype=torch.int32)
    gqa = {"enable_gqa": True}
    if "enable_gqa" not in how:  # an older varlen_attn without GQA: K/V repeated to the query heads, untimed
        k, v, gqa = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1), {}
        how += ", K/V repeated to the query heads (untimed)"
    try:
        fn = lambda: varlen(q, k, v, cu_q, cu_k, new, ctx, scale=scale, **gqa)
        fn()
    except (RuntimeError, TypeError) as exc:  # an older signature or a GPU the kernel does not support
        result["torch"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return result
    ms = triton.testing.do_bench(fn, return_mode="median")
    result.update(torch_ms=ms, torch_tflops=flops / ms / 1e9, torch=how)
    return result


def prefill_tiling_sweep() -> None:
    """Prefill and mixed steps' attention as the token-count graphs run it (a tile list fixed by the bucket, 256
    sequences at most, the bucket the engine's default list gives the step's token count): a 512-token prefill
    alone, with 7 decodes, and two 256-token chunks with 16 decodes, for qwen3-0.6b's and 4b's heads over a bf16 and an 8-bit cache; the kernel's default tiling against the best few of
    (BLOCK_M, BLOCK_N, warps, stages), four warps (eight were never among the best in a wider sweep)."""
    import random

    rng = random.Random(1)
    mixes = {"512": ([512], [512]),
             "512 + 7 decodes": ([512] + [1] * 7, [512] + [rng.randrange(200, 500) for _ in range(7)]),
             "2 x 256 + 16 decodes": ([256, 256] + [1] * 16, [256, 700] + [rng.randrange(200, 900) for _ in range(16)])}
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for heads, kv_heads in ((16, 8), (32, 8)):
            for mix, (qlens, ctxs) in mixes.items():
                bucket = min(b for b in DEFAULT_CUDA_GRAPH_TOKEN_SIZES if b >= sum(qlens))
                us = {tiling: prefill_tiles_case(qlens, ctxs, heads, kv_heads, bucket, tiling, kv_dtype)
                      for tiling in [None] + [(bm, bn, 4, st) for bm in (32, 64, 128) for bn in (32, 64, 128)
                                              for st in (2, 3)]}
                best = sorted((t, k) for k, t in us.items() if k is not None and t is not None)[:4]
                print(f"{str(kv_dtype)[6:]} {heads}/{kv_heads} heads, {mix}: default {us[None]:.1f} us; best "
                      + "  ".join(f"{t:.1f} {k}" for t, k in best), flush=True)


def prefill_tiles_case(qlens: list[int], ctxs: list[int], heads: int, kv_heads: int, bucket: int,
                       tiling: tuple[int, int, int, int] | None, kv_dtype: torch.dtype) -> float | None:
    """Microseconds of one tile-list attention call (CUDA graph), or None where the tiling does not compile."""
    block_size, dim = 16, 128
    group = heads // kv_heads
    blocks = [-(-c // block_size) for c in ctxs]
    k_cache = torch.randn(sum(blocks) + 8, block_size, kv_heads, dim, device="cuda").to(kv_dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(kv_dtype)
    block_tables = torch.zeros(len(ctxs), max(blocks), dtype=torch.int32, device="cuda")
    perm, used = torch.randperm(sum(blocks), device="cuda").int(), 0
    for i, n in enumerate(blocks):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(bucket, heads, dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx_t = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    block_m = 64 if tiling is None else tiling[0]
    tiles = attention_tile_array(torch.tensor(qlens).numpy(), group, block_m,
                                 max_attention_tiles(bucket, 256, group, block_m))
    tile_seq, tile_index = (torch.from_numpy(t).cuda() for t in tiles)
    out = torch.empty_like(q)
    fn = lambda: paged_attention(q, k_cache, v_cache, cu, ctx_t, block_tables, max(qlens), dim**-0.5, out=out,
                                 tiles=(tile_seq, tile_index, block_m), tiling=None if tiling is None else tiling[1:])
    try:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
    except Exception as exc:  # a tiling past the GPU's shared memory
        if "OutOfResources" not in type(exc).__name__ and "shared memory" not in str(exc):
            raise
        return None


def decode_sweep() -> None:
    """Decode attention at batch 8 (qwen3-4b heads) over splits and tilings; the best few per context length."""
    for ctx in (128, 384, 640):
        results = []
        for splits in (1, 2, 3, 4, 5, 8):
            for block_n in (16, 32, 64):
                for warps in (1, 2, 4):
                    for stages in (1, 2):
                        us, _ = decode_case(8, ctx, 32, 8, 128, splits, (block_n, warps, stages))
                        results.append((us, splits, block_n, warps, stages))
        results.sort()
        default = decode_case(8, ctx, 32, 8, 128, TritonAttention(batch_buckets=(8,)).decode_splits(8, 8))[0]
        print(f"ctx {ctx}: current default {default:.1f} us; best (us, splits, BLOCK_N, warps, stages): "
              + "  ".join(f"{r[0]:.1f} {r[1:]}" for r in results[:5]), flush=True)


def fp8_sweep() -> None:
    """Decode attention over an 8-bit cache (float16 dots under a bf16 q) against the bf16 cache, at large batches
    (qwen3-0.6b heads): the kernel's default tiling for it, and the best few of a sweep."""
    for bs, ctx in ((256, 640), (128, 1200), (32, 1500)):
        base, bw = decode_case(bs, ctx, 16, 8, 128, 1)
        default, _ = decode_case(bs, ctx, 16, 8, 128, 1, None, torch.float8_e4m3fn)
        results = []
        for block_n in (32, 64, 128):
            for warps in (2, 4):
                for stages in (2, 3, 4):
                    us, fbw = decode_case(bs, ctx, 16, 8, 128, 1, (block_n, warps, stages), torch.float8_e4m3fn)
                    results.append((us, block_n, warps, stages, fbw))
        results.sort()
        print(f"bs {bs} ctx {ctx}: bf16 cache {base:.1f} us ({bw / 1e12:.2f} TB/s); fp8 cache {default:.1f} us "
              f"({base / default:.2f}x); best fp8 (us, BLOCK_N, warps, stages, bytes/s): "
              + "  ".join(f"{r[0]:.1f} {r[1:4]} {r[4] / 1e12:.2f}" for r in results[:4]), flush=True)


def _timed(fn, *args, **kwargs):
    """fn(*args, **kwargs), or None for a tiling that does not compile (too much shared memory)."""
    try:
        return fn(*args, **kwargs)
    except triton.runtime.errors.OutOfResources:
        return None


def decode_layers_case(bs: int, ctx: int, heads: int, kv_heads: int, layers: int, splits: int,
                       tiling: tuple[int, int, int] | None) -> float:
    """Microseconds per layer of a decode step's attention as the engine runs it: one CUDA graph of `layers`
    launches with programmatic dependent launch, each over its own layer's cache, so a layer's KV is no longer in L2
    when it is read again (a single repeated launch would read it from L2 at small batches)."""
    from infertrace.engine.kernels import launch

    launch.set_enabled(True)
    dim, block_size = 128, 16
    blocks = bs * -(-ctx // block_size)
    shape = (blocks, block_size, kv_heads, dim)
    caches = [(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
               torch.randn(shape, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
    block_tables = torch.randperm(blocks, device="cuda").int().view(bs, -1)
    q = torch.randn(bs, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu = torch.arange(bs + 1, device="cuda", dtype=torch.int32)
    ctx_t = torch.full((bs,), ctx, device="cuda", dtype=torch.int32)
    workspace = (torch.empty((splits, bs, heads, dim), device="cuda"), torch.empty((splits, bs, heads), device="cuda"))

    def step():
        for k, v in caches:
            paged_attention(q, k, v, cu, ctx_t, block_tables, 1, dim**-0.5, out=out, num_splits=splits,
                            workspace=workspace if splits > 1 else None, tiling=tiling)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    launch.set_enabled(False)
    return start.elapsed_time(end) * 1e3 / (20 * layers)


def splits_probe() -> None:
    """Batch-8 decode attention (qwen3-4b: 32 heads over 8 KV heads, 36 layers) as a decode graph runs it, at the
    benchmark's mean context: the engine's current choice and the best few of splits x tiling."""
    current = TritonAttention(batch_buckets=(8,))
    ctx = 384
    base = decode_layers_case(8, ctx, 32, 8, 36, current.decode_splits(8, 8), None)
    results = []
    for splits in (1, 2, 3, 4, 5, 8):
        for tiling in ((16, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (128, 4, 3)):
            r = _timed(decode_layers_case, 8, ctx, 32, 8, 36, splits, tiling)
            if r is not None:
                results.append((r, splits, tiling))
    results.sort()
    print(f"bs 8 ctx {ctx}: current {base:.2f} us a layer; best (us, splits, tiling): "
          + "  ".join(f"{r[0]:.2f} {r[1:]}" for r in results[:6]), flush=True)


def fp8_widen_probe() -> None:
    """Decode attention over an 8-bit cache (qwen3-0.6b heads) by how it is widened to float16 (`widen`: casts, or
    the conversion instruction for V) over a few tilings."""
    for bs, ctx in ((256, 640), (128, 1200)):
        results = []
        for tiling in ((128, 4, 4), (128, 4, 2), (64, 4, 2), (64, 4, 3), (128, 8, 2)):
            for widen in ("cast", "asm_v"):
                r = _timed(decode_case, bs, ctx, 16, 8, 128, 1, tiling, torch.float8_e4m3fn, widen=widen)
                if r is not None:
                    results.append((r[0], tiling, widen, r[1]))
        results.sort()
        print(f"bs {bs} ctx {ctx} fp8 (us, tiling, widen, TB/s): "
              + "  ".join(f"{r[0]:.1f} {r[1]} {r[2]} {r[3] / 1e12:.2f}" for r in results), flush=True)


def order_probe() -> None:
    """Decode attention over mixed contexts (qwen3-0.6b heads, contexts uniform in [200, 2000] as late in the
    nano-vllm workload) launched in row order and longest context first, with the engine's split count."""
    import random

    for kv_dtype in (torch.float8_e4m3fn, torch.bfloat16):
        for bs in (256, 128, 64, 32, 16):
            rng = random.Random(bs)
            lens = [rng.randint(200, 2000) for _ in range(bs)]
            splits = TritonAttention(batch_buckets=(bs,)).decode_splits(bs, 8)
            row_us, row_bw = decode_case(bs, lens, 16, 8, 128, splits, kv_dtype=kv_dtype)
            first_us, first_bw = decode_case(bs, lens, 16, 8, 128, splits, kv_dtype=kv_dtype, ordered=True)
            print(f"{str(kv_dtype)[6:]} bs {bs} splits {splits}: row order {row_us:.1f} us ({row_bw / 1e12:.2f} TB/s), "
                  f"longest first {first_us:.1f} us ({first_bw / 1e12:.2f} TB/s), {row_us / first_us:.3f}x", flush=True)


def qk_norm_timing() -> None:
    """The fused q/k RMSNorm + RoPE with its KV write: one call replayed from a CUDA graph, at a decode batch of the
    nano-vllm workload, a batch-8 qwen3-4b decode step and a 2,048-token prefill."""
    from infertrace.engine.kernels.fused import qk_norm_rope

    shapes = ((256, 16, 8, torch.float8_e4m3fn), (8, 32, 8, torch.bfloat16), (2048, 16, 8, torch.bfloat16))
    for t, hq, hkv, kv in shapes:
        d = 128
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
        cos, sin = torch.randn(40960, d, device="cuda"), torch.randn(40960, d, device="cuda")
        pos = torch.randint(0, 40960, (t,), device="cuda")
        k_cache = torch.zeros(200000, hkv, d, device="cuda", dtype=kv)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(200000, device="cuda")[:t]
        ms = triton.testing.do_bench_cudagraph(
            lambda: qk_norm_rope(qkv, hq, hkv, d, w, w, 1e-6, cos, sin, pos, kv_cache=(k_cache, v_cache, slots)),  # noqa: B023
            return_mode="median")
        print(f"qk_norm_rope {t} tokens, {hq} + {hkv} heads, {str(kv)[6:]} cache: {ms * 1e3:.2f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="decode,prefill")
    only = set(ap.parse_args().only.split(","))
    peak = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {peak / 1e12:.2f} TB/s")
    if "prefill" in only:
        print(f"{'bs':>4} {'prefix':>6} {'new':>6} {'heads':>6} {'ours ms':>8} {'TFLOP/s':>8} {'torch ms':>8} "
              f"{'TFLOP/s':>8}  note")
        for bs, prefix, new, heads, kvh in [(1, 0, 1024, 32, 8), (4, 0, 2048, 32, 8), (1, 0, 8192, 32, 8),
                                            (1, 0, 8192, 16, 8), (1, 8192, 8192, 16, 8), (1, 57344, 8192, 16, 8)]:
            r = prefill_case(bs, prefix, new, heads, kvh, 128)
            torch_cols = (f"{r['torch_ms']:>8.3f} {r['torch_tflops']:>8.0f}" if "torch_ms" in r else f"{'-':>8} {'-':>8}")
            print(f"{bs:>4} {prefix:>6} {new:>6} {heads:>6} {r['ours_ms']:>8.3f} {r['ours_tflops']:>8.0f} "
                  f"{torch_cols}  {r['torch']}")
    sweeps = {"sweep": decode_sweep, "fp8": fp8_sweep, "splits": splits_probe, "widen": fp8_widen_probe,
              "qknorm": qk_norm_timing, "order": order_probe, "prefill_tiling": prefill_tiling_sweep}
    for name, sweep in sweeps.items():
        if name in only:
            sweep()
    if "decode" not in only:
        return
    print(f"{'bs':>4} {'ctx':>6} {'heads':>6} {'splits':>6} {'us':>8} {'GB/s':>8} {'% copy bw':>9}")
    for bs, ctx, heads, kvh, splits in [(8, 640, 32, 8, 1), (8, 640, 32, 8, 4), (8, 4096, 32, 8, 1),
                                        (8, 4096, 32, 8, 8), (64, 1024, 16, 8, 1), (256, 1024, 16, 8, 1),
                                        (1, 8192, 32, 8, 16)]:
        us, bw = decode_case(bs, ctx, heads, kvh, 128, splits)
        print(f"{bs:>4} {ctx:>6} {heads:>6} {splits:>6} {us:>8.1f} {bw / 1e9:>8.0f} {100 * bw / peak:>8.0f}%")


if __name__ == "__main__":
    main()
