"""Qwen3 for causal LM over a flat token batch, with packed q/k/v and gate/up projections.

The numerics follow the Hugging Face implementation (RMSNorm in float32, q/k norm before RoPE, RoPE tables in
float32), so that greedy tokens match it exactly. With tensor parallelism each rank holds its share of the heads
and of the MLP's features (see parallel.py); with one rank the parallel layers are plain linears.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infertrace.engine.attention import AttentionMetadata, TorchAttention
from infertrace.engine.decode_path import DecodePath
from infertrace.engine.parallel import (
    SINGLE,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    check_divisible,
)


@dataclass(frozen=True, slots=True)
class Qwen3Spec:
    """The fields of a Qwen3 config.json the engine uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Qwen3Spec:
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") != "qwen3" and "Qwen3ForCausalLM" not in archs:
            raise ValueError(f"not a Qwen3 model: model_type={cfg.get('model_type')!r}, architectures={archs}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; Qwen3 uses silu")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"unsupported RoPE scaling {rope_type!r}")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )


@dataclass(frozen=True, slots=True)
class StepKernels:
    """The kernels one forward takes, chosen once from the decode path and the step's size: the layers read it to
    pick theirs. The default is Hugging Face's torch ops."""

    fused: bool = False  # Triton kernels: residual add + RMSNorm, q/k RMSNorm + RoPE, SiLU-and-multiply
    skinny: bool = False  # the projections as weight-streaming GEMMs (a step of at most SKINNY_MAX_ROWS tokens)
    fused_projections: bool = False  # with skinny: projections and the kernels after them as one, where it gains
    # the "norm" all-reduce fusion (skinny steps with more ranks): every residual add + RMSNorm after a row-parallel
    # projection is also its all-reduce, numbered alike on every rank (`RMSNorm.call`), `calls` of them a forward
    reducer: object | None = None
    calls: int = 0
    push: bool = False  # with the reducer: the output and down projections' GEMMs push their parts themselves


EAGER = StepKernels()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, call: int = 0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps
        self.call = call  # its place among a forward's add + norms: the all-reduce + norm kernel's call number

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor | None = None,
                step: StepKernels = EAGER):
        """rmsnorm(x); with `residual`, (rmsnorm(x + residual), x + residual), where `x` is a projection's output as
        the step's kernels leave it: split-K float32 planes the kernel adds as it reads them, or (with the reducer)
        this rank's part, all-reduced by the same kernel (None: the projection's GEMM pushed it). The fused kernels
        update `residual` in place."""
        if residual is None:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x32.to(x.dtype)
        if step.reducer is not None:
            return step.reducer.add_rmsnorm(x, residual, self.weight, self.eps, self.call, step.calls), residual
        if step.fused:
            return _norms().add_rmsnorm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual


class RotaryEmbedding:
    """cos/sin tables for every position, built in float32 once."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


SKINNY_MAX_ROWS = 16  # steps of at most this many tokens use the weight-streaming GEMMs


@functools.cache
def _skinny_kernels():
    """Imported on first use: Triton is a CUDA-only dependency, and this runs 4 times a layer in eager decode."""
    from infertrace.engine.kernels.skinny_gemm import decode_config, skinny_gemm

    return decode_config, skinny_gemm


@functools.cache
def _norms():
    """The norm kernels (Triton), imported on first use."""
    from infertrace.engine.kernels import norm

    return norm


@functools.cache
def _fusions():
    """The fused decode kernels (Triton), imported on first use."""
    from infertrace.engine.kernels import fused

    return fused


def decode_linear(x: torch.Tensor, weight: torch.Tensor, planes: bool = False) -> torch.Tensor:
    """x @ weight.T by the skinny GEMM with its tuned tiling. With `planes`, a shape whose tiling splits K returns
    its float32 partial sums [split, T, N] for the kernel after it to add up as it reads them."""
    decode_config, skinny_gemm = _skinny_kernels()
    n, k = weight.shape
    block_n, block_k, split_k, stages = decode_config(n, k, planes)
    return skinny_gemm(x, weight, block_n=block_n, block_k=block_k, split_k=split_k if planes else 1,
                       num_stages=stages)


def decode_gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a merged gate/up projection by the early decode GEMM with SiLU-and-multiply in its
    epilogue, at the projection's tiling; None where the early kernel does not run."""
    from infertrace.engine.kernels.skinny_gemm import decode_config, gate_up_silu_early

    block_n, block_k, _, stages = decode_config(*weight.shape)
    return gate_up_silu_early(x, weight, block_n=block_n, block_k=block_k, num_stages=stages)


