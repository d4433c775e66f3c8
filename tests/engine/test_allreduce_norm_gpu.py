"""The all-reduce + residual add + RMSNorm kernel (kernels/allreduce_norm.py) on 2 and 4 GPUs: over many calls and
forwards, eagerly and replayed from a CUDA graph, every rank gets the same bits, the sum of every rank's partial
sums exactly as torch adds them in rank order (each rank's part rounded to bfloat16 first where the parts are pushed
in bfloat16), and the residual add and RMSNorm of `add_rmsnorm`. Skipped without
enough GPUs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _rank(rank: int, world: int, port: int, queue, spread: int = 1, pull: str = "each",
          payload: torch.dtype = torch.float32) -> None:
    import traceback

    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        from infertrace.engine.kernels.allreduce_norm import PushBuffers

        hidden, eps = 2560, 1e-6
        buffers = PushBuffers(torch.device("cuda", rank), world, hidden, dist.group.WORLD.group_name, payload)
        weight = torch.randn(hidden, dtype=torch.bfloat16, device="cuda", generator=_seeded(1))
        worst = 0.0
        for forward in range(5):
            rows = [8, 16, 3, 8, 1][forward]  # fewer rows after more: the emptied slots must cover them
            calls = 6
            buffers.begin_forward()
            residual = torch.randn(rows, hidden, device="cuda", generator=_seeded(100 + forward)).to(torch.bfloat16)
            expected_residual = residual.clone()
            for call in range(calls):
                split = [1, 2, 4][call % 3]
                everyone = [torch.randn(split, rows, hidden, device="cuda", generator=_seeded(1000 * forward + 10 * call + r))
                            for r in range(world)]
                everyone[0][0, 0, :4] = -0.0  # zeros of either sign are pushed as +0.0
                out = buffers.add_rmsnorm(everyone[rank].contiguous(), residual, weight, eps, call, calls, spread,
                                           pull)
                total = torch.zeros(rows, hidden, device="cuda")
                for part in everyone:
                    rank_sum = part[0].clone()
                    for p in range(1, split):
                        rank_sum += part[p]
                    total += rank_sum.to(payload).float()  # a 16-bit payload: each rank's part rounded first
                x = (total.to(torch.bfloat16).float() + expected_residual.float()).to(torch.bfloat16)
                expected_residual.copy_(x)
                xf = x.float()
                normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
                expected = (weight.float() * normed.float()).to(torch.bfloat16)
                assert torch.equal(residual, expected_residual), f"forward {forward} call {call}: residual"
                worst = max(worst, (out.float() - expected.float()).abs().max().item())
                gathered = [torch.empty_like(out) for _ in range(world)]
                dist.all_gather(gathered, out)
                assert all(torch.equal(g, gathered[0]) for g in gathered), f"forward {forward} call {call}: ranks differ"
        # replayed from a CUDA graph: the forward counter moves on inside the graph
        rows, calls = 8, 4
        parts = [torch.randn(2, rows, hidden, device="cuda", generator=_seeded(7 + r)) for r in range(world)]
        residual = torch.zeros(rows, hidden, dtype=torch.bfloat16, device="cuda")
        mine = parts[rank].contiguous()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            buffers.begin_forward()
            outs = [buffers.add_rmsnorm(mine, residual, weight, eps, c, calls, spread, pull) for c in range(calls)]
        for _ in range(10):
            residual.zero_()
            graph.replay()
        torch.cuda.synchronize()
        check = torch.zeros(rows, hidden, dtype=torch.bfloat16, device="cuda")
        total = sum((p[0] + p[1]).to(payload).float() for p in parts).to(torch.bfloat16)
        for c in range(calls):
            check = (total.float() + check.float()).to(torch.bfloat16)
        assert torch.equal(residual, check), "graph replay: residual"
        assert int(buffers.epoch.item()) == 5 + 10  # 5 eager forwards and 10 replays (a capture runs nothing)
        queue.put((rank, "ok", worst, len(outs)))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc(), 0))


def _seeded(seed: int) -> torch.Generator:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


@pytest.mark.parametrize(("world", "spread", "pull", "payload"), [  # spread: the programs a row's push is spread over
    pytest.param(2, 1, "each", "float32", marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")),
    pytest.param(4, 1, "each", "float32", marks=pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")),
    pytest.param(2, 4, "each", "float32", marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")),
    pytest.param(2, 4, "all", "float32", marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")),
    pytest.param(4, 4, "all", "float32", marks=pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")),
    pytest.param(2, 4, "each", "bfloat16", marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")),
    pytest.param(4, 4, "all", "bfloat16", marks=pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs"))])
def test_every_rank_gets_the_same_all_reduced_norm(world, spread, pull, payload):
    import multiprocessing

    from infertrace.engine.worker import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, queue, spread, pull, getattr(torch, payload)))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in range(world)]
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
    errors = [r for r in results if r[1] != "ok"]
    assert not errors, errors[0][2]
    worst = max(r[2] for r in results)
    print(f"{world} ranks: RMSNorm output within {worst:.3g} of torch's (the residual stream bit for bit)")
    assert worst <= 0.0625  # one bf16 step of a value near 8: the norm's sum of squares adds up in another order
