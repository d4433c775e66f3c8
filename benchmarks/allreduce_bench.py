"""The all-reduce of a decode step's row-parallel projection, alone: microseconds per call of each way the engine
can run it, every rank replaying a CUDA graph of back-to-back calls at once (no GEMM between, so no rank waits on
another's work: what is left is each kernel's own cost and the cross-GPU latency).

- off: the planes added and rounded by two torch kernels, PyTorch's one-shot all-reduce in bf16, then add_rmsnorm;
- planes: PyTorch's one-shot all-reduce of the float32 planes in place, then add_rmsnorm adding them;
- norm: kernels/allreduce_norm.py, all-reduce + residual add + RMSNorm in one kernel (norm/N: each row's push
  spread over N programs, `--spread 4,8`, spread_rule's values; +all: the ranks' parts pulled at once, `--pull
  each,all`; +bf16: the parts pushed in bfloat16, `--payload float32,model`);
- nccl: the planes added and rounded, NCCL's all-reduce, then add_rmsnorm.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 benchmarks/allreduce_bench.py --ranks 2,4
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # this checkout's package, installed or not
    sys.path.insert(0, str(REPO))

CALLS = 72  # a qwen3-4b decode step's row-parallel projections


def rank_main(rank: int, world: int, port: int, rows: int, hidden: int, split: int, replays: int, queue,
              spreads: tuple[int, ...] = (1,), pulls: tuple[str, ...] = ("each",),
              payloads: tuple[str, ...] = ("float32",)) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from infertrace.engine.allreduce import PeerMemoryAllReduce
    from infertrace.engine.cuda_graph import replay_ms
    from infertrace.engine.kernels.norm import add_rmsnorm

    device = torch.device("cuda", rank)
    planes_ar = PeerMemoryAllReduce(device, torch.bfloat16, world, fusion="planes")
    norm_ars = {payload: PeerMemoryAllReduce(device, torch.bfloat16, world, fusion="norm", hidden_size=hidden,
                                             payload=payload) for payload in payloads}
    weight = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    residual = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device)
    local = torch.randn(split, rows, hidden, device=device) * 1e-3

    def off():
        summed = local.sum(0, dtype=torch.float32).to(torch.bfloat16)
        return add_rmsnorm(planes_ar(summed), residual, weight, 1e-6)

    shared = planes_ar.planes_out(split, rows, hidden)
    shared.copy_(local)  # as the GEMM leaves its planes there (the one-shot kernel reads them, writes elsewhere)

    def planes():
        return add_rmsnorm(planes_ar.reduce_planes(shared), residual, weight, 1e-6)

    def norm(spread: int = 1, pull: str = "each", payload: str = "float32"):  # PushBuffers.add_rmsnorm's settings
        return norm_ars[payload].norm.add_rmsnorm(local, residual, weight, 1e-6, norm_call[0], CALLS, spread, pull)

    def nccl():
        summed = local.sum(0, dtype=torch.float32).to(torch.bfloat16)
        dist.all_reduce(summed)
        return add_rmsnorm(summed, residual, weight, 1e-6)

    norm_call = [0]
    results = {}
    ways = [("off", off, None), ("planes", planes, None)]  # (name, one call, the norm kernel's buffers)
    for s, p, w in itertools.product(spreads, pulls, payloads):
        name = ("norm" if s == 1 else f"norm/{s}") + ("" if p == "each" else f"+{p}") + ("" if w == "float32" else "+bf16")
        ways.append((name, lambda s=s, p=p, w=w: norm(s, p, w), norm_ars[w]))
    ways.append(("nccl", nccl, None))
    for name, one, norm_ar in ways:
        def step():
            if norm_ar is not None:
                norm_ar.begin_forward()
            for c in range(CALLS):
                norm_call[0] = c
                one()

        step()  # compiles, and every rank has its buffers ready
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        results[name] = replay_ms(graph, replays) * 1e3 / CALLS
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--split", type=int, default=2, help="planes a projection leaves (its split-K)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--spread", default="4,8", help="programs a row's push is spread over in the norm kernel, listed")
    ap.add_argument("--pull", default="each", help="how the norm kernel waits for the ranks' parts, listed: each, all")
    ap.add_argument("--payload", default="float32", help="the dtype the norm kernel pushes the parts in, listed: "
                    "float32, model (bfloat16)")
    args = ap.parse_args()
    spreads = tuple(int(s) for s in args.spread.split(","))
    pulls = tuple(args.pull.split(","))
    payloads = tuple(args.payload.split(","))
    import torch

    from infertrace.engine.worker import free_port

    print(f"{args.rows} rows x {args.hidden}, {args.split} planes, {CALLS} calls a graph; us per call (rank 0, slowest)")
    for world in (int(w) for w in args.ranks.split(",")):
        if world > torch.cuda.device_count():
            print(f"{world} ranks: skipped, {torch.cuda.device_count()} GPUs", file=sys.stderr)
            continue
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, args.rows, args.hidden, args.split, args.replays,
                                                      queue, spreads, pulls, payloads)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=300) for _ in range(world))
        for p in procs:
            p.join(30)
        for name in results[0]:
            values = [results[r][name] for r in range(world)]
            print(f"{world} ranks  {name:>10}  {values[0]:6.2f} us  ({max(values):6.2f})", flush=True)


if __name__ == "__main__":
    main()