def row_parallel_decode(x: torch.Tensor, layer: RowParallelLinear, reduce: bool = True,
                        push: tuple[int, int] | None = None) -> torch.Tensor | None:
    """x @ W.T of a row-parallel projection of a decode step by the skinny GEMM, added up over the ranks, for the
    residual add + RMSNorm after it, which adds float32 planes [split, T, N] as it reads them. One rank: the GEMM's
    own split-K planes. More ranks, where the all-reduce takes planes (its fusion "planes"): the GEMM writes
    them into its peer-memory buffer and they are all-reduced there, in float32. Otherwise they are added up, rounded
    to the model's dtype and all-reduced as one [T, N] tensor. `reduce=False` (more ranks, "norm" fusion): this
    rank's float32 planes, for the all-reduce + norm kernel after it. `push` = (call, calls per forward), with
    the all-reduce's push: the GEMM, unsplit, pushes this rank's part of that call into every rank's all-reduce buffer
    itself and returns None; the all-reduce + norm kernel after it only pulls."""
    tp = layer.tp
    if push is not None:
        decode_config, skinny_gemm = _skinny_kernels()
        from infertrace.engine.kernels.skinny_gemm import rules_config

        n, k = layer.weight.shape
        block_n, block_k, split_k, stages = decode_config(n, k, True)
        if split_k > 1:  # a pushed part is the rank's whole sum: the rules' unsplit tiling
            block_n, block_k, _, stages = rules_config(n, k, False)
        skinny_gemm(x, layer.weight, block_n=block_n, block_k=block_k, num_stages=stages,
                    push=tp.reduce.norm.push_target(*push))
        return None
    planes_out = getattr(tp.reduce, "planes_out", None)
    if tp.size > 1 and (not reduce or planes_out is not None):
        decode_config, skinny_gemm = _skinny_kernels()
        n, k = layer.weight.shape
        block_n, block_k, split_k, stages = decode_config(n, k, True)
        shape = (split_k, x.shape[0], n)
        out = planes_out(*shape) if reduce else torch.empty(shape, dtype=torch.float32, device=x.device)
        if out is not None:  # None: more planes than the buffer holds
            skinny_gemm(x, layer.weight, out if split_k > 1 else out[0], block_n=block_n, block_k=block_k,
                        split_k=split_k, num_stages=stages)
            return tp.reduce.reduce_planes(out) if reduce else out
    partial = decode_linear(x, layer.weight, planes=True)
    return tp.reduce_partial_sums(partial, x.dtype)


class Qwen3Attention(nn.Module):
    def __init__(self, spec: Qwen3Spec, dtype: torch.dtype, tp: TensorParallel = SINGLE, call: int = 1):
        super().__init__()
        self.call = call  # the call of the add + norm after the output projection (its push's slot)
        self.num_heads = check_divisible("attention heads", spec.num_attention_heads, tp.size)  # this rank's
        self.num_kv_heads = check_divisible("KV heads", spec.num_key_value_heads, tp.size)
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_attention_heads,
                                          spec.num_key_value_heads, spec.attention_bias, dtype, tp)
        self.o_proj = RowParallelLinear(spec.num_attention_heads * spec.head_dim, spec.hidden_size,
                                        spec.attention_bias, dtype, tp)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype)
        self.k_cache: torch.Tensor | None = None  # [num_slots, Hkv, D], bound by the model runner
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, positions, rope: RotaryEmbedding, attn: TorchAttention, meta: AttentionMetadata,
                step: StepKernels = EAGER):
        """With `step.skinny`, the projections run as weight-streaming GEMMs. Where a tiling splits K, the qkv
        projection returns split-K partial sums to the fused q/k norm (when it also writes K and V to the cache) and
        the output projection to the residual add + RMSNorm after it; each adds them up as it reads them. With
        `step.fused_projections`, a qkv shape measured to gain runs the projection, the q/k norm + RoPE and the K/V
        write as one kernel (`fused.qkv_norm_rope`)."""
        fused = step.fused
        stored = fused and getattr(attn, "fuses_kv_store", False)  # the fused q/k norm writes K and V to the cache
        one_kernel = None
        if stored and step.fused_projections:
            one_kernel = _fusions().qkv_fused_config(*self.qkv_proj.weight.shape)
        if one_kernel is not None:
            block_k, stages, warps = one_kernel
            q = _fusions().qkv_norm_rope(x, self.qkv_proj.weight, self.num_heads, self.num_kv_heads, self.head_dim,
                                         self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rope.cos, rope.sin,
                                         positions, (self.k_cache, self.v_cache, meta.slot_mapping), block_k=block_k,
                                         num_stages=stages, num_warps=warps)
            out = attn.forward(q, None, None, self.k_cache, self.v_cache, meta, self.scale, kv_stored=True)
        else:
            out = self._attend(x, positions, rope, attn, meta, fused, step.skinny, stored)
        return row_parallel(self.o_proj, out.reshape(-1, self.q_size), step, self.call)

    def _attend(self, x, positions, rope: RotaryEmbedding, attn: TorchAttention, meta: AttentionMetadata, fused: bool,
                skinny: bool, stored: bool) -> torch.Tensor:
        """The qkv projection, the q/k norm + RoPE and the attention, each its own kernel (or torch ops)."""
        # split-K partial sums only where the q/k norm reads V too
        qkv = decode_linear(x, self.qkv_proj.weight, planes=stored) if skinny else self.qkv_proj(x)
        v = None if qkv.dim() == 3 else qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if fused:
            q, k = _fusions().qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm.weight,
                                           self.k_norm.weight, self.q_norm.eps, rope.cos, rope.sin, positions,
                                           kv_cache=(self.k_cache, self.v_cache, meta.slot_mapping) if stored
                                           else None)
        else:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
            q, k = rope(positions, q, k)
        if stored:
            return attn.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, kv_stored=True)
        return attn.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)


