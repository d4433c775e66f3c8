"""Decode-shaped GEMMs (8 rows) against the bytes they must read: cuBLAS variants and the skinny Triton kernel.

    python benchmarks/gemm_bench.py [--rows 8] [--quick | --engine-only | --split-sweep | --fused-qkv | --fused-gate-up
                                     | --silu-epilogue]

Each timing cycles through enough copies of the weight that none is served from L2, as in a real decode step
where 36 layers of weights pass through the cache. Prints, per shape, each variant's time and its share of the
measured copy bandwidth, then the best skinny-kernel configurations as a table to paste into the kernel's config.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/gemm_bench.py` too
from benchmarks.common import copy_bandwidth  # noqa: E402
from infertrace.engine.kernels.skinny_gemm import skinny_gemm  # noqa: E402

SHAPES = {  # qwen3-4b projections: (N, K)
    "qkv_proj": (6144, 2560),
    "o_proj": (2560, 4096),
    "gate_up_proj": (19456, 2560),
    "down_proj": (2560, 9728),
    "lm_head": (151936, 2560),
}


def timed(fn_for_weight, weights) -> float:
    """Median seconds per call, over calls that each read a different copy of the weight."""
    def run():
        for w in weights:
            fn_for_weight(w)
    ms = triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median")
    return ms * 1e-3 / len(weights)


def engine_calls(m: int, peak: float) -> None:
    """The projections exactly as the model's decode path calls them (decode_linear: tuned tiling, split-K as
    float32 partial-sum planes), against cuBLAS, over 36 layers' worth of weights."""
    from infertrace.engine.kernels.fused import silu_mul
    from infertrace.engine.models.qwen3 import decode_linear

    layers = 36
    print(f"\nas the engine calls them ({layers} weight copies, {m} rows):")
    for name, (n, k) in SHAPES.items():
        if name == "lm_head":
            continue
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        x = torch.randn(m, 2 * k if name == "down_proj" else k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k * 2
        rows = []
        if name == "down_proj":
            rows.append(("cuBLAS after silu_mul kernel",
                         timed(lambda w: torch.nn.functional.linear(silu_mul(x), w), weights)))
            rows.append(("silu_mul kernel + decode_linear (split-K planes)",
                         timed(lambda w: decode_linear(silu_mul(x), w, planes=True), weights)))
        else:
            rows.append(("cuBLAS", timed(lambda w: torch.nn.functional.linear(x, w), weights)))
            planes = name == "o_proj"
            rows.append(("decode_linear" + (" (split-K planes)" if planes else ""),
                         timed(lambda w: decode_linear(x, w, planes=planes), weights)))
        for label, t in rows:
            print(f"  {name:<14} {label:<44} {t * 1e6:8.1f} us  {100 * nbytes / t / peak:5.1f}% of copy bw")
        del weights
        torch.cuda.empty_cache()


SPLIT_SHAPES = {  # projections whose split-K planes the kernel after them adds up: (N, K, that kernel, KV heads)
    "o_proj": (2560, 4096, "norm", 0),  # the residual add + RMSNorm
    "down_proj": (2560, 9728, "norm", 0),
    "o_proj 0.6b": (1024, 2048, "norm", 0),
    "down_proj 0.6b": (1024, 3072, "norm", 0),
    "qkv_proj": (6144, 2560, "qknorm", 8),  # the q/k norm + RoPE writing K and V to the cache (32 q, 8 KV heads)
    "qkv_proj 0.6b": (4096, 1024, "qknorm", 8),  # (16 q, 8 KV heads)
    # one rank's shard at tensor parallelism (a single GPU measures it: the all-reduce is not part of the pair)
    "o_proj 4b tp2": (2560, 2048, "norm", 0),
    "down_proj 4b tp2": (2560, 4864, "norm", 0),
    "qkv_proj 4b tp2": (3072, 2560, "qknorm", 4),
    "o_proj 4b tp4": (2560, 1024, "norm", 0),
    "down_proj 4b tp4": (2560, 2432, "norm", 0),
    "qkv_proj 4b tp4": (1536, 2560, "qknorm", 2),
    "o_proj 14b tp2": (5120, 2560, "norm", 0),
    "down_proj 14b tp2": (5120, 8704, "norm", 0),
    "qkv_proj 14b tp2": (3584, 5120, "qknorm", 4),
    "o_proj 14b tp4": (5120, 1280, "norm", 0),
    "down_proj 14b tp4": (5120, 4352, "norm", 0),
    "qkv_proj 14b tp4": (1792, 5120, "qknorm", 2),
    # the gate/up projection before SiLU-and-multiply (no split: silu_mul reads the projection's own output)
    "gate_up 14b tp2": (17408, 5120, "silu", 0),
    "gate_up 14b tp4": (8704, 5120, "silu", 0),
}


def _consumer(kind: str, m: int, n: int, kv_heads: int = 8):
    """The kernel that reads a projection's output in a decode layer, as a function of that output."""
    from infertrace.engine.kernels.fused import qk_norm_rope
    from infertrace.engine.kernels.norm import add_rmsnorm

    dev, dt = "cuda", torch.bfloat16
    if kind == "silu":
        from infertrace.engine.kernels.fused import silu_mul

        return silu_mul
    if kind == "norm":
        residual = torch.zeros(m, n, device=dev, dtype=dt)
        norm_w = torch.ones(n, device=dev, dtype=dt)
        return lambda out: add_rmsnorm(out, residual, norm_w, 1e-6)
    d = 128
    q_heads = n // d - 2 * kv_heads
    qk_w = torch.ones(d, device=dev, dtype=dt)
    cos, sin = torch.randn(4096, d, device=dev), torch.randn(4096, d, device=dev)
    positions = torch.arange(100, 100 + m, device=dev)
    cache = (torch.zeros(1024, kv_heads, d, device=dev, dtype=dt), torch.zeros(1024, kv_heads, d, device=dev, dtype=dt),
             torch.arange(m, device=dev) * 7)
    return lambda out: qk_norm_rope(out, q_heads, kv_heads, d, qk_w, qk_w, 1e-6, cos, sin, positions, kv_cache=cache)


def _pair_timer(n: int, k: int, kind: str, kv_heads: int, m: int, layers: int = 36):
    """time(block_n, block_k, split_k, stages) -> seconds a pair: the skinny GEMM of an [m, k] x [n, k]^T projection
    with the tiling, then the kernel after it (`_consumer`), `layers` pairs (each its own weight copy) in one CUDA
    graph; a tiling whose result is off by more than 2e-2 of the largest value raises."""
    from infertrace.engine.kernels.skinny_gemm import skinny_gemm

    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    consume = _consumer(kind, m, n, kv_heads)
    ref = torch.nn.functional.linear(x, weights[0]).float()

    def time_tiling(bn, bk, sk, stages):
        cfg = dict(block_n=bn, block_k=bk, split_k=sk, num_stages=stages)
        got = skinny_gemm(x, weights[0], **cfg).float()
        err = float(((got if sk == 1 else got.sum(0)) - ref).abs().max() / ref.abs().max())
        if err > 2e-2:
            raise ValueError(f"wrong result (rel err {err:.3g})")
        return timed(lambda w: consume(skinny_gemm(x, w, **cfg)), weights)

    return time_tiling


def shards_check(m: int) -> None:
    """Every tiling of `skinny_gemm.SHARDS` (each measured on one GPU model) against the rules' tiling for that shape
    on this GPU, pairs timed as `split_sweep` times them."""
    from infertrace.engine.kernels import launch, skinny_gemm

    launch.set_enabled(True)
    kinds = {(n, k): (kind, kv) for n, k, kind, kv in SPLIT_SHAPES.values()}
    print("| shard (N, K) | the rules' tiling | us | SHARDS' tiling | us |\n| --- | --- | --- | --- | --- |")
    tilings = {shape: tiling for table in skinny_gemm.SHARDS.values() for shape, tiling in table.items()}
    for (n, k), tiling in tilings.items():
        kind, kv_heads = kinds[(n, k)]
        rules = skinny_gemm.rules_config(n, k, planes=kind != "silu")  # unsplit where nothing adds planes
        time_tiling = _pair_timer(n, k, kind, kv_heads, m)
        t_rules, t_shard = time_tiling(*rules), time_tiling(*tiling)
        print(f"| {n}, {k} ({kind}) | {rules} | {t_rules * 1e6:.2f} | {tiling} | {t_shard * 1e6:.2f} |", flush=True)
        del time_tiling
        torch.cuda.empty_cache()
    launch.set_enabled(False)


def split_sweep(m: int, peak: float, names: list[str], top: int = 4,
                tuning_out: str | None = None) -> dict[str, tuple[int, int, int, int]]:
    """Projections followed by the kernel that adds their split-K planes (SPLIT_SHAPES), 36 pairs (each its own
    weight copy) in one CUDA graph with programmatic dependent launch, as in a decode graph: time per pair for
    tilings at 4 stages, then the best `top` at other stage counts. Returns the best tiling of each shape. With
    `tuning_out`, each shape's best tiling that beats the engine's own is written there as it is found, in the form
    INFERTRACE_KERNEL_TUNING reads (kernels/tuning.py), for a decode-graph run to try."""
    from infertrace.engine.kernels import launch
    from infertrace.engine.kernels.skinny_gemm import decode_config

    launch.set_enabled(True)
    layers, best = 36, {}
    for name in names:
        n, k, kind, kv_heads = SPLIT_SHAPES[name]
        time_tiling = _pair_timer(n, k, kind, kv_heads, m, layers)
        tried: dict[tuple, float] = {}
        # K divisible into whole tiles a slice: a slice ending in a partial tile loads without the pipeline
        splits, widths = ((1,), (16, 32, 64)) if kind == "silu" else ((1, 2, 4, 8), (32, 64))
        grid = [(bn, bk, sk, 4) for bn, bk, sk in itertools.product(widths, (64, 128, 256), splits)
                if k % (bk * sk) == 0 and (bk > 64 or k % (128 * sk))]
        engine = decode_config(n, k, planes=kind != "silu")
        engine = engine[:2] + (1,) + engine[3:] if kind == "silu" else engine
        for cfg in grid + [engine]:
            if cfg in tried:
                continue
            try:
                tried[cfg] = time_tiling(*cfg)
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or run is skipped
                print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        for cfg in sorted(tried, key=tried.get)[:top]:
            for stages in (3, 5, 6):
                alt = cfg[:3] + (stages,)
                if alt not in tried:
                    try:
                        tried[alt] = time_tiling(*alt)
                    except Exception as exc:  # noqa: BLE001
                        print(f"  {name} {alt}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        nbytes = n * k * 2
        print(f"\n{name}: N={n} K={k}, GEMM + {kind} pairs, {layers} in a graph with PDL, {m} rows "
              f"(engine's tiling {engine}: {tried[engine] * 1e6:.2f} us)")
        print("| block_n, block_k, split_k, stages | us a pair | weights' share of copy bw |\n| --- | --- | --- |")
        for cfg in sorted(tried, key=tried.get)[:8]:
            print(f"| {cfg} | {tried[cfg] * 1e6:.2f} | {100 * nbytes / tried[cfg] / peak:.1f}% |", flush=True)
        best[name] = min(tried, key=tried.get)
        if tuning_out and tried[best[name]] < tried[engine]:
            path = Path(tuning_out)
            table = json.loads(path.read_text()) if path.exists() else {}
            table.setdefault("skinny_gemm", {})[f"{n},{k}"] = list(best[name])
            path.write_text(json.dumps(table, indent=2))
        del time_tiling
        torch.cuda.empty_cache()
    launch.set_enabled(False)
    return best


def _two_against_one(pair, one, configs, weights, rounds: int, note: str = "") -> None:
    """Prints us a layer of `pair` (two kernels) and of `one` at each tiling of `configs`, `rounds` times over the
    weight copies; a tiling that does not fit is reported and skipped."""
    times: dict[str, list[float]] = {"two kernels": [], **{str(c): [] for c in configs}}
    for _ in range(rounds):
        times["two kernels"].append(timed(pair, weights))
        for c in configs:
            try:
                times[str(c)].append(timed(lambda w, c=c: one(w, c), weights))
            except Exception as exc:  # noqa: BLE001 - a tiling that does not fit is reported and skipped
                print(f"  {c}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
    for name, ts in times.items():
        if ts:
            print(f"  {name:<18} " + ", ".join(f"{t * 1e6:.2f}" for t in ts) + f" us a layer{note}", flush=True)


def fused_qkv(m: int, configs=((128, 4, 4), (128, 5, 4), (128, 6, 4), (64, 8, 4), (256, 4, 8), (128, 6, 8)),
              rounds: int = 2) -> None:
    """The qkv projection and the q/k norm + RoPE + K/V write after it (the skinny GEMM at the engine's tiling, then
    `qk_norm_rope`) against the one kernel `qkv_norm_rope` at each (block_k, num_stages, num_warps): 36 layers, each
    an add + RMSNorm then the projection over its own weights, in one CUDA graph with PDL; us a layer. First the
    outputs of both compared (q, and the K and V written to the cache)."""
    from infertrace.engine.kernels import launch
    from infertrace.engine.kernels.fused import qk_norm_rope, qkv_norm_rope
    from infertrace.engine.kernels.norm import add_rmsnorm
    from infertrace.engine.kernels.skinny_gemm import decode_config

    launch.set_enabled(True)
    dev, dt, d, layers = "cuda", torch.bfloat16, 128, 36
    for label, hidden, hq, hkv in (("qwen3-4b", 2560, 32, 8), ("qwen3-0.6b", 1024, 16, 8)):
        n = (hq + 2 * hkv) * d
        weights = [torch.randn(n, hidden, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
        h = torch.randn(m, hidden, device=dev, dtype=dt)
        norm_w = torch.ones(hidden, device=dev, dtype=dt)
        q_w, k_w = [(torch.rand(d, device=dev) + 0.5).to(dt) for _ in range(2)]
        cos, sin = torch.randn(4096, d, device=dev), torch.randn(4096, d, device=dev)
        positions = torch.arange(100, 100 + m, device=dev) * 3
        slots = torch.arange(m, device=dev) * 7
        slots[-1] = -1
        caches = [(torch.zeros(1024, hkv, d, device=dev, dtype=dt), torch.zeros(1024, hkv, d, device=dev, dtype=dt),
                   slots) for _ in range(2)]
        tiling = decode_config(n, hidden, planes=True)
        bn, bk, sk, st = tiling

        def pair(w):
            out = skinny_gemm(add_rmsnorm(h, None, norm_w, 1e-6), w, block_n=bn, block_k=bk, split_k=sk,
                              num_stages=st)
            return qk_norm_rope(out, hq, hkv, d, q_w, k_w, 1e-6, cos, sin, positions, kv_cache=caches[0])[0]

        def one(w, cfg=(128, 5, 4)):
            return qkv_norm_rope(add_rmsnorm(h, None, norm_w, 1e-6), w, hq, hkv, d, q_w, k_w, 1e-6, cos, sin,
                                 positions, caches[1], block_k=cfg[0], num_stages=cfg[1], num_warps=cfg[2])

        q0, q1 = pair(weights[0]), one(weights[0])
        same = [torch.equal(a, b) for a, b in ((q0, q1), (caches[0][0], caches[1][0]), (caches[0][1], caches[1][1]))]
        print(f"\n{label}: qkv {n} x {hidden}, engine's tiling {tiling}; one kernel (128, 5, 4) bit-equal to the two: "
              f"q {same[0]}, K {same[1]}, V {same[2]}")
        _two_against_one(pair, one, configs, weights, rounds, " (with its add + norm)")
        del weights
        torch.cuda.empty_cache()
    launch.set_enabled(False)


GATE_UP_SHAPES = {  # merged gate/up projections (2I, hidden): qwen3-4b's, and qwen3-14b's one rank's shard at TP=1, 2, 4
    "qwen3-4b": (19456, 2560),
    "qwen3-14b": (34816, 5120),
    "qwen3-14b tp2": (17408, 5120),
    "qwen3-14b tp4": (8704, 5120),
}


def fused_gate_up(m: int, configs=((32, 128, 3, 4), (32, 128, 4, 4), (32, 128, 5, 4), (16, 128, 4, 4),
                                    (64, 128, 3, 4), (64, 128, 4, 4), (32, 256, 3, 4), (64, 128, 3, 8)),
                  rounds: int = 2) -> None:
    """The gate/up projection and SiLU-and-multiply (the skinny GEMM at the engine's tiling, then `silu_mul`) against
    the one kernel `gate_up_silu` at each (block_n, block_k, num_stages, num_warps), for GATE_UP_SHAPES: 36 layers,
    each over its own weights, in one CUDA graph with PDL; us a layer. First the two outputs compared."""
    from infertrace.engine.kernels import launch
    from infertrace.engine.kernels.fused import gate_up_silu, silu_mul
    from infertrace.engine.kernels.skinny_gemm import decode_config

    launch.set_enabled(True)
    layers = 36
    for label, (n, k) in GATE_UP_SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bn, bk, _, st = decode_config(n, k, planes=False)

        def pair(w):
            return silu_mul(skinny_gemm(x, w, block_n=bn, block_k=bk, num_stages=st))

        def one(w, cfg=configs[0]):
            return gate_up_silu(x, w, block_n=cfg[0], block_k=cfg[1], num_stages=cfg[2], num_warps=cfg[3])

        same = torch.equal(pair(weights[0]), one(weights[0]))
        print(f"\n{label}: gate/up {n} x {k}, engine's tiling {(bn, bk, 1, st)}; one kernel {configs[0]} bit-equal to "
              f"the two: {same}; weights {n * k * 2 / 1e6:.1f} MB")
        _two_against_one(pair, one, configs, weights, rounds)
        del weights
        torch.cuda.empty_cache()
    launch.set_enabled(False)


EARLY_SHAPES = {  # qwen3-14b's TP=4 and TP=2 shards with the kernel after each, and qwen3-4b's TP=1 projections
    "qkv 14b tp4": (1792, 5120, "qknorm", 2),
    "o 14b tp4": (5120, 1280, "norm", 0),
    "gate_up 14b tp4": (8704, 5120, "silu", 0),
    "down 14b tp4": (5120, 4352, "norm", 0),
    "qkv 14b tp2": (3584, 5120, "qknorm", 4),
    "gate_up 14b tp2": (17408, 5120, "silu", 0),
}


def _hold_kernel():
    """A kernel of 24 programs standing in for the all-reduce + norm kernel before a projection: it lets the next
    kernel launch (programmatic dependent launch), then spins `ns` nanoseconds on the GPU's global timer."""
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def hold(flag_ptr, ns):
        gdc_wait()
        gdc_launch_dependents()
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        t = t0
        while t - t0 < ns:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
        if tl.program_id(0) == 0:
            tl.store(flag_ptr, t - t0)

    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    return lambda ns: hold[(24,)](flag, ns, launch_pdl=True)


def early_check(m: int, holds_ns=(0, 3000, 7000), stages: tuple[int, ...] = ()) -> None:
    """The Gluon GEMM that copies its first weights before its wait (`skinny_gemm(..., early=True)`): first its
    products against float64's over shapes with ragged edges, then EARLY_SHAPES at the engine's tiling, each layer a
    kernel that holds the GPU for a while (the all-reduce's stand-in), the GEMM and the kernel after it, 36 layers
    in one CUDA graph with PDL: us a layer, Triton's kernel against the early one (at the tiling's stages, and at
    each of `stages`)."""
    from infertrace.engine.kernels import launch
    from infertrace.engine.kernels.skinny_gemm import decode_config

    launch.set_enabled(True)
    worst = 0.0
    for rows, n, k, (bn, bk, sk, st) in [(8, 5120, 1280, (64, 128, 1, 5)), (3, 1000, 4352, (32, 128, 2, 4)),
                                         (16, 1792, 5120, (64, 128, 4, 5)), (1, 96, 2000, (32, 64, 3, 3)),
                                         (8, 8704, 5120, (32, 128, 1, 5)), (13, 320, 640, (64, 256, 2, 2))]:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        got = skinny_gemm(x, w, block_n=bn, block_k=bk, split_k=sk, num_stages=st, early=True).float()
        got = got.sum(0) if sk > 1 else got
        ref = x.double() @ w.double().T
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        worst = max(worst, err)
        print(f"  early GEMM [{rows} x {k}] x [{n} x {k}]^T at {(bn, bk, sk, st)}: max error {err:.2e} of the largest")
    print(f"early GEMM products: worst {worst:.2e} of the largest value (float64 reference)")
    hold = _hold_kernel()
    layers = 36
    extra = "".join(f" early, {n} stages |" for n in stages)
    print(f"| shape | hold ns | Triton us a layer | early us a layer |{extra}\n| --- | --- | --- | --- |"
          + " --- |" * len(stages))
    for name, (n, k, kind, kv_heads) in EARLY_SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        consume = _consumer(kind, m, n, kv_heads)
        bn, bk, sk, st = decode_config(n, k, planes=kind != "silu")
        sk = 1 if kind == "silu" else sk
        for ns in holds_ns:
            times = []
            for early, stage_count in [(False, st), (True, st)] + [(True, n) for n in stages]:
                def layer(w, early=early, ns=ns, stage_count=stage_count):
                    hold(ns)
                    return consume(skinny_gemm(x, w, block_n=bn, block_k=bk, split_k=sk, num_stages=stage_count,
                                               early=early))
                try:
                    times.append(f"{timed(layer, weights) * 1e6:.2f}")
                except Exception as exc:  # noqa: BLE001 - more stages than shared memory holds
                    times.append(type(exc).__name__)
            print(f"| {name} {(bn, bk, sk, st)} | {ns} | " + " | ".join(times) + " |", flush=True)
        del weights
        torch.cuda.empty_cache()
    launch.set_enabled(False)


def silu_epilogue_check(m: int, holds_ns=(0, 7000), rounds: int = 2) -> None:
    """qwen3-14b's TP=4 and TP=2 gate/up shards as the engine's layer runs them behind the all-reduce (a kernel that
    holds the GPU, its stand-in): the early gate/up GEMM then `silu_mul`, against the early GEMM with SiLU-and-
    multiply in its epilogue (`gate_up_silu_early`), each followed by the down projection's early GEMM at its
    tiling; 36 layers in one CUDA graph with PDL, us a layer."""
    from infertrace.engine.kernels import launch
    from infertrace.engine.kernels import skinny_gemm as sg
    from infertrace.engine.kernels.fused import silu_mul

    launch.set_enabled(True)
    sg.set_early(True)
    hold = _hold_kernel()
    layers = 36
    for label, (inter, hidden) in {"14b tp4": (4352, 5120), "14b tp2": (8704, 5120)}.items():
        weights = [(torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02,
                    torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(layers)]
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        gbn, gbk, _, gst = sg.decode_config(2 * inter, hidden)
        dbn, dbk, dsk, dst = sg.decode_config(hidden, inter, planes=True)

        def down(act, wd):
            return sg.skinny_gemm(act, wd, block_n=dbn, block_k=dbk, split_k=dsk, num_stages=dst, early=True)

        variants = {
            "GEMM then silu_mul": lambda w: silu_mul(sg.skinny_gemm(x, w, block_n=gbn, block_k=gbk, num_stages=gst,
                                                                     early=True)),
            "SiLU in the epilogue": lambda w: sg.gate_up_silu_early(x, w, block_n=gbn, block_k=gbk, num_stages=gst),
        }
        ref = variants["GEMM then silu_mul"](weights[0][0])
        same = [torch.equal(ref, fn(weights[0][0])) for fn in variants.values()]
        print(f"\n{label}: gate/up {2 * inter} x {hidden} at {(gbn, gbk, 1, gst)}, down at {(dbn, dbk, dsk, dst)}; "
              f"bit-equal: {same}")
        for ns in holds_ns:
            for name, fn in variants.items():
                def layer(w, fn=fn, ns=ns):
                    hold(ns)
                    return down(fn(w[0]), w[1])
                times = [timed(layer, weights) * 1e6 for _ in range(rounds)]
                print(f"  hold {ns} ns, {name:<22} " + ", ".join(f"{t:.2f}" for t in times) + " us a layer",
                      flush=True)
        del weights
        torch.cuda.empty_cache()
    sg.set_early(False)
    launch.set_enabled(False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="fewer skinny-kernel configurations")
    ap.add_argument("--engine-only", action="store_true", help="only the projections as the engine calls them")
    ap.add_argument("--split-sweep", nargs="?", const=",".join(SPLIT_SHAPES), metavar="SHAPES",
                    help="only projections with the kernel that adds their split-K planes (SPLIT_SHAPES; all by "
                    "default, or a comma-separated list)")
    ap.add_argument("--shards", action="store_true",
                    help="only skinny_gemm.SHARDS' tilings against the rules' for the same shapes, on this GPU")
    ap.add_argument("--tuning-out", default=None, metavar="JSON",
                    help="with --split-sweep: write each shape's best tiling, where it beats the engine's, here")
    ap.add_argument("--fused-qkv", action="store_true",
                    help="only the qkv projection + q/k norm as two kernels against the one-kernel qkv_norm_rope")
    ap.add_argument("--early", nargs="?", const="", metavar="STAGES",
                    help="only the GEMM that copies its first weights before its wait, checked, then timed against "
                    "Triton's after a kernel that holds the GPU (also at these stage counts, comma-separated)")
    ap.add_argument("--silu-epilogue", action="store_true",
                    help="only the early gate/up GEMM with SiLU-and-multiply in its epilogue against it then silu_mul")
    ap.add_argument("--fused-gate-up", action="store_true",
                    help="only the gate/up projection + SiLU-and-multiply as two kernels against gate_up_silu")
    args = ap.parse_args()
    torch.manual_seed(0)
    peak = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {peak / 1e12:.2f} TB/s  rows={args.rows}")
    m = args.rows
    if args.fused_qkv:
        fused_qkv(m)
        return
    if args.fused_gate_up:
        fused_gate_up(m)
        return
    if args.silu_epilogue:
        silu_epilogue_check(m)
        return
    if args.early is not None:
        early_check(m, stages=tuple(int(v) for v in args.early.split(",") if v))
        return
    if args.shards:
        shards_check(m)
        return
    if args.split_sweep:
        split_sweep(m, peak, args.split_sweep.split(","), tuning_out=args.tuning_out)
        return
    engine_calls(m, peak)
    if args.engine_only:
        return
    best_rows = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-400 * 1024**2 // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        x16 = torch.zeros(16, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, weights[0]).float()
        results: list[tuple[str, float]] = []
        results.append(("cuBLAS F.linear", timed(lambda w: torch.nn.functional.linear(x, w), weights)))
        results.append(("cuBLAS, rows padded to 16", timed(lambda w: torch.nn.functional.linear(x16, w), weights)))
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        results.append(("cuBLAS, no reduced-precision reduction",
                        timed(lambda w: torch.nn.functional.linear(x, w), weights)))
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            results.append(("cuBLASLt", timed(lambda w: torch.nn.functional.linear(x, w), weights)))
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")
        grid = itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4), (4,), (3, 5))
        if args.quick:
            grid = itertools.product((16, 32, 64), (256,), (1, 2, 4), (4,), (4,))
        skinny: list[tuple[tuple, float]] = []
        for bn, bk, sk, warps, stages in grid:
            if k % (bk * sk):
                continue
            cfg = dict(block_n=bn, block_k=bk, split_k=sk, num_warps=warps, num_stages=stages)
            try:
                out = None if sk == 1 else torch.empty((sk, m, n), device="cuda", dtype=torch.float32)
                got = skinny_gemm(x, weights[0], out, **cfg).float()
                got = got if sk == 1 else got.sum(0)
                fn = lambda w, cfg=cfg, out=out: skinny_gemm(x, w, out, **cfg)
                err = float((got - ref).abs().max() / ref.abs().max())
                if err > 2e-2:
                    print(f"  {name} {cfg}: wrong result (rel err {err:.3g})")
                    continue
                skinny.append(((bn, bk, sk, warps, stages), timed(fn, weights)))
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
                print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        skinny.sort(key=lambda r: r[1])
        for cfg, t in skinny[:3]:
            results.append((f"skinny bn={cfg[0]} bk={cfg[1]} split={cfg[2]} warps={cfg[3]} stages={cfg[4]}", t))
        no_split = [r for r in skinny if r[0][2] == 1]
        if no_split:
            cfg, t = no_split[0]
            results.append((f"skinny, no split: bn={cfg[0]} bk={cfg[1]} warps={cfg[3]} stages={cfg[4]}", t))
        print(f"\n{name}: N={n} K={k}, {nbytes / 1e6:.1f} MB of weights, {copies} copies cycled")
        for label, t in results:
            print(f"  {label:<62} {t * 1e6:8.1f} us  {nbytes / t / 1e9:7.0f} GB/s  {100 * nbytes / t / peak:5.1f}%")
        if skinny:
            best_rows.append((name, n, k, skinny[0][0], skinny[0][1], results[0][1]))
        del weights
        torch.cuda.empty_cache()
    print("\n| shape | N | K | best skinny (bn, bk, split, warps, stages) | skinny us | cuBLAS us |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, n, k, cfg, t, cublas in best_rows:
        print(f"| {name} | {n} | {k} | {cfg} | {t * 1e6:.1f} | {cublas * 1e6:.1f} |")


if __name__ == "__main__":
    main()
