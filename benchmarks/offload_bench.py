"""GPU benchmarks of CPU KV offload; prints one table. Run on the GPU machine.

    python benchmarks/offload_bench.py --models-dir /tmp/models [--only ttft,bandwidth,long] [--long-dtypes float32]

ttft:      qwen3-4b, TTFT of a request whose 8k-token prefix was evicted from the GPU to the host tier
           (offload=prefix) against recomputing it (offload=off), same GPU KV budget; median of 3, and the ratio.
bandwidth: achieved host-to-device and device-to-host bandwidth of the prefix tier's copies (event-timed on the
           copy streams), against a plain pinned 256 MiB copy on the same bus.
long:      qwen3-0.6b (config patched to 131072 positions), a 65536-token prompt with a GPU KV budget of 16384
           tokens (offload=long) against a budget holding it all: first 32 greedy tokens and the max logit
           difference, and prefill tok/s of both.

Models are made with `infertrace model init` when missing. Each part runs on its own; one that fails prints its
error in the table and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/offload_bench.py` too
from benchmarks.common import model_dir, print_rows, row  # noqa: E402
from infertrace.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

VOCAB = 151936


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def release() -> None:
    """Return the memory of engines the caller has just deleted."""
    gc.collect()
    torch.cuda.empty_cache()


def time_to_first_token(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> float:
    """Seconds from add_request to the first output token (the request is then run to its end)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft = None
    while engine.has_unfinished():
        outs = engine.step()
        if ttft is None and any(o.request_id == request_id and o.new_token_ids for o in outs):
            torch.cuda.synchronize()
            ttft = time.perf_counter() - t0
    assert ttft is not None, "no token came back"
    return ttft


