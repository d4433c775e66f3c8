"""What a GPU kernel is, from its name: HTA's kernel type, an inference category, and a readable short name.

HTA's kernel type (COMMUNICATION / MEMORY / COMPUTATION / OTHER) comes from HTA's own classifier (traceinsight
0.6.1), with two corrections: HTA counts as communication only names that start with `nccl`, `hccl` or `hip` (or
hold `ncclKernel`), so the custom all-reduce kernels of vLLM, SGLang, TensorRT-LLM and torch symmetric memory
(`cross_device_reduce_*`, `multimem_all_reduce_kernel`, `oneShotAllReduceKernel`, ...) are reclassified as
communication here; and HTA tests its `^hip` communication pattern before its memory pattern, so `hipMemcpy*` and
`hipMemset*`, which its memory pattern names, are memory here. Each name is classified once, not once per kernel
launch.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

COMMUNICATION, MEMORY, COMPUTATION, OTHER = "COMMUNICATION", "MEMORY", "COMPUTATION", "OTHER"
MEMORY_RE = re.compile(r"^(?:hip)?(?:Memcpy|Memset)|^dma")  # HTA 0.6.1's memory-kernel pattern

# Collective and point-to-point kernels, whatever library launched them.
COMM_RE = re.compile(
    r"nccl|rccl|msccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|multimem|cross_device_reduce"
    r"|custom_?ar|quick_?reduce|lamport|deep_?ep|nvshmem|sendrecv|send_recv",
    re.IGNORECASE,
)

# Inference categories, first match wins; the order matters (a GEMM with a fused SwiGLU epilogue is a GEMM,
# a fused "add_rmsnorm" is a norm, not elementwise). Rules see the name without its parameter list, whose
# argument types (`flashinfer::QuantizationSFLayout`, `fbgemm_gpu::FixedDivisor`) say nothing about the kernel.
_CATEGORY_RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("memcpy/memset", re.compile(r"^(hip)?(Memcpy|Memset)|^dma", re.IGNORECASE)),
    ("communication", COMM_RE),
    # a projection fused with the kernel after it streams the projection's weights, so it is a GEMM: the bundled
    # engine's one-kernel qkv + q/k norm + RoPE + K/V write, and gate/up + SiLU-and-multiply
    ("GEMM", re.compile(r"qkv_norm_rope|gate_up_silu", re.IGNORECASE)),
    ("norm", re.compile(r"qk_?norm", re.IGNORECASE)),  # a QK norm fused with RoPE is a norm, not attention
    ("attention", re.compile(
        r"flash_?attn|flash_fwd|flash_bwd|flash::|pytorch_flash|fmha|attention|attn|mha|paged_?kv|batch_?decode"
        r"|batch_?prefill|sdpa|xformers|rotary|\brope|_rope|rope_|reshape_and_cache|kv_?cache|kv_?indices"
        r"|merge_?(?:attn_)?states?|merge_splits|cascade|^_fwd_(?:grouped_)?kernel(?:_stage\d)?$",
        re.IGNORECASE)),
    ("GEMM", re.compile(
        r"(?<!fb)gemm|gemv|matmul|cublas|Cijk_|nvjet|xmma|wgmma|bmm|splitk|cutlass::Kernel|cutlass_\d|tensorop"
        r"|_mm_|mm_kernel|fused_moe|grouped_mm|hipblaslt|rocblas", re.IGNORECASE)),
    ("norm", re.compile(r"rms_?norm|layer_?norm|group_?norm|batch_?norm|norm_kernel|_norm_", re.IGNORECASE)),
    ("activation", re.compile(r"silu|gelu|swiglu|geglu|relu|act_and_mul|activation|swish|sigmoid",
                              re.IGNORECASE)),
    ("elementwise", re.compile(
        r"elementwise|vectorized|unrolled|pointwise|triton_poi|copy|fill|cat_?array|gather|scatter|index"
        r"|arange|where_kernel", re.IGNORECASE)),
)


# The same rules over lowercased names, without IGNORECASE (four times faster on long names).
_COMM_LOWER = re.compile(COMM_RE.pattern.lower())
_CATEGORY_LOWER = tuple((label, re.compile(pattern.pattern.lower())) for label, pattern in _CATEGORY_RULES)


def hta_kernel_type(name: str) -> str:
    """HTA's kernel type of `name`, with non-nccl collectives counted as communication."""
    from hta.utils.utils import get_kernel_type

    if MEMORY_RE.match(name):
        return MEMORY
    kind = get_kernel_type(name)
    if kind != COMMUNICATION and kind != MEMORY and _COMM_LOWER.search(name.lower()):
        return COMMUNICATION
    return kind


def category(name: str, kind: str = "kernel") -> str:
    """The inference category of a GPU event (`kind` is its event kind: kernel, memcpy or memset)."""
    if kind in ("memcpy", "memset"):
        return "memcpy/memset"
    core = _without_parameters(name).lower()  # mangled names keep their template types, which name the operation
    for label, pattern in _CATEGORY_LOWER:
        if pattern.search(core):
            return label
    return "other"


