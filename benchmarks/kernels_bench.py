"""Decode-attention kernel timing against the bytes it must read (run on a GPU machine).

Usage: python benchmarks/kernels_bench.py
"""

from __future__ import annotations

import torch
import triton

from infertrace.engine.kernels.paged_attention import paged_attention


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() * 2 / (ms * 1e-3)


def decode_case(bs: int, ctx: int, heads: int, kv_heads: int, dim: int, splits: int) -> tuple[float, float]:
    block_size = 16
    blocks_per_seq = (ctx + block_size - 1) // block_size
    k_cache = torch.randn(bs * blocks_per_seq + 8, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(bs * blocks_per_seq, device="cuda").int().view(bs, blocks_per_seq)
    q = torch.randn(bs, heads, dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(bs + 1, device="cuda", dtype=torch.int32)
    ctx_t = torch.full((bs,), ctx, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    fn = lambda: paged_attention(q, k_cache, v_cache, cu, ctx_t, block_tables, 1, dim**-0.5, out=out,
                                 num_splits=splits)
    ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")
    nbytes = 2 * bs * ctx * kv_heads * dim * 2
    return ms * 1e3, nbytes / (ms * 1e-3)


def main() -> None:
    peak = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {peak / 1e12:.2f} TB/s")
    print(f"{'bs':>4} {'ctx':>6} {'heads':>6} {'splits':>6} {'us':>8} {'GB/s':>8} {'% copy bw':>9}")
    for bs, ctx, heads, kvh, splits in [(8, 640, 32, 8, 1), (8, 640, 32, 8, 4), (8, 4096, 32, 8, 1),
                                        (8, 4096, 32, 8, 8), (64, 1024, 16, 8, 1), (256, 1024, 16, 8, 1),
                                        (1, 8192, 32, 8, 16)]:
        us, bw = decode_case(bs, ctx, heads, kvh, 128, splits)
        print(f"{bs:>4} {ctx:>6} {heads:>6} {splits:>6} {us:>8.1f} {bw / 1e9:>8.0f} {100 * bw / peak:>8.0f}%")


if __name__ == "__main__":
    main()
