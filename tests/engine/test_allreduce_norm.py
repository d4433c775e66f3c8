"""The all-reduce + residual add + RMSNorm kernel's protocol on the CPU, under Triton's interpreter
(TRITON_INTERPRET=1, in a process of its own): two or four ranks simulated one after the other over host buffers,
the later ranks' parts landing in a rank's buffer before its kernel runs, as they would arrive over NVLink. Over
forwards of 3, 16, 1 and 8 rows and 1, 2 or 4 planes, each row in one program or spread over three, the ranks' parts
pulled one after another or all at once: every rank gets the same values, the residual stream equals torch's sum in
rank order, the norm torch's RMSNorm, and after each call the previous call's slot is empty again in every rank's
buffer.
Activations in float32, and in float16 where the parts are pushed in 16 bits: the interpreter rounds to bfloat16
by truncation, which would test the interpreter."""

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
    from infertrace.engine.kernels import allreduce_norm as an

    world, hidden, eps = int(sys.argv[1]), 96, 1e-6
    chunk = {1: 128, 2: 64, 3: 32}[int(sys.argv[2])]  # a row's columns a program pushes: 1, 2 or 3 programs a row
    pull_all = sys.argv[3] == "all"  # every rank's part read at once, or one rank after another
    half = sys.argv[4] == "half"  # the parts pushed in float16 (the activations' dtype), or in float32
    dtype = torch.float16 if half else torch.float32
    bits, empty_bits = (torch.int16, an.EMPTY_HALF_BITS) if half else (torch.int32, an.EMPTY_BITS)
    rows_cap, slots = an.MAX_ROWS, an.SLOTS
    buffers = [torch.empty(slots * world * rows_cap * hidden) for _ in range(world)]
    for b in buffers:
        b.view(bits).fill_(empty_bits)
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    epoch = torch.zeros(1, dtype=torch.int64)
    weight = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    slot_size = world * rows_cap * hidden


    def planes_sum(planes):  # in plane order, as the kernel adds them; a 16-bit part rounded to its dtype
        total = planes[0].clone()
        for plane in planes[1:]:
            total += plane
        return total.to(dtype).float()


    gen = torch.Generator().manual_seed(2)
    checked = 0
    for forward, rows in enumerate([3, 16, 1, 8]):
        epoch += 1
        calls = 3
        start = torch.randn(rows, hidden, generator=gen).to(dtype)
        residual = [start.clone() for _ in range(world)]
        expected_residual = start.clone()
        for call in range(calls):
            split = [1, 2, 4][call]
            parts = [torch.randn(split, rows, hidden, generator=gen) for _ in range(world)]
            parts[-1][:, 0, :5] = 0.0  # a sum of zeros
            parts[-1][0, 0, :5] = -0.0
            k = int(epoch) * calls + call
            slot, previous = k % 3, (k + 2) % 3
            outs = []
            for rank in range(world):  # each rank pushes into every buffer, one rank after another
                for later in range(rank + 1, world):  # their parts land in this rank's buffer before it polls
                    part = planes_sum(parts[later]).to(dtype)
                    part = torch.where(part == 0, torch.zeros_like(part), part)  # -0.0 marks an empty entry
                    at = slot * slot_size + later * rows_cap * hidden
                    buffers[rank].view(dtype)[at : at + rows * hidden] = part.flatten()
                out = torch.empty(rows, hidden, dtype=dtype)
                # the interpreter runs the programs one after another, every row's earlier slices before the last
                an._allreduce_add_rmsnorm_kernel[(-(-hidden // chunk), rows)](
                    parts[rank].contiguous(), rows * hidden, addresses, epoch, call, calls, residual[rank], weight,
                    out, rows, hidden, eps, PLANES=split, RANK=rank, WORLD=world, MAX_ROWS=rows_cap, BLOCK=128,
                    CHUNK=chunk, PDL=False, PULL_ALL=pull_all, HALF=half)
                outs.append(out)
            total = planes_sum(parts[0])  # each rank's planes, then the ranks in order
            for rank in range(1, world):
                total = total + planes_sum(parts[rank])
            expected_residual = (total.to(dtype).float() + expected_residual.float()).to(dtype)
            x = expected_residual.float()
            normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
            expected = (weight.float() * normed.float()).to(dtype)
            for rank in range(1, world):
                assert torch.equal(outs[0], outs[rank]) and torch.equal(residual[0], residual[rank]), rank
            assert torch.equal(residual[0], expected_residual), (forward, call)
            torch.testing.assert_close(outs[0], expected, rtol=1e-5 if not half else 1e-3, atol=1e-5 if not half else 1e-3)
            for b in buffers:
                assert (b.view(bits)[previous * slot_size : (previous + 1) * slot_size] == empty_bits).all()
            checked += 1
    print("CHECKED", checked)
""")


@pytest.mark.parametrize(("world", "parts", "pull", "payload"), [
    (2, 1, "each", "float32"), (4, 1, "each", "float32"), (2, 3, "each", "float32"), (2, 3, "all", "float32"),
    (4, 1, "all", "float32"), (2, 3, "each", "half"), (4, 3, "all", "half")])
def test_ranks_one_after_the_other_under_the_interpreter(world, parts, pull, payload):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(world), str(parts), pull, payload], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CHECKED 12" in out.stdout


def test_every_part_is_read_at_once_where_the_block_fits():
    from types import SimpleNamespace

    from infertrace.engine.kernels import allreduce_norm as an

    def pulls_all(world, pull, hidden=5120):
        return an.PushBuffers.pulls_all(SimpleNamespace(world_size=world, hidden_size=hidden), pull)

    assert [pulls_all(w, an.pull_rule(w)) for w in (2, 4)] == [False, True]  # two ranks measured slower at once
    assert pulls_all(2, "all") and not pulls_all(4, "each")
    assert not pulls_all(8, "all")  # 8 x 8192 values (a row of 5120 in a power-of-two block): more than it holds
    assert pulls_all(8, "all", 2560) and not pulls_all(6, "all", 2560)  # the ranks a power of two
