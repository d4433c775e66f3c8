"""All-reduce, residual add and RMSNorm of a decode step's row-parallel projection, one kernel on every rank.

The projection before it (the skinny GEMM) leaves this rank's float32 split-K partial sums [split, T, N]. The
programs of row t (one, or `spread` of them each taking a slice of the row's columns) add their planes, then *push* the row
into slot s of every rank's buffer (its own included), at its rank's place, with plain stores over NVLink peer
memory. Then the row's last program *pulls*: it reads its own buffer's row of every rank, in rank order, and reads
again until no entry is still empty (the other programs of the row run meanwhile: a program's dependents launch
only once every program of it has started, so none waits on one that cannot start). The row is pushed in float32,
or rounded to the model's 16-bit dtype (`payload`: half the bytes, each rank's part rounded before the sum, as
vLLM's all-reduce adds bfloat16 parts). An empty entry holds -0.0 (the bits 0x80000000, or 0x8000 in 16 bits),
which no pushed value is (a -0.0 is pushed as +0.0). No barrier opens or closes the kernel: an entry is there when
it is no longer empty. The sum, the same bits on every rank, then goes through the residual add and RMSNorm with the
roundings of `kernels.norm.add_rmsnorm`.

Three slots take turns (the Lamport scheme of vLLM's and FlashInfer's one-shot all-reduce fusions): call k of the
process uses slot k mod 3 and empties slot k-1 mod 3, which every rank had read by the end of call k-1. A rank can be
at most one call ahead of another (call k+1 needs everyone's part of call k), so when another rank pushes call k+1
into slot k+1 mod 3, that slot was emptied here during call k-1 or before, and slot k mod 3 is not written again
before call k+3, by which time this rank has read it. The call number is the forward's number (a counter on the
device, moved on by `begin_forward`, which the CUDA graphs capture) times the calls a forward makes, plus the call's
place in the forward; every rank runs the same forwards, so every rank numbers the calls alike.

A rank that dies leaves the others reading for ever, as any peer-memory all-reduce does; the engine ends the ranks
then (engine/worker.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infertrace.engine.kernels import launch

MAX_ROWS = 16  # the most rows of a decode step that takes the skinny GEMMs (models/qwen3.py SKINNY_MAX_ROWS)
SLOTS = 3
EMPTY_BITS = -(2**31)  # the int32 bits of -0.0
EMPTY = tl.constexpr(EMPTY_BITS)  # the same, for the kernel
EMPTY_HALF_BITS = -(2**15)  # the int16 bits of -0.0 in bfloat16 and float16, where the parts are pushed in those
EMPTY_HALF = tl.constexpr(EMPTY_HALF_BITS)
PULL_ALL_MAX = 1 << 15  # the most values (ranks x the row's block) the pulling program reads at once


@triton.jit
def _allreduce_add_rmsnorm_kernel(planes_ptr, plane_stride, buffers_ptr, epoch_ptr, call, calls_per_forward,
                                  residual_ptr, weight_ptr, out_ptr, n_rows, n_cols, eps,
                                  PLANES: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                                  MAX_ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                                  PDL: tl.constexpr, PULL_ALL: tl.constexpr = False, HALF: tl.constexpr = False,
                                  PUSHED: tl.constexpr = False):
    part = tl.program_id(0)  # the row's CHUNK columns this program pushes
    row = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    mine = part * CHUNK + tl.arange(0, CHUNK)
    mine_mask = mine < n_cols
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a constant: read while the kernel before drains
    if PDL:  # the planes come from the kernel before
        gdc_wait()
        gdc_launch_dependents()
    k = tl.load(epoch_ptr) * calls_per_forward + call
    slot = k % 3
    previous = (k + 2) % 3
    slot_size = WORLD * MAX_ROWS * n_cols
    dtype = out_ptr.dtype.element_ty
    if not PUSHED:  # (PUSHED: the projection's GEMM pushed this rank's part itself, skinny_gemm.push_part)
        x = tl.load(planes_ptr + row * n_cols + mine, mask=mine_mask, other=0.0)
        for p in tl.static_range(1, PLANES):
            x += tl.load(planes_ptr + p * plane_stride + row * n_cols + mine, mask=mine_mask, other=0.0)
        # the part (rounded to the model's 16-bit dtype with HALF: half the bytes to push and to pull) into every
        # rank's buffer
        push_to_ranks(x, slot * slot_size + (RANK * MAX_ROWS + row) * n_cols + mine, mine_mask, buffers_ptr, dtype,
                      WORLD, HALF)
    if HALF:  # an entry's bits, as the pull reads and the emptying writes them
        own = tl.multiple_of(tl.load(buffers_ptr + RANK).to(tl.pointer_type(tl.int16)), 16)
    else:
        own = tl.multiple_of(tl.load(buffers_ptr + RANK).to(tl.pointer_type(tl.int32)), 16)
    if part == tl.num_programs(0) - 1:  # the row's last program pulls the whole row and runs the norm
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        if PULL_ALL:  # every rank's part of the row read at once, and again while any entry is empty
            ranks = tl.arange(0, WORLD)
            ptrs = own + slot * slot_size + (ranks[:, None] * MAX_ROWS + row) * n_cols + cols[None, :]
            bits = tl.load(ptrs, mask=mask[None, :], other=0, volatile=True)
            while tl.max(tl.max((bits == _empty(HALF)).to(tl.int32), 1), 0) > 0:
                bits = tl.load(ptrs, mask=mask[None, :], other=0, volatile=True)
            parts = _values(bits, dtype, HALF)
            for r in tl.static_range(WORLD):  # added in rank order (each part picked out exactly: x + 0.0 == x)
                acc += tl.sum(tl.where(ranks[:, None] == r, parts, 0.0), 0)
        else:
            for r in tl.static_range(WORLD):  # pull every rank's part, in rank order, as it lands
                ptrs = own + slot * slot_size + (r * MAX_ROWS + row) * n_cols + cols
                acc += _values(wait_filled(ptrs, mask, _empty(HALF)), dtype, HALF)
        # residual add + RMSNorm, rounded as kernels.norm.add_rmsnorm rounds a projection's planes
        s = acc.to(dtype).to(tl.float32)
        r_ = tl.load(residual_ptr + row * n_cols + cols, mask=mask, other=0.0)
        xs = (s + r_.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + row * n_cols + cols, xs, mask=mask)
        xf = xs.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n_cols
        normed = (xf * tl.math.rsqrt(var + eps)).to(dtype)
        tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)
    # empty this program's columns of the previous call's slot, every row a decode step may have (the next call may
    # have more rows than this): rows row, row + n_rows, ...
    empty_rows(own + previous * slot_size, row, n_rows, MAX_ROWS, mine, mine_mask, n_cols, _empty(HALF), CHUNK, WORLD,
               MAX_ROWS)


@triton.jit
def push_to_ranks(x, entry, mask, buffers_ptr, dtype: tl.constexpr, WORLD: tl.constexpr, ROUND: tl.constexpr):
    """Store `x` (rounded to `dtype` first with ROUND) at offset `entry` of every rank's buffer (the addresses at
    `buffers_ptr`), a -0.0 as +0.0: -0.0 marks an entry still empty."""
    if ROUND:
        x = x.to(dtype)
    x = tl.where(x == 0.0, tl.zeros_like(x), x)
    for r in tl.static_range(WORLD):
        peer = tl.multiple_of(tl.load(buffers_ptr + r).to(tl.pointer_type(x.dtype)), 16)
        tl.store(peer + entry, x, mask=mask)


@triton.jit
def wait_filled(ptrs, mask, EMPTY_BITS: tl.constexpr):
    """The bits at `ptrs` (an integer pointer block) once none is EMPTY_BITS: the other ranks' pushes have landed.
    Volatile loads: read again on every pass, from L2 (where the other ranks' stores land), never a stale line of
    this SM's L1; 16-byte loads, the buffers' addresses being 16-byte aligned."""
    bits = tl.load(ptrs, mask=mask, other=0, volatile=True)
    while tl.max((bits == EMPTY_BITS).to(tl.int32), 0) > 0:
        bits = tl.load(ptrs, mask=mask, other=0, volatile=True)
    return bits


@triton.jit
def empty_rows(slot_ptr, row, n_rows, rows_end, cols, mask, n_cols, EMPTY_BITS: tl.constexpr, CHUNK: tl.constexpr,
               WORLD: tl.constexpr, MAX_ROWS: tl.constexpr):
    """Mark `cols` of rows row, row + n_rows, ... (below rows_end) of every rank's place in a slot (`slot_ptr`, of
    this rank's buffer, integer entries) empty again, for the call that reuses the slot."""
    empty = tl.full((CHUNK,), EMPTY_BITS, dtype=slot_ptr.dtype.element_ty)
    rr = row
    while rr < rows_end:
        for r in tl.static_range(WORLD):
            tl.store(slot_ptr + (r * MAX_ROWS + rr) * n_cols + cols, empty, mask=mask)
        rr += n_rows


@triton.jit
def _empty(HALF: tl.constexpr):
    """The bits of an empty entry: -0.0 in float32, or in the 16-bit dtype with HALF."""
    if HALF:
        bits = EMPTY_HALF
    else:
        bits = EMPTY
    return bits


@triton.jit
def _values(bits, value_type: tl.constexpr, HALF: tl.constexpr):
    """Entries' bits as float32 values (16-bit entries are values of `value_type`)."""
    if HALF:
        values = bits.to(value_type, bitcast=True).to(tl.float32)
    else:
        values = bits.to(tl.float32, bitcast=True)
    return values


class PushBuffers:
    """This rank's slots (float32 [3, world, MAX_ROWS, hidden], every entry empty at first) in symmetric memory, the
    addresses of every rank's, and the forward counter. Built on every rank at once (a collective)."""

    def __init__(self, device: torch.device, world_size: int, hidden_size: int, group_name: str,
                 payload: torch.dtype = torch.float32):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.world_size = world_size
        self.hidden_size = hidden_size
        # the dtype of the parts pushed: float32 (each rank's sum unrounded; the total rounded once, as on one GPU)
        # or the model's 16-bit dtype (each rank's part rounded first, half the bytes; the slots then use half
        # the buffer)
        self.payload = payload
        self.half = payload.itemsize == 2
        self.buffer = symm_mem.empty(SLOTS * world_size * MAX_ROWS * hidden_size, dtype=torch.float32, device=device)
        handle = symm_mem.rendezvous(self.buffer, group_name)
        self.rank = handle.rank
        if self.half:
            self.buffer.view(torch.int16).fill_(EMPTY_HALF_BITS)
        else:
            self.buffer.view(torch.int32).fill_(EMPTY_BITS)
        self.addresses = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's slots are empty before any rank pushes

    def pulls_all(self, pull: str) -> bool:
        """Whether the kernel reads every rank's part at once: `pull` "all" (`pull_rule`), where the block fits (a
        power-of-two number of ranks, at most PULL_ALL_MAX values); otherwise it reads them one after another."""
        world, block = self.world_size, triton.next_power_of_2(self.hidden_size)
        return pull == "all" and world & (world - 1) == 0 and world * block <= PULL_ALL_MAX

    def begin_forward(self) -> None:
        self.epoch.add_(1)

    def push_target(self, call: int, calls_per_forward: int) -> tuple:
        """What a row-parallel projection's GEMM needs to push this rank's part of call `call` itself
        (`skinny_gemm(..., push=)`); `add_rmsnorm(None, ...)` of the same call then only pulls."""
        return (self.addresses, self.epoch, call, calls_per_forward, self.rank, self.world_size, MAX_ROWS, self.half)

    def add_rmsnorm(self, planes: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    call: int, calls_per_forward: int, spread: int = 1, pull: str = "each") -> torch.Tensor:
        """`spread` (`spread_rule`'s in the engine): a row is cut into slices of cols / spread columns rounded up to
        a power of two, one program each (cols 5120 and spread 4: three programs of 2048, 2048 and 1024 columns);
        each pushes its slice to every rank, and the last pulls the whole row and runs the norm. `pull`
        (`pull_rule`'s): "each" waits for the ranks' parts one after another, "all" reads every rank's part at once
        and again while any is missing (up to 32K values: four ranks of hidden 8,192)."""
        pushed = planes is None  # the GEMM before pushed this rank's part (push_target): nothing to read here
        if pushed:
            planes = residual[None]  # never read
        else:
            assert planes.dtype == torch.float32 and planes.is_contiguous()
        split, rows, cols = planes.shape
        assert residual.is_contiguous()
        assert rows <= MAX_ROWS and cols == self.hidden_size and residual.shape == (rows, cols)
        assert not self.half or residual.dtype == self.payload, "16-bit parts are pushed in the residual's dtype"
        out = torch.empty_like(residual)
        if rows:
            chunk = triton.next_power_of_2(triton.cdiv(cols, spread))
            block = triton.next_power_of_2(cols)
            _allreduce_add_rmsnorm_kernel[(triton.cdiv(cols, chunk), rows)](
                planes, rows * cols, self.addresses, self.epoch, call, calls_per_forward, residual, weight, out, rows, cols,
                eps, PLANES=split, RANK=self.rank, WORLD=self.world_size, MAX_ROWS=MAX_ROWS, BLOCK=block,
                CHUNK=chunk, PDL=launch.enabled(), PULL_ALL=self.pulls_all(pull), HALF=self.half, PUSHED=pushed,
                num_warps=8 if cols > 2048 else 4, launch_pdl=launch.enabled(),
            )
        return out


# The rules that tune this kernel by rank count, which an experiment overrides through kernels/tuning.py. Their
# figures are in docs/benchmarks-history.md.


def spread_rule(ranks: int) -> int:
    """The programs a row's push is spread over: 8 on four or more ranks, 4 on fewer (fewer programs a row measured
    slower on two ranks, more no faster there)."""
    return 8 if ranks >= 4 else 4


def pull_rule(ranks: int) -> str:
    """How a row's last program waits for the ranks' parts: every part read at once ("all") on four or more ranks,
    where it measured faster; one rank after another ("each") on fewer, where "all" measured slower."""
    return "all" if ranks >= 4 else "each"


def payload_rule(ranks: int) -> str:
    """The dtype each rank's part is pushed in: the model's ("model"; a 16-bit model's halves the bytes over NVLink
    and to poll, as vLLM's all-reduce adds bfloat16 parts; a float32 model's stays float32), on any rank count."""
    return "model"


def push_rule(ranks: int) -> str:
    """Whether the output and down projections' GEMMs push their parts into every rank's slot themselves ("on"):
    on four or more ranks, where it measured faster; on fewer the down projection's split-K tiling it gives up
    costs more than it saves."""
    return "on" if ranks >= 4 else "off"
