"""The peer-memory all-gather kernel's protocol on the CPU, under Triton's interpreter (TRITON_INTERPRET=1, in a
process of its own): two or four ranks simulated one after the other over host buffers, the later ranks' columns
landing in a rank's buffer before its kernel runs, as they would arrive over NVLink. Over calls of 3, 16, 1, 8 and
5 rows, rows cut into several programs' columns (the last one ragged): every rank gets every rank's columns side
by side, a -0.0 arrives as +0.0 and nothing else changes, and after each call the previous call's slot is empty
again in every rank's buffer. In float16 (the interpreter has no bfloat16 of its own; the kernel moves bits)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from infertrace.engine.kernels import allgather as ag
    from infertrace.engine.kernels.allreduce_norm import EMPTY_HALF_BITS, MAX_ROWS, SLOTS

    world, cols, chunk = int(sys.argv[1]), 200, 64  # four programs a row, the last one 8 columns
    dtype = torch.float16
    buffers = [torch.empty(SLOTS * world * MAX_ROWS * cols, dtype=dtype) for _ in range(world)]
    for b in buffers:
        b.view(torch.int16).fill_(EMPTY_HALF_BITS)
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    slot_rows = [torch.zeros(SLOTS, dtype=torch.int32) for _ in range(world)]
    slot_size = world * MAX_ROWS * cols
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for call, rows in enumerate([3, 16, 1, 8, 5]):
        parts = [torch.randn(rows, cols, generator=gen).to(dtype) for _ in range(world)]
        parts[-1][0, :4] = -0.0
        parts[0][rows - 1, -3:] = 0.0
        k = call + 1  # the counter as each call moves it on before its kernel
        slot, previous = k % 3, (k + 2) % 3
        outs = []
        for rank in range(world):
            counts[rank] += 1
            for later in range(rank + 1, world):  # their columns land in this rank's buffer before it reads
                part = torch.where(parts[later] == 0, torch.zeros_like(parts[later]), parts[later])
                at = slot * slot_size + later * MAX_ROWS * cols
                buffers[rank][at : at + rows * cols] = part.flatten()
            out = torch.full((rows, world * cols), float("nan"), dtype=dtype)
            ag._allgather_kernel[(-(-cols // chunk), rows)](
                parts[rank], addresses, counts[rank], slot_rows[rank], out, rows, cols, out.stride(0),
                RANK=rank, WORLD=world, MAX_ROWS=MAX_ROWS, CHUNK=chunk, PDL=False)
            outs.append(out)
        want = torch.cat([torch.where(p == 0, torch.zeros_like(p), p) for p in parts], dim=1)
        for rank in range(world):
            assert torch.equal(outs[rank].view(torch.int16), want.view(torch.int16)), (call, rank)
            assert int(slot_rows[rank][slot]) == rows
        assert not torch.signbit(outs[0][0, (world - 1) * cols : (world - 1) * cols + 4]).any()  # -0.0 came as +0.0
        for b in buffers:
            assert (b.view(torch.int16)[previous * slot_size : (previous + 1) * slot_size] == EMPTY_HALF_BITS).all()
        checked += 1
    print("CHECKED", checked)
""")


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_one_after_the_other_under_the_interpreter(world):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(world)], capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CHECKED 5" in out.stdout