class Qwen3MLP(nn.Module):
    def __init__(self, spec: Qwen3Spec, dtype: torch.dtype, tp: TensorParallel = SINGLE, call: int = 2):
        super().__init__()
        self.call = call  # the call of the add + norm after the down projection (its push's slot)
        self.intermediate_size = check_divisible("intermediate size", spec.intermediate_size, tp.size)  # this rank's
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [spec.intermediate_size] * 2, False, dtype, tp)
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, False, dtype, tp)

    def forward(self, x: torch.Tensor, step: StepKernels = EAGER) -> torch.Tensor | None:
        return row_parallel(self.down_proj, self.gate_up_silu(x, step), step, self.call)

    def gate_up_silu(self, x: torch.Tensor, step: StepKernels = EAGER) -> torch.Tensor:
        """silu(gate(x)) * up(x). In a skinny step with `fused_projections`, a gate/up shape measured to gain runs
        the projection and SiLU-and-multiply as one kernel (`fused.gate_up_silu`); otherwise, where the decode GEMMs
        are the early kernel (tensor parallelism), that kernel does SiLU-and-multiply in its epilogue
        (`gate_up_silu_early`)."""
        if not step.fused:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return F.silu(gate) * up
        kernels = _fusions()
        if not step.skinny:
            return kernels.silu_mul(self.gate_up_proj(x))
        w = self.gate_up_proj.weight
        if step.fused_projections:
            one_kernel = kernels.gate_up_silu_config(*w.shape)
            if one_kernel is not None:
                block_n, block_k, stages, warps = one_kernel
                return kernels.gate_up_silu(x, w, block_n=block_n, block_k=block_k, num_stages=stages,
                                            num_warps=warps)
            act = decode_gate_up_silu(x, w)
            if act is not None:
                return act
        return kernels.silu_mul(decode_linear(x, w))


def row_parallel(layer: RowParallelLinear, x: torch.Tensor, step: StepKernels, call: int) -> torch.Tensor | None:
    """layer(x) summed over the ranks, as the add + norm after it (number `call`) takes it: cuBLAS and the
    all-reduce, or in a skinny step `row_parallel_decode`'s planes, this rank's part, or nothing (pushed)."""
    if not step.skinny:
        return layer(x)
    return row_parallel_decode(x, layer, reduce=step.reducer is None, push=(call, step.calls) if step.push else None)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, spec: Qwen3Spec, dtype: torch.dtype, tp: TensorParallel = SINGLE, index: int = 0):
        super().__init__()
        # a forward's add + norms, in order: layer i's input norm is call 2i, its post-attention norm 2i + 1
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, call=2 * index)
        self.self_attn = Qwen3Attention(spec, dtype, tp, call=2 * index + 1)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, call=2 * index + 1)
        self.mlp = Qwen3MLP(spec, dtype, tp, call=2 * index + 2)

    def forward(self, h, residual, positions, rope, attn, meta, step: StepKernels = EAGER):
        """Hugging Face's layer after its input norm (which the model runs with the add before it, as vLLM's layers
        do): `h` is the normed input, `residual` the stream; returns the MLP's output and the stream to add it to."""
        h = self.self_attn(h, positions, rope, attn, meta, step)
        h, residual = self.post_attention_layernorm(h, residual, step)
        return self.mlp(h, step), residual