def run_one(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        engine.step()


# ----- (a) TTFT with the prefix on the host vs recomputed -----
def bench_ttft(root: Path, prefix_len: int = 8192, suffix_len: int = 64, trials: int = 3,
               preset: str = "qwen3-4b") -> None:
    path = model_dir(root, preset, "bfloat16")
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    results: dict[str, list[float]] = {}
    hits: dict[str, tuple[int, int]] = {}
    for mode in ("prefix", "off"):
        # the pool holds one such request and a little more, so two other requests evict the prefix entirely
        engine = Engine(path, EngineConfig.from_overrides({
            "kv_cache_tokens": prefix_len + suffix_len + max(prefix_len // 8, 64),
            "max_num_batched_tokens": prefix_len + 2 * suffix_len,
            "offload": mode, "offload_host_gb": 8.0,
        }))
        rng = random.Random(0)
        run_one(engine, "warmup", random_tokens(rng, prefix_len // 4), one)
        times = []
        for t in range(trials):
            prefix = random_tokens(rng, prefix_len)
            run_one(engine, f"seed{t}", prefix + random_tokens(rng, suffix_len), one)
            run_one(engine, f"evict{t}a", random_tokens(rng, prefix_len + suffix_len), one)
            run_one(engine, f"evict{t}b", random_tokens(rng, prefix_len + suffix_len), one)
            if engine.offload is not None:
                engine.offload.transfers.synchronize()
            gpu0, cpu0 = engine.counters["prefix_cache_hits"], engine.counters["cpu_prefix_cache_hits"]
            probe = prefix + random_tokens(rng, suffix_len)
            times.append(time_to_first_token(engine, f"probe{t}", probe, one))
            c = engine.counters
            hits[mode] = (c["prefix_cache_hits"] - gpu0, c["cpu_prefix_cache_hits"] - cpu0)
        results[mode] = times
        del engine
        release()
    med = {m: sorted(v)[len(v) // 2] for m, v in results.items()}
    for mode, label in (("prefix", "host-tier hit"), ("off", "recompute")):
        gpu, cpu = hits[mode]
        row(f"ttft {preset} {prefix_len}-token prefix, {label}", f"{med[mode] * 1000:.1f} ms",
            f"median of {trials}: {', '.join(f'{x * 1000:.1f}' for x in results[mode])} ms; "
            f"last probe: {gpu} GPU-hit, {cpu} CPU-hit tokens")
    row("ttft ratio recompute / host-tier hit", f"{med['off'] / med['prefix']:.2f}x", "vLLM reports 2-22x on H100")


# ----- (b) bandwidth of the offload copies vs a plain pinned copy -----
def pinned_peak(nbytes: int = 256 * 1024**2, repeats: int = 10) -> tuple[float, float]:
    """Median GB/s of a plain pinned host <-> device copy of `nbytes`: (host to device, device to host)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    out = []
    for dst, src in ((device, host), (host, device)):
        times = []
        for i in range(repeats + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1000)
        out.append(nbytes / sorted(times)[len(times) // 2] / 1e9)
    return out[0], out[1]


def prefix_copy_rates(path: Path, num_blocks: int, repeats: int) -> tuple[dict[str, tuple[float, float]], float]:
    """GB/s (event-timed on the copy streams) of the prefix tier's loads and stores of `num_blocks` device blocks,
    as one batch and block by block: {label: (host to device, device to host)}, and the block size in MiB."""
    engine = Engine(path, EngineConfig.from_overrides({
        "kv_cache_tokens": (num_blocks + 16) * 16, "offload": "prefix", "offload_host_gb": 8.0,
    }))
    pool, tier, transfers = engine.offload.pool, engine.offload.prefix, engine.offload.transfers
    device_ids = list(range(num_blocks))
    serial = 0
    rates: dict[str, tuple[float, float]] = {}
    for label, batches in (("one batch", [device_ids]), ("block by block", [[d] for d in device_ids])):
        h2d, d2h = [], []
        for _ in range(repeats):
            transfers.synchronize()
            b0, s0 = transfers.bytes_d2h, transfers.seconds
            host_ids = []
            for batch in batches:
                blocks = []
                for d in batch:
                    serial += 1
                    blocks.append((d, serial, (serial,)))  # fresh hashes: every store really copies
                tier.store(blocks)
                host_ids.append([pool.hash_to_block[h] for _, h, _ in blocks])
            transfers.synchronize()
            d2h.append((transfers.bytes_d2h - b0) / (transfers.seconds - s0) / 1e9)
            b0, s0 = transfers.bytes_h2d, transfers.seconds
            for ids, batch in zip(host_ids, batches):
                tier.pin(ids)
                tier.load(ids, batch)
            transfers.synchronize()
            h2d.append((transfers.bytes_h2d - b0) / (transfers.seconds - s0) / 1e9)
        rates[label] = (sorted(h2d)[len(h2d) // 2], sorted(d2h)[len(d2h) // 2])
    return rates, pool.block_nbytes / 1024**2


def bench_bandwidth(root: Path, num_blocks: int = 256, repeats: int = 5, preset: str = "qwen3-4b") -> None:
    h2d_peak, d2h_peak = pinned_peak()
    row("pinned 256 MiB copy, host to device", f"{h2d_peak:.1f} GB/s", "plain copy_, event-timed, median of 10")
    row("pinned 256 MiB copy, device to host", f"{d2h_peak:.1f} GB/s", "")
    rates, block_mb = prefix_copy_rates(model_dir(root, preset, "bfloat16"), num_blocks, repeats)
    release()
    for label, (h2d, d2h) in rates.items():
        note = f"{num_blocks} blocks of {block_mb:.2f} MiB, {label}, median of {repeats}"
        row(f"prefix-tier load H2D ({label})", f"{h2d:.1f} GB/s", f"{100 * h2d / h2d_peak:.0f}% of peak; {note}")
        row(f"prefix-tier store D2H ({label})", f"{d2h:.1f} GB/s", f"{100 * d2h / d2h_peak:.0f}% of peak; {note}")


# ----- (c) long context: 64k prompt through a 16k GPU budget -----
class LogitRecorder:
    def __init__(self, sampler):
        self.sampler = sampler
        self.rows: list[torch.Tensor] = []

    def __call__(self, logits, params, generators):
        self.rows += [r.float().cpu() for r in logits.detach()]
        return self.sampler(logits, params, generators)


def hf_last_logits(path: Path, prompt: list[int], dtype: str) -> torch.Tensor:
    """Hugging Face transformers' own logits after `prompt` (last position only), as the reference."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model = model.cuda().eval()
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt], device="cuda")).last_hidden_state[0, -1:]
        logits = model.lm_head(hidden)[0].float().cpu()
    del model
    release()
    return logits


def bench_long(root: Path, dtype: str, prompt_len: int = 65536, budget: int = 16384, new_tokens: int = 32,
               preset: str = "qwen3-0.6b", chunk_tokens: int = 4096, hf_check: bool = False) -> None:
    path = model_dir(root, preset, dtype, max_positions=131072)
    prompt = random_tokens(random.Random(1), prompt_len)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    cfg = json.loads((path / "config.json").read_text())
    elt = 4 if dtype == "float32" else 2
    token_bytes = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * elt
    kv_bytes = token_bytes * (prompt_len + new_tokens + 64)
    host_gb = math.ceil(kv_bytes / 1024**3) + 1
    runs = {}
    for label, overrides in (
        ("large budget", {"kv_cache_tokens": prompt_len + 1024}),
        ("offload=long", {"kv_cache_tokens": budget, "offload": "long", "offload_host_gb": float(host_gb),
                          "offload_chunk_tokens": chunk_tokens}),
    ):
        config = EngineConfig.from_overrides({"dtype": dtype, "max_num_batched_tokens": 8192, **overrides})
        engine = Engine(path, config)
        recorder = engine.runner.sampler = LogitRecorder(engine.runner.sampler)
        run_one(engine, "warmup", prompt[:1024], SamplingParams(max_tokens=2, ignore_eos=True))
        recorder.rows.clear()
        tokens: list[int] = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.add_request("long", prompt, params)
        ttft = None
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                if ttft is None and out.new_token_ids:
                    torch.cuda.synchronize()
                    ttft = time.perf_counter() - t0
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        info = engine.offload.describe() if engine.offload is not None else {}
        counters = dict(engine.counters)
        runs[label] = {"tokens": tokens, "logits": recorder.rows[:new_tokens], "ttft": ttft, "total": total,
                       "info": info, "counters": counters}
        del engine, recorder
        release()
    ref, off = runs["large budget"], runs["offload=long"]
    same = ref["tokens"] == off["tokens"]
    # logits are comparable only while both runs have fed the same tokens: up to the first differing token
    agree = next((i for i, (a, b) in enumerate(zip(ref["tokens"], off["tokens"])) if a != b), new_tokens)
    compared = list(zip(ref["logits"], off["logits"]))[: agree + 1]
    rel = max(float((b - a).norm() / a.norm()) for a, b in compared)
    rel_max = max(float((b - a).abs().max() / a.abs().max()) for a, b in compared)
    if hf_check:
        want = hf_last_logits(path, prompt, dtype)
        for label, r in runs.items():
            got = r["logits"][0]
            row(f"long {dtype} {prompt_len}: first logits, {label} vs Hugging Face",
                f"{float((got - want).norm() / want.norm()):.2e} relative L2",
                f"argmax {int(got.argmax())} vs {int(want.argmax())}")
    c = off["counters"]
    row(f"long {dtype}: first {new_tokens} greedy tokens, offload=long vs large budget",
        "identical" if same else f"first {agree} identical",
        f"logits over the {len(compared)} positions with identical inputs: relative L2 difference {rel:.2e}, "
        f"largest difference {rel_max:.2e} of the largest logit; long steps {c.get('long_context_steps')}")
    for label, r in runs.items():
        tok_s = prompt_len / r["ttft"]
        row(f"long {dtype}: prefill {prompt_len} tokens, {label}", f"{tok_s:.0f} tok/s",
            f"TTFT {r['ttft']:.2f} s; whole request {r['total']:.1f} s")
    moved = c.get("offload_bytes_h2d", 0) + c.get("offload_bytes_d2h", 0)
    secs = c.get("offload_transfer_seconds", 0.0)
    row(f"long {dtype}: KV streamed", f"{moved / 1e9:.1f} GB",
        f"{moved / secs / 1e9:.1f} GB/s over copy time {secs:.2f} s; {json.dumps(off['info'])}" if secs else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--only", default="ttft,bandwidth,long", help="comma-separated parts: ttft, bandwidth, long")
    ap.add_argument("--long-dtypes", default="float32,bfloat16", help="dtypes of the long-context part")
    ap.add_argument("--long-prompt", type=int, default=65536, help="prompt tokens of the long-context part")
    ap.add_argument("--long-budget", type=int, default=16384, help="GPU KV budget (tokens) of offload=long")
    ap.add_argument("--hf-check", action="store_true", help="also compare first logits with Hugging Face's")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("offload_bench needs a CUDA GPU")
    args.models_dir.mkdir(parents=True, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    parts = {
        "ttft": [lambda: bench_ttft(args.models_dir)],
        "bandwidth": [lambda: bench_bandwidth(args.models_dir)],
        "long": [lambda d=d: bench_long(args.models_dir, d, prompt_len=args.long_prompt, budget=args.long_budget,
                                        hf_check=args.hf_check)
                 for d in args.long_dtypes.split(",") if d],
    }
    for name in [p.strip() for p in args.only.split(",") if p.strip()]:
        for part in parts.get(name, []):
            try:
                part()
            except Exception as exc:  # noqa: BLE001 - report and go on with the other parts
                traceback.print_exc()
                row(f"{name} FAILED", type(exc).__name__, str(exc).splitlines()[0][:160] if str(exc) else "")
            gc.collect()
            torch.cuda.empty_cache()
    print_rows(args.out)


if __name__ == "__main__":
    main()
