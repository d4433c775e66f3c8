"""Decode attention over KV splits with the splits merged by the last of them to finish (`merge_counts`) instead of
a merge kernel, on the CPU under Triton's interpreter (TRITON_INTERPRET=1, in a process of its own): the same bits
as the merge kernel's, in launch order by sequence and longest first, over contexts one split covers, contexts a
few splits cover (empty splits after them) and long ones; the counts back at zero after each call, so a second call
over the same counts (a graph replayed, the next layer) merges again. The split workspace starts as NaN each time,
so a merge that read a split before it was written would show. In float16 (the interpreter has no bfloat16)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = (Path(__file__).parent / "interpreter_numpy.py").read_text() + textwrap.dedent("""
    import torch
    from infertrace.engine.kernels.paged_attention import paged_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, splits = 8, 2, 32, 16, 4
    ctx = [1, 50, 64, 65, 300, 700, 129]
    n = len(ctx)
    blocks = [-(-c // block_size) for c in ctx]
    dtype = torch.float16
    k_cache = (torch.randn(sum(blocks) + 3, block_size, kv_heads, dim) / 2).to(dtype)
    v_cache = torch.randn(sum(blocks) + 3, block_size, kv_heads, dim).to(dtype)
    order = torch.randperm(sum(blocks) + 3)[:sum(blocks)].int()  # blocks scattered over the cache
    tables = torch.zeros(n, max(blocks), dtype=torch.int32)
    at = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = order[at:at + b]
        at += b
    cu = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    longest_first = torch.argsort(lens, descending=True).int()
    counts = torch.zeros(n * kv_heads, dtype=torch.int32)
    checked = 0
    for call in range(2):
        q = torch.randn(n, heads, dim).to(dtype)
        for seq_order in (None, longest_first):
            outs = []
            for counted in (None, counts):
                workspace = (torch.full((splits, n, heads, dim), float("nan")),
                             torch.full((splits, n, heads), float("nan")))
                outs.append(paged_attention(q, k_cache, v_cache, cu, lens, tables, 1, dim ** -0.5,
                                            num_splits=splits, workspace=workspace, seq_order=seq_order,
                                            merge_counts=counted))
                assert not (counts != 0).any(), counts
            by_kernel, by_last = outs
            assert not by_kernel.isnan().any()
            assert torch.equal(by_kernel.view(torch.int16), by_last.view(torch.int16)), (call, seq_order)
            checked += 1
    # and the values are attention's (float64 reference)
    for i, c in enumerate(ctx):
        slots = (tables[i, torch.arange(c) // block_size].long() * block_size + torch.arange(c) % block_size)
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[i].double(), k) * dim ** -0.5).softmax(-1)
        torch.testing.assert_close(by_last[i].double(), torch.einsum("hn,nhd->hd", p, v), rtol=2e-3, atol=2e-3)
    print("CHECKED", checked)
""")


def test_the_last_split_merges_as_the_merge_kernel_does():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "CHECKED 4" in out.stdout


def _attention_ptx() -> str:
    """The decode attention with the last split merging, compiled for an H100/H200 (sm_90) on the CPU, as the
    engine launches it for qwen3-14b's TP=4 rank (five query heads a KV head, eight splits, longest first)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from infertrace.engine.kernels.paged_attention import _paged_attention_kernel

    constants = dict(GROUP=5, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=8, PRECISION="tf32",
                     TILE_LIST=False, ORDERED=True, PDL=True, F16_DOTS=False, WIDEN=0, EARLY=True, MERGE_LAST=True)
    pointers = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
                "part_ptr": "*fp32", "lse_ptr": "*fp32", "count_ptr": "*i32"}
    signature = {}
    for name in inspect.signature(_paged_attention_kernel.fn).parameters:
        signature[name] = ("constexpr" if name in constants else pointers.get(name) or
                           ("*i32" if name.endswith("_ptr") else "fp32" if name == "scale" else "i32"))
    source = ASTSource(_paged_attention_kernel, signature, constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
    return compiled.asm["ptx"]


def test_the_count_releases_the_program_s_stores_and_the_merge_reads_past_l1():
    """What the interpreter cannot show, in the instructions: every thread's stores of the split's partial output
    come before a barrier, then one acquire-release atomic add at GPU scope (the count), its result shared through
    a second barrier, and the merge's loads of the other splits' partial outputs bypass L1 (ld.global.cg), where
    another SM's stores would not be seen."""
    lines = [line.strip() for line in _attention_ptx().splitlines()]
    atoms = [i for i, line in enumerate(lines) if "atom." in line]
    assert len(atoms) == 1 and "atom.global.gpu.acq_rel.add" in lines[atoms[0]], [lines[i] for i in atoms]
    atom = atoms[0]
    stores = [i for i, line in enumerate(lines[:atom]) if "st.global" in line]
    barriers = [i for i, line in enumerate(lines) if line.startswith("bar.sync")]
    assert stores and any(stores[-1] < b < atom for b in barriers)
    shared = next(b for b in barriers if b > atom)
    reads = [line for line in lines[shared:] if "ld.global" in line]
    assert reads and all("ld.global.cg" in line for line in reads), reads[:3]
