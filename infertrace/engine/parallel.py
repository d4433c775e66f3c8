"""Tensor-parallel layers: each rank holds a shard of a weight and the layer joins the shards' results.

Column-parallel layers split output features (q/k/v heads, gate/up rows) and need no communication; row-parallel
layers split input features and all-reduce their partial sums; the vocabulary is split for the embedding (each rank
looks up its own ids, then all-reduce) and for the logits (each rank computes its shard, then all-gather). With one
rank every layer is a plain linear or embedding: no collective, no extra copy.

Each layer has a `weight_loader(param, loaded, part)` that returns (destination, source): the rank's slice of the
parameter (of part `part` of a packed one) and the matching slice of the checkpoint tensor, one copy per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's rank among `size` tensor-parallel ranks (torch.distributed's default group when size > 1),
    and the all-reduce its row-parallel layers use (allreduce.py; None: torch.distributed's, in place)."""

    rank: int = 0
    size: int = 1
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place, or a new tensor: use the result)."""
        if self.size == 1:
            return x
        if self.reduce is not None:
            return self.reduce(x)
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def reduce_partial_sums(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A row-parallel skinny GEMM's output, all-reduced: float32 split-K partial sums [split, T, N] are added
        up (in float32, then rounded to `dtype`) before the all-reduce, so the message is one [T, N] tensor."""
        if self.size == 1:
            return x
        if x.dim() == 3:
            x = x.sum(0, dtype=torch.float32)
        return self.all_reduce(x.to(dtype))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` side by side along the last dimension, on every rank (through peer memory where the
        all-reduce has a gather that takes `x`: a decode step's logits)."""
        if self.size == 1:
            return x
        gather = getattr(self.reduce, "gather", None)
        if gather is not None and gather.takes(x):
            return gather.all_gather_last(x)
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


def _shard(loaded: torch.Tensor, dim: int, size: int, tp: TensorParallel) -> torch.Tensor:
    """This rank's `size` entries of `loaded` along `dim`, which must hold exactly one such shard per rank."""
    if loaded.dim() <= dim or loaded.shape[dim] != size * tp.size:
        raise ValueError(f"dimension {dim} should be {size * tp.size}")
    return loaded.narrow(dim, tp.rank * size, size)


def check_divisible(name: str, total: int, tp: int) -> int:
    """`total // tp`, or a ValueError naming what does not split across `tp` ranks."""
    if total % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name} ({total})")
    return total // tp


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T with W's output rows split across ranks: each rank returns its own share of the features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features // tp.size, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, part: int | None):
        return param, _shard(loaded, 0, param.shape[0], self.tp)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections packed into one matrix (gate/up): a rank's rows are its shard of each
    part, in part order."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE):
        self.part_sizes = [size // tp.size for size in part_sizes]  # per rank
        super().__init__(in_features, sum(part_sizes), bias, dtype, tp)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, part: int | None):
        start, size = sum(self.part_sizes[:part]), self.part_sizes[part]
        return param.narrow(0, start, size), _shard(loaded, 0, size, self.tp)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections packed into one matrix, split by heads: each rank gets whole query and KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype, tp: TensorParallel = SINGLE):
        check_divisible("attention heads", num_heads, tp.size)
        check_divisible("KV heads", num_kv_heads, tp.size)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q, kv, kv], bias, dtype, tp)


class RowParallelLinear(nn.Module):
    """y = x @ W.T with W's input columns split across ranks: each rank multiplies its share of the features and
    the partial sums are all-reduced (the bias is added once, by rank 0)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None))

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, part: int | None):
        if param.dim() == 1:
            return param, loaded  # the bias: whole on every rank
        return param, _shard(loaded, 1, param.shape[1], self.tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks by token id (the last shard padded when the vocabulary does not split
    evenly); a rank embeds the ids in its range, zeros for the others, and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        x = F.embedding(local * mine, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ W.T over the whole vocabulary: each rank's shard of the logits, gathered."""
        return self.gather_logits(F.linear(hidden, self.weight))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the logits -> the whole vocabulary's (the padding of the last shard cut off)."""
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[..., : self.vocab_size]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, part: int | None):
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"{loaded.shape[0]} rows for a vocabulary of {self.vocab_size}")
        rows = loaded.narrow(0, self.vocab_start, min(self.shard_size, self.vocab_size - self.vocab_start))
        if rows.shape[0] < self.shard_size:  # padding rows: never looked up, and their logits are cut off
            rows = torch.cat([rows, rows.new_zeros(self.shard_size - rows.shape[0], *rows.shape[1:])])
        return param, rows


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary like the embedding it is often tied to."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)
