"""How tensor-parallel ranks add up their partial sums: NCCL, or PyTorch's symmetric-memory all-reduce over NVLink
peer memory for small messages (vLLM's custom all-reduce, in PyTorch's own ops), NCCL above.

A decode step all-reduces a few rows of the hidden size twice a layer (batch 8 of qwen3-4b: 40 KB in bf16). NCCL's
ring pays a fixed cost of tens of microseconds per call whatever the size; a one-shot all-reduce, in which every
rank reads the peers' copies straight from their memory and adds them up, costs a few microseconds at that size
and is captured in the CUDA graphs like any kernel. Each rank owns one symmetric buffer of CUSTOM_MAX_BYTES
(allocated and exchanged once, before any graph is captured); a message is copied into it inside the one-shot
kernel, or copied in and reduced in two shots (reduce-scatter, all-gather) by four or more ranks above
ONE_SHOT_MAX_BYTES. PyTorch's kernels open and close each call with a barrier over signal pads, so the one buffer
is reused call after call. NVLink multicast (`multimem_*`) is never used.
"""

from __future__ import annotations

import warnings

import torch

from infertrace.engine.config import ALL_REDUCE_MODES

CUSTOM_MAX_BYTES = 8 << 20  # larger messages (prefill of many tokens) go through NCCL, which is as fast there
ONE_SHOT_MAX_BYTES = 512 << 10  # four or more ranks: two shots above this (each rank reads a 1/N share)
PLANES_MAX_BYTES = 1 << 20  # the float32 partial sums a decode step's projection writes into the planes buffer
_DTYPES = (torch.bfloat16, torch.float32)  # those PyTorch's one-/two-shot kernels add


class NcclAllReduce:
    """torch.distributed's all-reduce (NCCL on GPUs, gloo on CPU), in place."""

    name = "nccl"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x)
        return x


