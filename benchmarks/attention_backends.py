"""The engine's attention backends side by side on one GPU: one prefill of each size, decode at batch 8, the
nano-vllm workload, and `infertrace serve` under an open-loop load, with the attention kernels' GPU time from
torch.profiler captures. Prints one table and where each backend wins; writes everything measured to --out as it
goes (a case that fails is kept as its error, the others still run).

    python3 benchmarks/attention_backends.py --out /tmp/attention_backends.json [--backends triton,flash]
        [--only prefill,decode,nano,serve] [--models-dir /tmp/models]

Each backend's engine runs in a process of its own (a fresh CUDA context): qwen3-4b for prefill and decode (one
engine, token budget and context raised to the largest prefill, so that prompt is one step), qwen3-0.6b for the
nano-vllm workload (engine_bench.bench_nano); then one server per backend. Models are made with `infertrace model
init` when missing (engine_bench.model_dir).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/attention_backends.py` too
from benchmarks.common import ROWS, model_dir  # noqa: E402
from benchmarks.engine_bench import bench_nano, run_steps  # noqa: E402
from infertrace.engine.config import ATTENTION_BACKENDS  # noqa: E402
from infertrace.output import OutputError, check_writable, write_json, write_text  # noqa: E402

CASES = ("prefill", "decode", "nano", "serve")
# the cases each engine process runs, in order: a fault that ends the process loses only what comes after it
GROUPS = {"engine": ("decode", "prefill"), "nano": ("nano",)}
WORKER_TIMEOUT_S = {"engine": 300, "nano": 180}
NANO_PRESET = "qwen3-0.6b"  # bench_nano's model
# kernels that compute attention: the Triton backend's paged kernel and its split merge, FlashAttention's CuTe DSL
# kernels (their names carry the class, e.g. FlashAttentionForwardSm90, and the module, flash_attn)
ATTENTION_MARKS = ("attention", "attn", "flash", "fmha", "_merge_splits_kernel")
KV_STORE_MARKS = ("_store_kvcache_kernel",)
# the engine's record_function ranges (engine/annotate.py), which the profiler may also put on the GPU's timeline
ENGINE_RANGES = ("step[", "schedule", "prepare_inputs", "sample", "offload.")


# ----- kernels of a profiled window (no GPU needed) -----

def is_attention(name: str) -> bool:
    low = name.lower()
    return any(mark in low for mark in ATTENTION_MARKS)


def kernel_summary(kernels: list[tuple[float, float, str]], steps: int, top: int = 6) -> dict:
    """GPU time per step of a profiled window of `steps` steps from its kernels' (start, end, name) in microseconds.

    Each kernel is charged its increment: its end past the latest end before it. Increments add up to the GPU's busy
    time exactly, also where spans overlap (under programmatic dependent launch a kernel's span opens while it waits
    for the one before), so the attention's share is what it adds to the step. Spans are kept beside them."""
    increments: dict[str, float] = defaultdict(float)
    spans: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    last_end = float("-inf")
    for start, end, name in sorted(kernels):
        increments[name] += max(0.0, end - max(last_end, start))
        spans[name] += end - start
        calls[name] += 1
        last_end = max(last_end, end)
    busy = sum(increments.values())
    attention = [n for n in increments if is_attention(n)]
    attention_us = sum(increments[n] for n in attention)

    def entry(name: str) -> dict:
        return {"name": name, "us": increments[name] / steps, "span_us": spans[name] / steps,
                "calls": calls[name] / steps, "attention": name in attention}

    by_time = sorted(increments, key=lambda n: -increments[n])
    return {
        "steps": steps,
        "busy_us": busy / steps,
        "attention_us": attention_us / steps,
        "attention_span_us": sum(spans[n] for n in attention) / steps,
        "attention_share": attention_us / busy if busy else None,
        "kv_store_us": sum(v for n, v in increments.items() if any(m in n for m in KV_STORE_MARKS)) / steps,
        "kernels": sum(calls.values()) / steps,
        "attention_kernels": [entry(n) for n in by_time if n in attention],
        "top_kernels": [entry(n) for n in by_time[:top]],
    }


