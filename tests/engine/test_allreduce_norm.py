"""The all-reduce + residual add + RMSNorm kernel's protocol on the CPU, under Triton's interpreter
(TRITON_INTERPRET=1, in a process of its own): two ranks simulated one after the other over two host buffers, the
other rank's part landing before this rank's kernel runs, as it would arrive over NVLink. Over forwards of 3, 16, 1
and 8 rows and 1, 2 or 4 planes: both ranks get the same values, the residual stream equals torch's sum in rank
order, the norm torch's RMSNorm, and after each call the previous call's slot is empty again on both ranks.
float32 activations: the interpreter rounds to bfloat16 by truncation, which would test the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from infertrace.engine.kernels import allreduce_norm as an

    world, hidden, eps = 2, 96, 1e-6
    rows_cap, slots = an.MAX_ROWS, an.SLOTS
    buffers = [torch.empty(slots * world * rows_cap * hidden) for _ in range(world)]
    for b in buffers:
        b.view(torch.int32).fill_(an.EMPTY_BITS)
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    epoch = torch.zeros(1, dtype=torch.int64)
    weight = torch.randn(hidden, generator=torch.Generator().manual_seed(1))
    slot_size = world * rows_cap * hidden


    def planes_sum(planes):  # in plane order, as the kernel adds them
        total = planes[0].clone()
        for plane in planes[1:]:
            total += plane
        return total


    gen = torch.Generator().manual_seed(2)
    checked = 0
    for forward, rows in enumerate([3, 16, 1, 8]):
        epoch += 1
        calls = 3
        residual = [torch.randn(rows, hidden, generator=gen)] * 2
        residual = [residual[0].clone(), residual[0].clone()]
        expected_residual = residual[0].clone()
        for call in range(calls):
            split = [1, 2, 4][call]
            parts = [torch.randn(split, rows, hidden, generator=gen) for _ in range(world)]
            parts[1][:, 0, :5] = 0.0  # a sum of zeros
            parts[1][0, 0, :5] = -0.0
            k = int(epoch) * calls + call
            slot, previous = k % 3, (k + 2) % 3
            # rank 1's part lands in rank 0's buffer first, as if rank 1 had pushed it
            rank1 = planes_sum(parts[1])
            rank1 = torch.where(rank1 == 0, torch.zeros_like(rank1), rank1)
            at = slot * slot_size + rows_cap * hidden
            buffers[0][at : at + rows * hidden] = rank1.flatten()
            outs = []
            for rank in range(world):  # rank 0 pushes into both buffers, then rank 1 does
                out = torch.empty(rows, hidden)
                an._allreduce_add_rmsnorm_kernel[(rows,)](
                    parts[rank].contiguous(), rows * hidden, addresses, epoch, call, calls, residual[rank], weight,
                    out, rows, hidden, eps, PLANES=split, RANK=rank, WORLD=world, MAX_ROWS=rows_cap, BLOCK=128,
                    PDL=False)
                outs.append(out)
            total = planes_sum(parts[0]) + planes_sum(parts[1])  # each rank's planes, then the ranks in order
            expected_residual = total + expected_residual
            x = expected_residual
            expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
            assert torch.equal(outs[0], outs[1]) and torch.equal(residual[0], residual[1]), "the ranks differ"
            assert torch.equal(residual[0], expected_residual), (forward, call)
            torch.testing.assert_close(outs[0], expected, rtol=1e-5, atol=1e-5)
            for b in buffers:
                assert (b.view(torch.int32)[previous * slot_size : (previous + 1) * slot_size] == an.EMPTY_BITS).all()
            checked += 1
    print("CHECKED", checked)
""")


def test_two_ranks_one_after_the_other_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CHECKED 12" in out.stdout