def per_event(events: pd.DataFrame, fn) -> np.ndarray:
    """`fn(name, kind)` for each row of `events`, evaluated once per distinct (name, kind)."""
    if events.empty:
        return np.empty(0, dtype=object)
    names, kinds = events["name"].cat.categories, events["kind"].cat.categories
    # one int64 per (name, kind): factorizing it is a hash of integers, not of tuples
    pairs = events["name"].cat.codes.to_numpy().astype(np.int64) * len(kinds) + events["kind"].cat.codes.to_numpy()
    codes, uniques = pd.factorize(pairs)
    values = np.array([fn(names[u // len(kinds)], kinds[u % len(kinds)]) for u in uniques.tolist()], dtype=object)
    return values[codes]


def add_classes(gpu: pd.DataFrame) -> pd.DataFrame:
    """A copy of GPU events with `kernel_type` (HTA's, corrected) and `category` columns."""
    out = gpu.copy()
    out["kernel_type"] = per_event(gpu, lambda name, kind: hta_kernel_type(name))
    out["category"] = per_event(gpu, category)
    return out


_DROPPED_NAMESPACES = ("at::native::", "at::", "c10::", "std::", "cute::", "::")
_FUNCTOR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:Functor|_kernel_cuda|_kernel_impl|_kernel|Kernel|_functor|Op)\b")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{5,}(?![A-Za-z0-9_]|::)")
_GENERIC_HEADS = {"Kernel", "Kernel2", "kernel", "kentry", "device_kernel", "trampoline_kernel"}
_TYPE_WORDS = {"float", "double", "unsigned", "signed", "short", "BFloat16", "Half", "bfloat16", "__nv_bfloat16",
               "__half", "Float8_e4m3fn", "anonymous", "namespace", "detail", "native", "cutlass", "ck_tile"}


def short_name(name: str, width: int | None = 72) -> str:
    """A readable kernel name: demangled head, no return type or parameters, the functor kept; cut to `width`
    characters with `…` unless `width` is None.

    `void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, ...>(int, ...)`
    becomes `vectorized_elementwise_kernel<FillFunctor>`."""
    text = _demangle_head(name).strip()
    if text.startswith(("Memcpy", "Memset")) or ("<" not in text and "(" not in text):
        return _clip(text, width)
    text = text.replace("(anonymous namespace)::", "").replace("anonymous_namespace::", "")
    skeleton, templates = _split_templates(_strip_groups(text, "(", ")"))
    tokens = skeleton.split()
    if not tokens:
        return _clip(text, width)
    head = tokens[-1]
    head_at = skeleton.rfind(head)
    for prefix in _DROPPED_NAMESPACES:
        while head.startswith(prefix):
            head = head[len(prefix):]
    inner = " ".join(body for at, body in templates if at >= head_at)
    base = head.rsplit("::", 1)[-1]
    found = [m for m in _FUNCTOR.findall(inner) if m != base]
    if not found and base in _GENERIC_HEADS:
        found = [m for m in _IDENT.findall(inner) if m not in _TYPE_WORDS and not m.startswith("ROCPRIM")]
    return _clip(f"{head}<{found[0]}>" if found else head, width)


def _clip(text: str, width: int) -> str:
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


def _strip_groups(text: str, open_: str, close: str) -> str:
    """`text` without any balanced `open_ ... close` groups (and their contents)."""
    out, depth = [], 0
    for ch in text:
        if ch == open_:
            depth += 1
        elif ch == close and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return "".join(out)


def _split_templates(text: str) -> tuple[str, list[tuple[int, str]]]:
    """The text outside `<...>` and each top-level template argument list with its position in that text."""
    skeleton: list[str] = []
    templates: list[tuple[int, str]] = []
    depth, current = 0, []
    for ch in text:
        if ch == "<":
            depth += 1
            if depth == 1:
                current = []
                continue
        elif ch == ">" and depth:
            depth -= 1
            if depth == 0:
                templates.append((len(skeleton), "".join(current)))
                continue
        if depth:
            current.append(ch)
        else:
            skeleton.append(ch)
    return "".join(skeleton), templates


def _without_parameters(name: str) -> str:
    """`name` without its trailing parameter list `(...)`."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        if name[i] == ")":
            depth += 1
        elif name[i] == "(":
            depth -= 1
            if depth == 0:
                return name[:i]
    return name


_MANGLED = re.compile(r"^_Z(N?)((?:\d+[A-Za-z_][A-Za-z0-9_]*)+)")


def _demangle_head(name: str) -> str:
    """`_ZN7ck_tile6kentryILi2ENS_38FmhaBatchPrefill...` -> `ck_tile::kentry<FmhaBatchPrefill...>`: the names
    of an Itanium-mangled symbol and of its first named template argument, without types."""
    m = _MANGLED.match(name)
    if not m:
        return name
    parts, rest = _length_prefixed(m.group(2))
    head = "::".join(p for p in parts if p) or name
    tail = name[m.end(2) - len(rest):]
    if tail.startswith("I"):
        for inner in re.finditer(r"(?<![0-9])\d+(?=[A-Za-z_])", tail):
            ident, _ = _length_prefixed(tail[inner.start():])
            if ident and len(ident[0]) >= 4 and ident[0].isidentifier():  # skips literals such as Li2E
                head += f"<{ident[0]}>"
                break
    return head


def _length_prefixed(text: str) -> tuple[list[str], str]:
    parts = []
    while text and text[0].isdigit():
        digits = re.match(r"\d+", text).group(0)
        length = int(digits)
        parts.append(text[len(digits): len(digits) + length])
        text = text[len(digits) + length:]
    return parts, text