class Qwen3Model(nn.Module):
    def __init__(self, spec: Qwen3Spec, dtype: torch.dtype, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(spec, dtype, tp, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, call=2 * spec.num_hidden_layers)

    def forward(self, input_ids, positions, rope, attn, meta, step: StepKernels = EAGER) -> torch.Tensor:
        h, residual = self.embed(input_ids, step)
        # each layer's output added and normed by the next's input norm (zip stops short: a ModuleList's slice is a
        # new ModuleList, milliseconds on the host every forward)
        norms = [layer.input_layernorm for layer in self.layers]
        norms.append(self.norm)
        for layer, norm in zip(self.layers, norms[1:]):
            h, residual = norm(*layer(h, residual, positions, rope, attn, meta, step), step)
        return h

    def embed(self, input_ids: torch.Tensor, step: StepKernels = EAGER) -> tuple[torch.Tensor, torch.Tensor]:
        """The lookup and the first layer's input norm: (normed, residual). With the fused kernels one rank does both
        in one kernel; with the reducer the lookup's shard and the norm go through the all-reduce + norm kernel as
        call 0 (one kernel for the all-reduce, which PyTorch's one-shot all-reduce and the norm after it took two
        for); otherwise the lookup is all-reduced, then normed."""
        first = self.layers[0].input_layernorm
        if step.fused:
            norms = _norms()
            if self.tp.size == 1:
                return norms.embed_rmsnorm(input_ids, self.embed_tokens.weight, first.weight, first.eps)
            if step.reducer is not None:
                plane, residual = norms.embed_shard(input_ids, self.embed_tokens.weight, self.embed_tokens.vocab_start)
                return first(plane, residual, step)
            residual = self.embed_tokens(input_ids)
            return norms.add_rmsnorm(residual, None, first.weight, first.eps), residual
        residual = self.embed_tokens(input_ids)
        return first(residual), residual


class Qwen3ForCausalLM(nn.Module):
    # checkpoint projection -> (packed parameter, index of its slice in the packing order)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, spec: Qwen3Spec, dtype: torch.dtype, tp: TensorParallel = SINGLE):
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.model = Qwen3Model(spec, dtype, tp)
        # tied: logits use the embedding matrix itself
        self.lm_head = None if spec.tie_word_embeddings else ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype, tp)
        self.rope: RotaryEmbedding | None = None
        self.attn: TorchAttention | None = None
        self.path: DecodePath | None = None

    def setup(self, attn: TorchAttention, max_positions: int, device: torch.device, path: DecodePath) -> None:
        """Attach the attention backend and build the RoPE tables (after the weights are on `device`).

        `path.fused_norm` (CUDA only) runs residual add + RMSNorm, q/k RMSNorm + RoPE (with the K/V cache write when
        the backend allows) and SiLU-and-multiply as one Triton kernel each. `path.skinny_gemm` (CUDA, 16-bit
        weights, with `fused_norm`) runs the projections of steps of at most 16 tokens as weight-streaming Triton
        GEMMs; with tensor parallelism the row-parallel ones' split-K partial sums are added up and all-reduced
        before the residual add reads them (with one rank the residual add reads the partial sums itself), or go to
        the all-reduce + norm kernel (`path.norm_fusion`). `path.fused_projections` runs the qkv projection with the
        q/k norm, RoPE and K/V write, and the gate/up projection with SiLU-and-multiply, as one kernel each at the
        shapes measured to gain from it (the rest keep two).
        """
        self.attn = attn
        self.rope = RotaryEmbedding(self.spec.head_dim, self.spec.rope_theta, max_positions, device)
        self.path = path

    @property
    def fused_norm(self) -> bool:
        return self.path is not None and self.path.fused_norm

    @property
    def skinny_gemm(self) -> bool:
        return self.path is not None and self.path.skinny_gemm

    @property
    def fused_projections(self) -> bool:
        return self.path is not None and self.path.fused_projections

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        for layer, k_cache, v_cache in zip(self.model.layers, k_caches, v_caches, strict=True):
            layer.self_attn.k_cache = k_cache
            layer.self_attn.v_cache = v_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        begin = getattr(self.attn, "begin_forward", None)  # per-forward work of the backend, inside a CUDA graph
        if begin is not None:
            begin(meta)
        step = self.step_kernels(input_ids.shape[0])
        if step.reducer is not None:
            step.reducer.begin_forward()  # the slots its calls use move on
        return self.model(input_ids, positions, self.rope, self.attn, meta, step)

    def step_kernels(self, tokens: int) -> StepKernels:
        """The kernels a forward of `tokens` tokens takes, from the decode path."""
        path = self.path
        if path is None or not path.fused_norm:
            return EAGER
        skinny = path.skinny_gemm and tokens <= SKINNY_MAX_ROWS
        reducer = self.tp.reduce if skinny and path.norm_fusion else None
        return StepKernels(fused=True, skinny=skinny, fused_projections=skinny and path.fused_projections,
                           reducer=reducer, calls=2 * self.spec.num_hidden_layers + 1,
                           push=reducer is not None and path.all_reduce_push == "on")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (gathered from every rank's shard with tensor parallelism)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if self.skinny_gemm and hidden.shape[0] <= SKINNY_MAX_ROWS:
            return head.gather_logits(decode_linear(hidden.contiguous(), head.weight))
        return head.logits(hidden)
