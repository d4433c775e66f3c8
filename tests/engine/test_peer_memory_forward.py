"""A decode forward's peer-memory calls on ranks that run at the same time, on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, in a process of its own): each rank a forked process over buffers in shared memory (at the
same addresses in every rank, as symmetric memory gives them), so a rank's kernel waits on the others' stores as it
does over NVLink. Two forwards (5 and 3 rows) each make the calls of models/qwen3.py at TP>1 with the all-reduce +
norm kernel: the embedding's lookup shard (`embed_shard`) through the kernel as call 0, two projections' split-K
partial sums as calls 1 and 2, then the logits' all-gather. Every rank gets the same values: the embedding's norm
equal to `embed_rmsnorm`'s over the whole table, the residual stream torch's sums in rank order, the norms torch's
RMSNorm, and every rank's logits side by side. A rank left waiting (a slot numbered differently on two ranks, a
part never pushed) would not finish: the parent gives them 300 s. The projections' parts come as split-K planes, as
the products of the skinny GEMM (its float32 output read by the kernel), or pushed by the GEMM itself
(`all_reduce_push`), which must give the second's values bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = (Path(__file__).parent / "interpreter_numpy.py").read_text() + textwrap.dedent("""
    import os, signal, sys, time, traceback
    import torch
    from infertrace.engine.kernels import allgather as ag
    from infertrace.engine.kernels import allreduce_norm as an
    from infertrace.engine.kernels.norm import embed_shard
    from infertrace.engine.kernels.skinny_gemm import skinny_gemm

    world, hidden, vocab, cols, eps = int(sys.argv[1]), 96, 203, 40, 1e-6
    dtype = torch.float16  # the model's 16-bit dtype; the parts pushed in it
    chunk, calls, forwards = 32, 3, [5, 3]
    gen = torch.Generator().manual_seed(7)
    table = torch.randn(vocab, hidden, generator=gen).to(dtype)
    shard = -(-vocab // world)
    padded = torch.cat([table, table.new_zeros(shard * world - vocab, hidden)])
    norm_w = [torch.randn(hidden, generator=gen).to(dtype) for _ in range(calls)]
    ids = [torch.randint(0, vocab, (rows,), generator=gen) for rows in forwards]
    planes = [[[torch.randn(2, rows, hidden, generator=gen) for _ in range(world)] for _ in range(1, calls)]
              for rows in forwards]
    inner = 64  # a projection's reduction on one rank
    acts = [[[torch.randn(rows, inner, generator=gen).to(dtype) for _ in range(world)] for _ in range(1, calls)]
            for rows in forwards]
    weights = [[(torch.randn(hidden, inner, generator=gen) / 8).to(dtype) for _ in range(world)]
               for _ in range(1, calls)]
    logits = [[torch.randn(rows, cols, generator=gen).to(dtype) for _ in range(world)] for rows in forwards]

    def shared(t):
        return t.share_memory_()  # mapped at the same address in the forked ranks

    def buffers():
        ar = [shared(torch.empty(an.SLOTS * world * an.MAX_ROWS * hidden, dtype=dtype)) for _ in range(world)]
        gb = [shared(torch.empty(an.SLOTS * world * an.MAX_ROWS * cols, dtype=dtype)) for _ in range(world)]
        for b in ar + gb:
            b.view(torch.int16).fill_(an.EMPTY_HALF_BITS)
        return ar, gb

    def results():  # each rank's: per forward, per call the norm's output and the residual after it; the logits
        outs = [[[shared(torch.zeros(rows, hidden, dtype=dtype)) for _ in range(2 * calls)] for rows in forwards]
                for _ in range(world)]
        gathered = [[shared(torch.zeros(rows, world * cols, dtype=dtype)) for rows in forwards] for _ in range(world)]
        return outs, gathered

    def rank_main(rank, mode, ar_addresses, gb_addresses, outs, gathered):
        epoch = torch.zeros(1, dtype=torch.int64)
        count = torch.zeros(1, dtype=torch.int64)
        slot_rows = torch.zeros(an.SLOTS, dtype=torch.int32)
        table_shard = padded[rank * shard:(rank + 1) * shard].contiguous()
        for f, rows in enumerate(forwards):
            epoch += 1
            plane, residual = embed_shard(ids[f], table_shard, rank * shard)
            for call in range(calls):
                pushed = False
                if call == 0:
                    x = plane
                elif mode == "planes":
                    x = planes[f][call - 1][rank].contiguous()
                elif mode == "gemm":  # the skinny GEMM's float32 output, unsplit, read by the kernel
                    x = torch.empty(1, rows, hidden)
                    skinny_gemm(acts[f][call - 1][rank], weights[call - 1][rank], x[0], block_n=32, block_k=32)
                else:  # the GEMM pushes this rank's part itself
                    skinny_gemm(acts[f][call - 1][rank], weights[call - 1][rank], block_n=32, block_k=32,
                                push=(ar_addresses, epoch, call, calls, rank, world, an.MAX_ROWS, True))
                    x, pushed = residual[None], True
                out = torch.empty(rows, hidden, dtype=dtype)
                an._allreduce_add_rmsnorm_kernel[(-(-hidden // chunk), rows)](
                    x, rows * hidden, ar_addresses, epoch, call, calls, residual, norm_w[call], out, rows, hidden,
                    eps, PLANES=x.shape[0], RANK=rank, WORLD=world, MAX_ROWS=an.MAX_ROWS, BLOCK=128, CHUNK=chunk,
                    PDL=False, PULL_ALL=False, HALF=True, PUSHED=pushed)
                outs[rank][f][2 * call].copy_(out)
                outs[rank][f][2 * call + 1].copy_(residual)
            count += 1
            ag._allgather_kernel[(-(-cols // 16), rows)](
                logits[f][rank], gb_addresses, count, slot_rows, gathered[rank][f], rows, cols, world * cols,
                RANK=rank, WORLD=world, MAX_ROWS=an.MAX_ROWS, CHUNK=16, PDL=False)

    def run(mode):  # every rank at once, each a forked process; their results (in shared memory)
        ar, gb = buffers()
        ar_addresses = torch.tensor([b.data_ptr() for b in ar], dtype=torch.int64)
        gb_addresses = torch.tensor([b.data_ptr() for b in gb], dtype=torch.int64)
        outs, gathered = results()
        children = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                signal.alarm(330)  # a rank ends even if this process is killed before it gives up on the ranks
                code = 1
                try:
                    rank_main(rank, mode, ar_addresses, gb_addresses, outs, gathered)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            children.append(pid)
        deadline = time.monotonic() + 300
        codes = {}
        while len(codes) < world and time.monotonic() < deadline:
            for pid in children:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done == pid:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        if len(codes) < world:
            for pid in children:
                if pid not in codes:
                    os.kill(pid, 9)
            sys.exit(f"{mode}: {world - len(codes)} of {world} ranks still waiting after 300 s")
        assert all(code == 0 for code in codes.values()), (mode, codes)
        for f in range(len(forwards)):  # every rank the same values
            for rank in range(world):
                for a, b in zip(outs[0][f], outs[rank][f]):
                    assert torch.equal(a, b), (mode, f, rank)
        return outs, gathered

    def rmsnorm(x, w):
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        return (w.float() * normed.float()).to(dtype)

    outs, gathered = run("planes")
    for f, rows in enumerate(forwards):
        embedding = torch.nn.functional.embedding(ids[f], table)
        assert torch.equal(outs[0][f][1], embedding), f  # the residual stream starts as the lookup, exactly
        torch.testing.assert_close(outs[0][f][0], rmsnorm(embedding, norm_w[0]), rtol=1e-3, atol=1e-3)
        residual = embedding
        for call in range(1, calls):
            total = sum(planes[f][call - 1][r].sum(0).to(dtype).float() for r in range(world))
            residual = (total.to(dtype).float() + residual.float()).to(dtype)
            assert torch.equal(outs[0][f][2 * call + 1], residual), (f, call)
            torch.testing.assert_close(outs[0][f][2 * call], rmsnorm(residual, norm_w[call]), rtol=1e-3, atol=1e-3)
        want = torch.cat([torch.where(p == 0, torch.zeros_like(p), p) for p in logits[f]], dim=1)
        for rank in range(world):
            assert torch.equal(gathered[rank][f], want), (f, rank)
    by_gemm, _ = run("gemm")
    by_push, _ = run("push")
    for f, rows in enumerate(forwards):
        for a, b in zip(by_gemm[0][f], by_push[0][f]):
            assert torch.equal(a, b), f  # pushed by the GEMM: the same bits
        residual = torch.nn.functional.embedding(ids[f], table)
        for call in range(1, calls):
            total = sum((acts[f][call - 1][r].float() @ weights[call - 1][r].float().T).to(dtype).float()
                        for r in range(world))
            residual = (total.to(dtype).float() + residual.float()).to(dtype)
            torch.testing.assert_close(by_push[0][f][2 * call + 1], residual, rtol=2e-3, atol=2e-3)
    print("CHECKED", len(forwards))
""")


@pytest.mark.parametrize("world", [2, 4])
def test_a_forward_s_calls_on_ranks_running_at_once(world):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(world)], capture_output=True, text=True, timeout=400,
                         env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "CHECKED 2" in out.stdout
