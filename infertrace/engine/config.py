"""Every choice a user of the bundled engine makes (a feature, a size, an ablation phase), declared once and validated
once. Tuning that follows from the rank count, the shapes or the device is not here: it is a rule beside the kernel it
tunes, which an experiment overrides through $INFERTRACE_KERNEL_TUNING (engine/kernels/tuning.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infertrace.config_fields import FlagSet, check_types, parse_overrides, setting
from infertrace.engine.spec_config import SpeculativeConfig

ATTENTION_MODES = ("batched", "looped")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")
OFFLOAD_MODES = ("off", "prefix", "long", "prefix+long")
ASYNC_SCHEDULING = ("auto", "on", "off")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
ALL_REDUCE_MODES = ("auto", "nccl", "custom")
POOLING_TYPES = ("LAST", "MEAN")  # vLLM's names (vllm/config/pooler.py); LAST is its default for decoder models
DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# token counts of prefill and mixed steps: 16 apart up to 1,024 tokens (vLLM's spacing of its capture sizes above
# 256), so a prompt chunk with the decodes of a mixed step beside it pads by at most 15 tokens (cuBLAS's GEMM time is
# jagged in the token count); then about an eighth apart, so a step pads by at most about 12%; sizes above
# max_num_batched_tokens are never captured
DEFAULT_CUDA_GRAPH_TOKEN_SIZES = (
    *range(16, 1025, 16), 1152, 1280, 1536, 1792, 2048, 2304, 2560, 3072, 3584, 4096, 4608, 5120, 6144, 7168, 8192,
)


@dataclass(slots=True)
class EngineConfig:
    # paged KV cache
    block_size: int = setting(16, "Tokens per KV-cache block.")
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3", vLLM's names): K and V stored as float8 e4m3 with a scale of
    # 1.0 (rounded to nearest, saturated at +-448) and widened exactly where attention reads them (to float16 for the
    # GPU kernels' dots under a 16-bit model, else to the model's dtype), so a token's KV takes half the bytes of
    # bf16: twice the tokens in the same memory, half the reads of a decode step; not with offload
    kv_cache_dtype: str = setting(
        "auto", "KV-cache dtype: auto (the model's) or fp8 (float8 e4m3, scale 1.0; also fp8_e4m3).")
    kv_cache_tokens: int | None = setting(None, "KV-cache size in tokens; unset: sized from memory.")
    gpu_memory_utilization: float = setting(0.9, "Share of GPU memory the engine may use, KV cache included.")
    cpu_kv_cache_gb: float = setting(0.5, "KV-cache budget in GB on a CPU device when --kv-cache-tokens is unset.")
    # scheduling
    max_num_seqs: int = setting(256, "Most requests in one running batch.")
    max_num_batched_tokens: int = setting(8192, "Token budget of one engine step.")
    max_model_len: int | None = setting(
        None, "Context length; unset: the model's max_position_embeddings (capped by the KV cache).")
    chunked_prefill: bool = setting(True, "Split long prefills across steps and batch them with decodes.",
                                    aliases=("enable-chunked-prefill",))
    long_prefill_token_threshold: int = setting(0, "Most prefill tokens of one request per step; 0: no limit.")
    prefix_caching: bool = setting(True, "Reuse KV blocks of shared prompt prefixes.",
                                   aliases=("enable-prefix-caching",))
    # plan and queue step N+1 while step N runs on the device, feeding N's sampled tokens to N+1 on the device;
    # "auto": on for CUDA (the host's share of a decode step then hides behind the GPU's), off on CPU
    async_scheduling: str = setting(
        "auto", "Plan and queue the next step while the current one runs: auto (on for CUDA), on or off.")
    # attention and the decode path
    attention: str = setting(
        "batched", "batched: one attention kernel for the batch; looped: one request at a time (ablation).")
    attention_backend: str = setting(
        "auto", "Attention kernels: auto (triton on CUDA, with FlashAttention-4 for long prefills where installed; torch "
        "elsewhere), torch, triton, or flash (FlashAttention-4, Hopper and later; pip install 'infertrace[flash]').")
    cuda_graphs: bool = setting(True, "Capture decode steps in CUDA graphs per batch-size bucket (no effect on CPU).")
    # prefill and mixed steps replay CUDA graphs per token-count bucket (cuda_graph_token_sizes, up to
    # max_num_batched_tokens; larger steps run eagerly), the paged attention inside them over a grid fixed by the
    # bucket; needs the Triton backend in batched mode; no effect on CPU
    prefill_cuda_graphs: bool = setting(
        True, "Capture prefill and mixed steps in CUDA graphs per token-count bucket, the attention inside them "
              "(CUDA; no effect on CPU).")
    static_buffers: bool = setting(
        True, "Step inputs live in buffers allocated once; off: fresh tensors every step (ablation).")
    # small fusions on CUDA, one Triton kernel each: residual add + RMSNorm, q/k RMSNorm + RoPE, SiLU-and-multiply
    fused_norm: bool = setting(
        True, "Fused Triton kernels on CUDA: residual add + RMSNorm, q/k RMSNorm + RoPE, SiLU-and-multiply.")
    # with fused_norm, on CUDA with 16-bit weights: projections of steps of <= 16 tokens as weight-streaming Triton
    # GEMMs (split-K sums added in float32 and read by the next residual add + RMSNorm)
    skinny_gemm: bool = setting(
        True, "Projections of small decode steps as weight-streaming Triton GEMMs (CUDA, 16-bit, fused norm).")
    # with skinny_gemm: the qkv projection with the q/k norm, RoPE and K/V write, and the gate/up projection with
    # SiLU-and-multiply, one kernel each, at the shapes kernels/fused.py's rules take; and where the decode GEMMs are
    # the early kernel (kernels/skinny_gemm.py early_rule: with tensor parallelism) the gate/up projection's does
    # SiLU-and-multiply in its epilogue
    fused_projections: bool = setting(
        True, "With --skinny-gemm: the qkv projection with its q/k norm and RoPE, and the gate/up projection with "
              "SiLU, as one kernel each at the shapes the kernels' rules take (qwen3-4b's; gate/up at every shape "
              "with tensor parallelism).")
    # programmatic dependent launch of the Triton kernels on Hopper and later (compute capability 9.0): a kernel's
    # programs start while the one before drains, and wait for its results on the device. No effect elsewhere
    pdl: bool = setting(
        True, "Programmatic dependent launch of the Triton kernels (Hopper and later): each starts while the one "
              "before drains.")
    # decode attention (Triton backend) launches its sequences' programs longest context first: over mixed context
    # lengths a long context launched last otherwise runs on alone while the rest of the GPU idles
    decode_longest_first: bool = setting(
        True, "Decode attention launches its requests' programs longest context first (Triton backend).")
    cuda_graph_batch_sizes: tuple[int, ...] = setting(
        DEFAULT_CUDA_GRAPH_BATCH_SIZES, "Batch-size buckets captured in CUDA graphs, comma-separated.")
    cuda_graph_token_sizes: tuple[int, ...] = setting(
        DEFAULT_CUDA_GRAPH_TOKEN_SIZES, "Token-count buckets of the prefill and mixed-step graphs, comma-separated "
                                        "(capped at --max-num-batched-tokens, which is always one).")
    # CPU KV offload
    offload: str = setting(
        "off", "CPU KV offload: off; prefix (a host tier of the prefix cache); long (contexts beyond the GPU's KV, "
               "streamed through GPU slots); or prefix+long.")
    offload_host_gb: float = setting(4.0, "Pinned host memory for offloaded KV, in GB.")
    offload_chunk_tokens: int = setting(
        4096, "Long offload: tokens per GPU ring slot, the unit KV is streamed in.")
    offload_ring_slots: int = setting(
        4, "Long offload: GPU slots the chunks stream through (one loads while another is attended); at least 2.")
    # tensor parallelism: one process per rank (rank r on cuda:r; gloo on CPU), rank 0 schedules and samples;
    # above 1: no KV offload
    tensor_parallel_size: int = setting(
        1, "Tensor-parallel ranks, one process each (rank r on cuda:r; gloo on CPU).")
    # with more ranks on GPUs: "custom" all-reduces messages up to 8 MiB through PyTorch's symmetric-memory one-shot
    # / two-shot kernels over NVLink peer memory (captured in the CUDA graphs) and larger ones through NCCL; "auto"
    # takes it where every GPU reaches its peers' memory, else NCCL (engine/allreduce.py)
    all_reduce: str = setting(
        "auto", "Tensor-parallel all-reduce: auto, nccl, or custom (peer-memory one-shot for small messages, NCCL "
                "above 8 MiB).")
    # numerics and placement
    dtype: str = setting("auto", "Weight and activation dtype; auto: the checkpoint's (float16 becomes float32 on "
                                 "CPU).")
    device: str = setting("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N.")
    seed: int = setting(0, "Engine random seed (requests may carry their own).")
    # speculative decoding (vLLM's JSON): drafts verified in one target step per request, output unchanged
    speculative_config: str | dict | None = setting(
        None, "Speculative decoding as JSON, vLLM's shape: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4} or {\"method\": \"draft_model\", \"model\": "
              "DIR_OR_PRESET, \"num_speculative_tokens\": 4}; unset: off.")
    # observability: each request's life (arrival, the steps it rode, its end) kept for the last this many requests,
    # with the steps of about the last million request rows (engine/request_log.py); 0 turns the log off
    request_log_size: int = setting(
        100_000, "Requests the request log keeps (GET /v1/request_log); 0: off.")
    # /v1/embeddings (engine/pooling.py)
    pooling_type: str = setting(
        "LAST", "/v1/embeddings: pool the last layer's hidden state of the LAST token or the MEAN of all tokens.")

    def __post_init__(self) -> None:
        for name in ("cuda_graph_batch_sizes", "cuda_graph_token_sizes"):
            if isinstance(getattr(self, name), (list, tuple)):
                setattr(self, name, tuple(sorted(set(getattr(self, name)))))
        check_types(self)
        _check_sizes(self)
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        _check_choice("pooling_type", self.pooling_type, POOLING_TYPES)
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens={self.kv_cache_tokens} is smaller than one KV block (block_size={self.block_size})"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"cpu_kv_cache_gb must be positive, got {self.cpu_kv_cache_gb}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.request_log_size < 0:
            raise ValueError(f"request_log_size must be >= 0, got {self.request_log_size}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        _check_choice("async_scheduling", self.async_scheduling, ASYNC_SCHEDULING)
        _check_choice("attention", self.attention, ATTENTION_MODES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("offload", self.offload, OFFLOAD_MODES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("all_reduce", self.all_reduce, ALL_REDUCE_MODES)
        if self.kv_cache_dtype != "auto" and self.offload != "off":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with offload={self.offload!r}")
        for name in ("cuda_graph_batch_sizes", "cuda_graph_token_sizes"):
            sizes = getattr(self, name)
            if not sizes or min(sizes) < 1:
                raise ValueError(f"{name} must be positive integers, got {sizes}")
        if self.offload_host_gb <= 0:
            raise ValueError(f"offload_host_gb must be positive, got {self.offload_host_gb}")
        if self.offload_chunk_tokens < 1:
            raise ValueError(f"offload_chunk_tokens must be at least 1, got {self.offload_chunk_tokens}")
        if self.offload_ring_slots < 2:
            raise ValueError(
                f"offload_ring_slots must be at least 2 (one GPU slot loads while another is attended), "
                f"got {self.offload_ring_slots}"
            )
        if self.offload_prefix and not self.prefix_caching:
            raise ValueError(f"offload={self.offload!r} is a tier of the prefix cache and needs prefix_caching=true")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        self._check_tensor_parallel()
        self._check_speculative()

    def _check_speculative(self) -> None:
        if self.speculative_config is None:
            return
        spec = SpeculativeConfig.parse(self.speculative_config)
        self.speculative_config = spec.as_dict()  # one spelling, whatever form it came in
        # a verify step needs its drafts' outcome on the host before the next step is planned
        if self.async_scheduling == "on":
            raise ValueError("speculative_config needs async_scheduling 'auto' or 'off' (drafts are proposed from "
                             "the tokens of the step before)")
        if self.offload != "off":
            raise ValueError(f"speculative_config is not supported with offload={self.offload!r}")
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative_config is not supported with tensor_parallel_size > 1")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative-decoding settings, or None when it is off."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
        if tp == 1:
            return
        if self.offload != "off":
            raise ValueError(f"offload={self.offload!r} is not supported with tensor_parallel_size={tp}")
        if self.all_reduce == "custom" and self.device == "cpu":
            raise ValueError("all_reduce='custom' needs CUDA GPUs that reach each other's memory; use 'nccl' or "
                             "'auto' on CPU")
        if self.device.startswith("cuda:"):
            raise ValueError(f"with tensor_parallel_size={tp} rank r runs on cuda:r; use device='cuda' or 'auto', "
                             f"and CUDA_VISIBLE_DEVICES to pick the GPUs (got device={self.device!r})")

    @property
    def offload_prefix(self) -> bool:
        """Full blocks are kept in a host tier of the prefix cache."""
        return self.offload in ("prefix", "prefix+long")

    @property
    def offload_long(self) -> bool:
        """A sequence whose KV does not fit the GPU pool keeps it in host memory and streams it per layer."""
        return self.offload in ("long", "prefix+long")

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any] | None = None, base: EngineConfig | None = None) -> EngineConfig:
        """A config from `base` (or the defaults) with `overrides` applied.

        Values may be strings (from a command line): they are parsed by the field's type.
        """
        values = dataclasses.asdict(base) if base is not None else {}
        return cls(**(values | parse_overrides(cls, overrides or {}, "engine config")))


# the engine's settings as flags, for `serve` and for `bench` with the bundled engine in-process
ENGINE_FLAGS = FlagSet(
    EngineConfig, prefix="engine__", what="engine config", overrides_flag="--engine-opt", example="attention=looped",
    shortcuts={"enforce-eager": ({"cuda_graphs": False, "prefill_cuda_graphs": False},
                                 "Same as --no-cuda-graphs --no-prefill-cuda-graphs: every step eager (vLLM's name).")},
)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_sizes(cfg: EngineConfig) -> None:
    for name in ("cuda_graph_batch_sizes", "cuda_graph_token_sizes"):
        sizes = getattr(cfg, name)
        if any(not isinstance(size, int) or isinstance(size, bool) for size in sizes):
            raise ValueError(f"{name} must be integers, got {sizes!r}")