# ----- the cases, in an engine process of one backend -----

def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiled():
    """torch.profiler over the GPU's activity (the CPU's where there is no GPU: a check of this script only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])


def _kernels(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) of every kernel, copy and set on the device; the engine's step ranges (record_function,
    shown on the GPU's timeline too) are left out: one would take the whole step's time as its own."""
    import torch

    kind = torch.autograd.DeviceType.CUDA if torch.cuda.is_available() else torch.autograd.DeviceType.CPU
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == kind and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(ENGINE_RANGES)]


def _token_graph_replays(llm) -> int:
    graphs = llm.engine.runner.token_graphs
    return graphs.replays if graphs is not None else 0


def prefill_size(llm, tokens: int, repeats: int, rng: random.Random) -> dict:
    """One prompt of `tokens` fresh tokens (no prefix-cache hit), max_tokens=1: wall time of the request (median of
    `repeats` after a warm-up), then one more under torch.profiler for its GPU time and the attention's share."""
    from infertrace.engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def fresh() -> list[list[int]]:
        return [[rng.randrange(1000, 100_000) for _ in range(tokens)]]

    run_steps(llm, fresh(), params)
    walls = sorted(run_steps(llm, fresh(), params)["wall_s"] for _ in range(repeats))
    steps, hits, replays = eng.counters["steps"], eng.counters["prefix_cache_hits"], _token_graph_replays(llm)
    _sync()
    with _profiled() as prof:
        run_steps(llm, fresh(), params)
    steps = eng.counters["steps"] - steps
    last = eng.last_step
    return {
        "tokens": tokens,
        "wall_ms": 1e3 * walls[len(walls) // 2],
        "wall_ms_all": [1e3 * w for w in walls],
        # the profiled request: one prefill step of every token, none from the prefix cache
        "steps": steps,
        "one_step": steps == 1 and last is not None and last.num_prefill_tokens == tokens,
        "prefix_cache_hits": eng.counters["prefix_cache_hits"] - hits,
        "token_graph": _token_graph_replays(llm) > replays,
        **kernel_summary(_kernels(prof), 1),
    }


def decode_case(llm, repeats: int = 3, profile_steps: int = 20) -> dict:
    """engine_bench's decode workload (8 prompts of 128 tokens, 512 new tokens, greedy, ignore_eos): output tok/s
    (wall, prefill included; median of `repeats`), then `profile_steps` decode steps under torch.profiler at the
    workload's mean context (128 + 256 tokens)."""
    from infertrace.engine import SamplingParams

    eng = llm.engine
    rng = random.Random(0)  # engine_bench.bench_decode's prompts
    prompts = [[rng.randrange(1000, 3000) for _ in range(128)] for _ in range(8)]
    run_steps(llm, prompts, SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
    runs = sorted((run_steps(llm, prompts, SamplingParams(max_tokens=512, ignore_eos=True)) for _ in range(repeats)),
                  key=lambda r: r["out_tokens"] / r["wall_s"])
    rates = [r["out_tokens"] / r["wall_s"] for r in runs]
    mid = runs[len(runs) // 2]
    spacing = sorted(mid["decode_times"])[len(mid["decode_times"]) // 2] if mid["decode_times"] else None

    for i, p in enumerate(prompts):
        eng.add_request(f"prof{i}-{time.monotonic_ns()}", p,
                        SamplingParams(max_tokens=256 + profile_steps + 8, ignore_eos=True))
    for _ in range(257):  # the prefill, then 256 decode steps
        eng.step()
    kinds: Counter[str] = Counter()
    _sync()
    t = time.perf_counter()
    with _profiled() as prof:
        for _ in range(profile_steps):
            eng.step()
            kinds[eng.last_step.kind if eng.last_step else "none"] += 1
        _sync()
    wall = time.perf_counter() - t
    while eng.has_unfinished():
        eng.step()
    return {
        "batch": 8, "prompt_tokens": 128, "new_tokens": 512,
        "tok_s": rates[len(rates) // 2],
        "tok_s_all": rates,
        "decode_step_ms": 1e3 * spacing if spacing is not None else None,
        "profiled_steps": profile_steps,
        "profiled_step_kinds": dict(kinds),
        "profiled_wall_ms_per_step": 1e3 * wall / profile_steps,
        **kernel_summary(_kernels(prof), profile_steps),
    }


def nano_case(root: Path, backend: str) -> dict:
    """engine_bench.bench_nano with this backend: its output tok/s, read from the row it prints."""
    first = len(ROWS)
    bench_nano(root, hf=False, attention_backend=backend)
    name, value, note = next(r for r in ROWS[first:] if r[0].startswith("nano-vllm workload output tok/s"))
    return {"tok_s": float(value), "setup": note}


def save_json(path: Path, document: dict) -> None:
    """`document` written atomically as strict JSON, or with NaN spelled out where a figure is not finite (the
    figures are kept either way)."""
    try:
        write_json(path, document, default=str)
    except ValueError:
        write_text(path, json.dumps(document, indent=2, default=str) + "\n")


def attempt(part: dict, key: str, fn, save) -> None:
    """part[key] = fn(), or the error it raised; saved either way."""
    t = time.perf_counter()
    try:
        part[key] = fn()
    except Exception as exc:
        part[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        print(f"{key}: {part[key]['error']}", file=sys.stderr, flush=True)
    if isinstance(part[key], dict):
        part[key]["seconds"] = time.perf_counter() - t
    save()


def worker(args: argparse.Namespace) -> None:
    """One backend's cases of one group in this process; what each gives is saved to args.part as it comes."""
    import torch

    from infertrace.engine import LLM

    backend, cases = args.backend, [c for c in GROUPS[args.worker] if c in args.only]
    part: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "torch": torch.__version__}

    def save() -> None:
        save_json(args.part, part)

    save()
    if args.worker == "nano":
        attempt(part, "nano", lambda: nano_case(args.models_dir, backend), save)
        return
    top = max(args.prefill_sizes)
    settings = {"attention_backend": backend, "max_num_batched_tokens": max(8192, top),
                "max_model_len": max(top, 640) + 16}
    holder: dict = {}

    def start() -> dict:
        t = time.perf_counter()
        holder["llm"] = llm = LLM(model_dir(args.models_dir, args.preset), **settings)
        runner = llm.engine.runner
        return {"preset": args.preset, "settings": settings, "startup_s": time.perf_counter() - t,
                "attention": runner.attention.name, "decode_graphs": runner.graphs is not None,
                "token_graph_buckets": runner.token_graphs.buckets if runner.token_graphs is not None else [],
                "kv_cache_tokens": runner.num_blocks * runner.block_size, "max_model_len": llm.engine.max_model_len}

    attempt(part, "engine", start, save)
    if "llm" not in holder:
        return
    llm = holder["llm"]
    if "decode" in cases:
        attempt(part, "decode", lambda: decode_case(llm), save)
    if "prefill" in cases:
        rng = random.Random(7)
        part["prefill"] = {}
        for n in sorted(args.prefill_sizes):
            attempt(part["prefill"], str(n), lambda: prefill_size(llm, n, args.prefill_repeats, rng), save)


# ----- the parent: engine processes, servers, the table -----

def stamp(text: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {text}", flush=True)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to `proc`, then SIGKILL to its process group (it was started in a session of its own) if it is still
    there after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_worker(group: str, backend: str, args: argparse.Namespace, work: Path) -> dict:
    """A process running one backend's cases of `group`; what it saved, with its exit and log tail on failure."""
    part, log = work / f"{group}-{backend}.json", work / f"{group}-{backend}.log"
    part.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--worker", group, "--backend", backend, "--part", str(part),
           "--models-dir", str(args.models_dir), "--preset", args.preset, "--only", ",".join(args.only),
           "--prefill-sizes", ",".join(map(str, args.prefill_sizes)), "--prefill-repeats", str(args.prefill_repeats),
           "--out", str(args.out)]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(WORKER_TIMEOUT_S[group])
    except subprocess.TimeoutExpired:
        _stop(proc, 10)
        rc = f"killed after {WORKER_TIMEOUT_S[group]} s"
    try:
        saved = json.loads(part.read_text())
    except (OSError, ValueError):
        saved = {}
    if rc != 0:
        saved["process_error"] = {"exit": rc, "log_tail": tail(log)}
    return saved


def _port_answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serve_case(backend: str, model: Path, args: argparse.Namespace, work: Path) -> dict:
    """`infertrace serve --attention-backend BACKEND`, then `infertrace bench` at args.rate req/s (512 in / 128 out,
    ignore_eos); the bench's TTFT and ITL figures."""
    if _port_answers(args.port):
        raise RuntimeError(f"port {args.port} is taken before the server starts: pass a free --port")
    url = f"http://127.0.0.1:{args.port}"
    it = [sys.executable, "-m", "infertrace"]
    log, result = work / f"server-{backend}.log", work / f"serve-{backend}.json"
    result.unlink(missing_ok=True)
    with log.open("w") as f:
        server = subprocess.Popen([*it, "serve", "--model", str(model), "--served-model-name", args.serve_preset,
                                   "--port", str(args.port), "--attention-backend", backend],
                                  stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t = time.perf_counter()
        while not _healthy(url):
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}):\n{tail(log)}")
            if time.perf_counter() - t > args.server_timeout:
                raise RuntimeError(f"the server was not healthy after {args.server_timeout} s:\n{tail(log)}")
            time.sleep(0.5)
        ready_s = time.perf_counter() - t
        bench_log = work / f"bench-{backend}.log"
        with bench_log.open("w") as f:
            proc = subprocess.run(
                [*it, "bench", "--base-url", url, "--tokenizer", str(model), "--input-len", "512", "--output-len",
                 "128", "--ignore-eos", "--warmup", "8", "--request-rate", str(args.rate), "--num-prompts",
                 str(args.serve_prompts), "--seed", "0", "--result-json", str(result),
                 "--requests-jsonl", str(work / f"requests-{backend}.jsonl")],
                stdout=f, stderr=subprocess.STDOUT, timeout=args.serve_prompts / args.rate + 180)
        if not result.exists():
            raise RuntimeError(f"bench wrote no result (exit {proc.returncode}):\n{tail(bench_log)}")
        r = json.loads(result.read_text())
        return {**_server_side(url, work / f"requests-{backend}.jsonl"),
                "preset": args.serve_preset, "rate": args.rate, "num_prompts": args.serve_prompts,
                "ready_s": ready_s, "bench_exit": proc.returncode, "completed": r["completed"], "failed": r["failed"],
                "ttft_p50_ms": r["median_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
                "itl_p50_ms": r["median_itl_ms"], "itl_p99_ms": r["p99_itl_ms"], "tpot_p50_ms": r["median_tpot_ms"],
                "output_tok_s": r["output_throughput"], "duration_s": r["duration"]}
    finally:
        _stop(server, 60)


def _server_side(url: str, requests_jsonl: Path) -> dict:
    """What explains a served run's tail, read after it: the objects the engine process froze at start-up, its
    garbage collections by generation (count, total ms, how many paused it 50 ms or more), and the slowest TTFTs with
    when they were sent and the server's own parts of them."""
    out: dict = {}
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=10) as r:
            out["gc_frozen_objects"] = json.loads(r.read()).get("gc_frozen_objects")
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
        gc_pauses: dict = {}
        for family in text_string_to_metric_families(text):
            if family.name != "infertrace:gc_pause_seconds":
                continue
            for sample in family.samples:
                entry = gc_pauses.setdefault(sample.labels["generation"], {})
                if sample.name.endswith("_count"):
                    entry["count"] = int(sample.value)
                elif sample.name.endswith("_sum"):
                    entry["total_ms"] = sample.value * 1e3
                elif sample.labels.get("le") == "0.05":
                    entry["under_50ms"] = int(sample.value)
        for entry in gc_pauses.values():
            entry["over_50ms"] = entry.get("count", 0) - entry.pop("under_50ms", 0)
        out["gc_pauses"] = gc_pauses
    except (OSError, ValueError, IndexError) as e:
        out["server_side_error"] = f"{type(e).__name__}: {e}"
    try:
        rows = [json.loads(line) for line in requests_jsonl.read_text().splitlines()]
        done = sorted((r for r in rows if r.get("phase") == "measured" and r.get("ttft_ms") is not None),
                      key=lambda r: -r["ttft_ms"])
        out["slowest_ttft"] = [{"t0_s": round(r["t0_s"], 3), "ttft_ms": round(r["ttft_ms"], 2),
                                "ttft_parts": r.get("ttft_parts")} for r in done[:12]]
    except (OSError, ValueError) as e:
        out["slowest_ttft_error"] = f"{type(e).__name__}: {e}"
    return out


def _get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d or (isinstance(d[k], dict) and "error" in d[k]):
            return None
        d = d[k]
    return d


def _try(fn, value, otherwise):
    """fn(value), or `otherwise` where a figure is missing or not a number (the table still prints)."""
    try:
        return fn(value)
    except (KeyError, TypeError, ValueError):
        return otherwise


def table_rows(results: dict, backends: list[str]) -> list[tuple[str, list[str], float | None]]:
    """(figure, one cell per backend, last backend / first on the figure's number) for every figure measured."""
    by = results["backends"]
    rows = []

    def add(label: str, cell, number, *keys) -> None:
        values = [_get(by.get(b, {}), *keys) for b in backends]
        if all(v is None for v in values):
            return
        cells = [_try(cell, v, "?") if v is not None else "-" for v in values]
        nums = [_try(number, v, None) if v is not None else None for v in values]
        nums = [n if isinstance(n, (int, float)) else None for n in nums]
        ratio = nums[-1] / nums[0] if len(nums) > 1 and nums[0] and nums[-1] is not None else None
        rows.append((label, cells, ratio))

    sizes = sorted({int(n) for b in backends for n in (_get(by.get(b, {}), "prefill") or {})})
    for n in sizes:
        add(f"prefill {n:,}: GPU ms (attention ms, share)",
            lambda p: f"{p['busy_us'] / 1e3:.2f} ({p['attention_us'] / 1e3:.2f}, {p['attention_share'] or 0:.0%})"
            + ("" if p["one_step"] else " NOT ONE STEP"),
            lambda p: p["busy_us"], "prefill", str(n))
        add(f"prefill {n:,}: wall ms (median)", lambda p: f"{p['wall_ms']:.2f}", lambda p: p["wall_ms"],
            "prefill", str(n))
    add("decode bs8: output tok/s", lambda d: f"{d['tok_s']:,.0f}", lambda d: d["tok_s"], "decode")
    add("decode bs8: GPU us/step (attention us)", lambda d: f"{d['busy_us']:,.0f} ({d['attention_us']:,.0f})",
        lambda d: d["busy_us"], "decode")
    add("nano-vllm workload: output tok/s", lambda d: f"{d['tok_s']:,.0f}", lambda d: d["tok_s"], "nano")
    add("serve: TTFT p50 / p99 ms", lambda s: f"{s['ttft_p50_ms']:.2f} / {s['ttft_p99_ms']:.2f}",
        lambda s: s["ttft_p50_ms"], "serve")
    add("serve: ITL p99 ms (failed)", lambda s: f"{s['itl_p99_ms']:.2f} ({s['failed']})", lambda s: s["itl_p99_ms"],
        "serve")
    def full(s: dict) -> dict:  # the generation-2 collections during the run
        return {"count": 0, "total_ms": 0.0, "over_50ms": 0, **s["gc_pauses"].get("2", {})}

    add("serve: full GCs (total ms, >= 50 ms), frozen",
        lambda s: f"{full(s)['count']} ({full(s)['total_ms']:.0f}, {full(s)['over_50ms']}), {s.get('gc_frozen_objects')}",
        lambda s: full(s)["total_ms"], "serve")
    return rows


def render_table(results: dict, backends: list[str]) -> str:
    ratio_name = f"{backends[-1]}/{backends[0]}" if len(backends) > 1 else ""
    lines = [f"| figure | {' | '.join(backends)} | {ratio_name} |", "|" + " --- |" * (len(backends) + 2)]
    for label, cells, ratio in table_rows(results, backends):
        lines.append(f"| {label} | {' | '.join(cells)} | {f'{ratio:.2f}x' if ratio is not None else ''} |")
    return "\n".join(lines)


def render_wins(results: dict, backends: list[str], top: int = 2) -> str:
    """Per profiled phase: each backend's attention GPU time, the faster one, and its top attention kernels."""
    by = results["backends"]
    phases = [(f"prefill {int(n):,}", ("prefill", n))
              for n in sorted({n for b in backends for n in (_get(by.get(b, {}), "prefill") or {})}, key=int)]
    phases.append(("decode bs8 (per step)", ("decode",)))
    out = ["where each backend wins (torch.profiler: GPU time a step; a kernel's time is what it adds to the step)"]
    if not any(_get(by.get(b, {}), *keys) for b in backends for _, keys in phases):
        out.append("  no profiled phase was measured")
    for label, keys in phases:
        got = {b: _get(by.get(b, {}), *keys) for b in backends}
        got = {b: v for b, v in got.items() if v is not None}
        if not got:
            continue
        line = "; ".join(f"{b} attention {v['attention_us']:,.1f} us of {v['busy_us']:,.1f}" for b, v in got.items())
        timed = {b: v["attention_us"] for b, v in got.items() if v["attention_us"]}
        if len(timed) > 1:
            best = min(timed, key=timed.get)
            line += f" -> {best} {max(timed.values()) / timed[best]:.2f}x faster in attention"
        out.append(f"  {label}: {line}")
        for b, v in got.items():
            if not v["attention_kernels"]:
                out.append(f"    {b}: no kernel matched the attention names; top kernels: "
                           + ", ".join(k["name"][:50] for k in v["top_kernels"][:3]))
            for k in v["attention_kernels"][:top]:
                each = k["us"] / k["calls"] if k["calls"] else 0.0
                out.append(f"    {b}: {k['calls']:g}x {each:,.1f} us = {k['us']:,.1f} us  {k['name'][:80]}")
    return "\n".join(out)


def flash_from(results: dict) -> int | None:
    """The smallest prefill size measured from which FlashAttention-4's step takes less GPU time than the Triton
    kernel's at every larger size measured too: the bound `auto` should take (engine/attention.py's
    FLASH_PREFILL_FROM). None when both were not measured or FA4 never wins at the largest size."""
    by = results["backends"]
    triton, flash = _get(by.get("triton", {}), "prefill") or {}, _get(by.get("flash", {}), "prefill") or {}
    sizes = sorted((int(n) for n in triton if n in flash and "busy_us" in triton[n] and "busy_us" in flash[n]))
    bound = None
    for n in reversed(sizes):
        if flash[str(n)]["busy_us"] >= triton[str(n)]["busy_us"]:
            break
        bound = n
    return bound


def case_errors(key: str, value) -> list[tuple[str, str]]:
    """(case, error) of every case of an engine process's result `key` that failed (prefill: per size)."""
    if not isinstance(value, dict):
        return []
    if "error" in value:
        return [(key, value["error"])]
    if key == "prefill":
        return [(f"prefill {n}", v["error"]) for n, v in value.items() if isinstance(v, dict) and "error" in v]
    return []


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main_run(args: argparse.Namespace) -> int:
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": " ".join(sys.argv), "commit": _commit(),
                     "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "backends": {b: {} for b in args.backends}, "errors": [], "seconds": {}}

    def save() -> None:
        save_json(args.out, results)

    def phase(name: str, fn):
        t = time.perf_counter()
        try:
            return fn()
        except Exception as exc:
            results["errors"].append({"phase": name, "error": f"{type(exc).__name__}: {exc}"})
            stamp(f"{name}: {type(exc).__name__}: {exc}")
            return None
        finally:
            results["seconds"][name] = round(time.perf_counter() - t, 1)
            save()

    save()
    t0 = time.perf_counter()
    presets = []
    if {"prefill", "decode"} & set(args.only):
        presets.append(args.preset)
    if "nano" in args.only:
        presets.append(NANO_PRESET)
    if "serve" in args.only:
        presets.append(args.serve_preset)
    models = {}
    for preset in dict.fromkeys(presets):
        stamp(f"model {preset}")
        models[preset] = phase(f"model {preset}", lambda: model_dir(args.models_dir, preset))
    for group, cases in GROUPS.items():
        preset = NANO_PRESET if group == "nano" else args.preset
        if not set(cases) & set(args.only) or models.get(preset) is None:
            continue
        for b in args.backends:
            stamp(f"{group} cases, {b}")
            part = phase(f"{group} {b}", lambda: run_worker(group, b, args, work)) or {}
            for key, value in part.items():
                if key == "process_error":
                    results["errors"].append({"phase": f"{group} {b}", **value})
                    stamp(f"{group} {b}: exit {value['exit']}")
                elif key in ("device", "torch"):
                    results[key] = value
                else:
                    results["backends"][b][key] = value
                    for case, error in case_errors(key, value):
                        results["errors"].append({"phase": f"{b} {case}", "error": error})
                        stamp(f"{b} {case}: {error}")
            save()
    if "serve" in args.only and models.get(args.serve_preset) is not None:
        for b in args.backends:
            stamp(f"serve at {args.rate:g} req/s, {b}")
            results["backends"][b]["serve"] = phase(
                f"serve {b}", lambda: serve_case(b, models[args.serve_preset], args, work)) or {
                "error": "failed (see errors)"}
            save()
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    table, wins = render_table(results, args.backends), render_wins(results, args.backends)
    results["table"], results["wins"] = table, wins
    save()
    results["flash_from"] = flash_from(results)
    save()
    print(f"\n{results.get('device', '')}, torch {results.get('torch', '')}, {results['wall_s']:.0f} s\n{table}\n\n"
          f"{wins}\nFA4's prefill step faster from (every larger size measured too): {results['flash_from']}")
    for e in results["errors"]:
        print(f"error in {e['phase']}: {e.get('error') or e.get('exit')}")
    print(f"\nwritten: {args.out}")
    return 1 if results["errors"] else 0


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return list(dict.fromkeys(names))


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"prefill sizes must be positive integers, comma-separated; got {text!r}")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file of every figure, written as they come")
    ap.add_argument("--backends", type=lambda s: _names(s, ATTENTION_BACKENDS, "--backends"),
                    default=["triton", "flash"], help="attention backends, in order (default: triton,flash)")
    ap.add_argument("--only", type=lambda s: _names(s, CASES, "--only"), default=list(CASES),
                    help=f"cases to run (default: {','.join(CASES)})")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/attention_backends"),
                    help="engine processes' and servers' logs and partial results")
    ap.add_argument("--preset", default="qwen3-4b", help="model of the prefill and decode cases")
    ap.add_argument("--prefill-sizes", type=_sizes, default=[512, 2048, 8192, 32768])
    ap.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills of each size after a warm-up")
    ap.add_argument("--serve-preset", default="qwen3-0.6b", help="model the server runs")
    ap.add_argument("--rate", type=float, default=60.0, help="serve: requests per second (512 in / 128 out)")
    ap.add_argument("--serve-prompts", type=int, default=1200, help="serve: requests per backend")
    ap.add_argument("--server-timeout", type=float, default=300.0, help="serve: seconds to wait for /health")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--worker", choices=tuple(GROUPS), help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("prefill_repeats", "serve_prompts", "port", "rate", "server_timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not args.worker:
        try:
            check_writable(args.out, "--out")
        except OutputError as exc:
            ap.error(str(exc))
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    sys.exit(main_run(args))


if __name__ == "__main__":
    main()