class PeerMemoryAllReduce:
    """One-shot (two-shot for large messages on four or more ranks) all-reduce through a symmetric buffer; NCCL for
    messages over `max_bytes`, of another dtype, or not 16-byte aligned."""

    name = "custom"

    def __init__(self, device: torch.device, dtype: torch.dtype, world_size: int, max_bytes: int = CUSTOM_MAX_BYTES,
                 fusion: str = "off", hidden_size: int = 0, spread: int = 4, pull: str = "each",
                 payload: str = "float32", gather_cols: int = 0, push: str = "off"):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.world_size = world_size
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # a collective: every rank exchanges its buffer's handle
        self.fusion = fusion  # fusion_rule's
        self.spread = spread  # kernels.allreduce_norm.spread_rule's
        self.pull = pull  # pull_rule's; with the norm fusion, what the kernel does: each or all
        self.payload = "float32"  # payload_rule's, as the norm fusion pushes the parts
        # "planes": a second buffer, float32, which the row-parallel skinny GEMMs write their partial sums into
        self.planes = None
        if fusion == "planes":
            self.planes = symm_mem.empty(PLANES_MAX_BYTES // 4, dtype=torch.float32, device=device)
            symm_mem.rendezvous(self.planes, self.group_name)
        # "norm": the buffers of the all-reduce + residual add + RMSNorm kernel (kernels/allreduce_norm.py)
        self.norm = None
        if fusion == "norm":
            from infertrace.engine.kernels.allreduce_norm import PushBuffers

            pushed = dtype if payload == "model" and dtype.itemsize == 2 else torch.float32
            self.norm = PushBuffers(device, world_size, hidden_size, self.group_name, pushed)
            self.pull = "all" if self.norm.pulls_all(pull) else "each"
            self.payload = "model" if self.norm.half else "float32"
        # push_rule's: with the norm fusion, the row-parallel projections' GEMMs push their parts
        self.push = "on" if fusion == "norm" and push == "on" else "off"
        # with the norm fusion and a 16-bit model: the decode steps' logits, [rows, gather_cols] a rank, gathered
        # through peer memory too (kernels/allgather.py); None: torch.distributed's all-gather
        self.gather = None
        if fusion == "norm" and gather_cols and dtype.itemsize == 2:
            from infertrace.engine.kernels.allgather import GatherBuffers

            self.gather = GatherBuffers(device, world_size, gather_cols, dtype, self.group_name)
        self.nccl = NcclAllReduce()
        self.ops = torch.ops.symm_mem
        self.custom_calls = 0  # counted at capture or eager call time
        self.nccl_calls = 0

    def planes_out(self, split: int, rows: int, cols: int) -> torch.Tensor | None:
        """Where a projection writes its float32 partial sums [split, rows, cols] for `reduce_planes` (the head of
        the planes buffer), or None when they do not fit (or this all-reduce has no planes buffer)."""
        n = split * rows * cols
        if self.planes is None or n > self.planes.numel():
            return None
        return self.planes[:n].view(split, rows, cols)

    def begin_forward(self) -> None:
        """A forward with `add_rmsnorm` calls starts ("norm" fusion): the slots its calls use move on."""
        self.norm.begin_forward()

    def add_rmsnorm(self, planes: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, call: int,
                    calls_per_forward: int) -> torch.Tensor:
        """`kernels.norm.add_rmsnorm` of the sum over ranks of every rank's float32 partial sums `planes` [split, T,
        N] ("norm" fusion): all-reduce, residual add (`residual` updated in place) and RMSNorm in one kernel. `call`
        numbers the calls of a forward, the same on every rank."""
        return self.norm.add_rmsnorm(planes, residual, weight, eps, call, calls_per_forward, self.spread,
                                    self.pull)

    def reduce_planes(self, planes: torch.Tensor) -> torch.Tensor:
        """The partial sums every rank wrote into `planes_out(...)`, added up across ranks in float32 (one-shot: the
        same order of ranks on every rank, so every rank gets the same bits); the planes are left for the kernel
        after to add. The kernel opens and closes with a barrier, so the next projection may write the buffer as
        soon as it returns."""
        n = planes.numel()
        out = self.ops.one_shot_all_reduce(self.planes[:n], "sum", self.group_name)
        return out.view_as(planes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if n > self.max_numel or x.dtype != self.dtype or not x.is_contiguous() or x.data_ptr() % 16:
            self.nccl_calls += 1
            return self.nccl(x)
        self.custom_calls += 1
        buffer = self.buffer[:n]  # the kernels reduce exactly the buffer's numel
        flat = x.view(-1)
        if self.world_size == 2 or n * x.element_size() <= ONE_SHOT_MAX_BYTES:
            out = self.ops.one_shot_all_reduce_copy(buffer, flat, "sum", self.group_name)
        else:
            buffer.copy_(flat)
            out = torch.empty_like(flat)
            self.ops.two_shot_all_reduce_out(buffer, "sum", self.group_name, out)
        return out.view_as(x)


def custom_unavailable(device: torch.device, dtype: torch.dtype, world_size: int) -> str | None:
    """Why this rank cannot run the peer-memory all-reduce (None: it can)."""
    if device.type != "cuda":
        return f"it needs CUDA GPUs (device {device})"
    if dtype not in _DTYPES:
        return f"PyTorch's kernels add bfloat16 and float32, not {str(dtype).removeprefix('torch.')}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch.distributed._symmetric_memory is missing ({e})"
    for op in ("one_shot_all_reduce_copy", "one_shot_all_reduce", "two_shot_all_reduce_out"):
        if not hasattr(torch.ops.symm_mem, op):
            return f"this PyTorch ({torch.__version__}) has no symm_mem.{op}"
    peers = [r for r in range(world_size) if r != device.index]
    blocked = [r for r in peers if not torch.cuda.can_device_access_peer(device.index, r)]
    if blocked:
        return f"cuda:{device.index} cannot access the memory of cuda:{blocked[0]} (no peer access)"
    return None


def fusion_rule(ranks: int) -> str:
    """What the custom all-reduce takes from a decode step's row-parallel projections with the skinny GEMMs: the
    all-reduce + norm kernel ("norm") on two and four ranks, where it measured the fastest; the float32 partial sums
    in the peer-memory buffer ("planes") on other counts, where that kernel has not run on GPUs."""
    return "norm" if ranks in (2, 4) else "planes"


def make_all_reduce(mode: str, device: torch.device, dtype: torch.dtype, world_size: int, skinny: bool = False,
                    hidden_size: int = 0, gather_cols: int = 0, overrides: dict | None = None):
    """The all-reduce every rank uses; a collective (the ranks agree on the choice): call it on every rank, after
    the process group is up and before any CUDA graph is captured. With `skinny` (the decode projections are the
    skinny GEMMs) the custom one also takes their partial sums, as `fusion_rule` says ("planes": `planes_out` and
    `reduce_planes`; "norm": `add_rmsnorm` over rows of `hidden_size`, tuned by the rules of
    kernels/allreduce_norm.py, and a 16-bit model's logits of `gather_cols` a rank all-gathered through peer memory
    too). `overrides`: rules' values set instead (kernels/tuning.py). Returns (implementation, why custom was not
    chosen or None)."""
    import torch.distributed as dist

    if mode not in ALL_REDUCE_MODES:
        raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCE_MODES)}; got {mode!r}")
    if mode == "nccl" or world_size == 1:
        return NcclAllReduce(), None
    reason = custom_unavailable(device, dtype, world_size)
    # every rank must take the same path, or they would wait in different collectives
    able = torch.tensor([0 if reason else 1], device=device)
    dist.all_reduce(able, op=dist.ReduceOp.MIN)
    if not able.item():
        reason = reason or "another rank cannot run it"
        if mode == "custom":
            raise ValueError(f"all_reduce='custom' is not available: {reason}")
        return NcclAllReduce(), reason
    import torch.distributed._symmetric_memory as symm_mem

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            symm_mem.set_backend("CUDA")  # driver IPC and peer loads: no NVSHMEM, no multicast
        except Exception:  # noqa: BLE001 - older PyTorch has one backend and no setter
            pass
    # no enable_symm_mem_for_group (deprecated): it caches the group's store by name, and an engine started after
    # another in the same process gets a new group of the same name
    return PeerMemoryAllReduce(device, dtype, world_size, hidden_size=hidden_size, gather_cols=gather_cols,
                               **resolve_rules(world_size, skinny, overrides or {})), None


def resolve_rules(ranks: int, skinny: bool, overrides: dict) -> dict:
    """The custom all-reduce's tuning on `ranks` ranks, as PeerMemoryAllReduce's arguments: each rule's pick, or
    its value in `overrides`. No fusion without the skinny GEMMs, whose partial sums the fusions take."""
    from infertrace.engine.kernels import allreduce_norm

    picked = {"all_reduce_fusion": fusion_rule(ranks),
              "all_reduce_spread": allreduce_norm.spread_rule(ranks),
              "all_reduce_pull": allreduce_norm.pull_rule(ranks),
              "all_reduce_payload": allreduce_norm.payload_rule(ranks),
              "all_reduce_push": allreduce_norm.push_rule(ranks)}
    picked |= {name: value for name, value in overrides.items() if name in picked}
    if not skinny:
        picked["all_reduce_fusion"] = "off"
    return {name.removeprefix("all_reduce_"): value for name, value in picked.items()}
