"""Tensor-parallel decode speed: batch-8 greedy decode of one preset at TP=1 and at TP=N (NCCL and the peer-memory
all-reduce), measured in the same call, and the all-reduce's GPU time per decode step from a torch.profiler capture.

Each configuration runs in a process of its own (a fresh process group each time), one after the other on the same
GPUs; the parent writes the model once (weights drawn on the GPU) and prints one table.

    python benchmarks/tp_bench.py --preset qwen3-4b --tp 1,2,4 --out $OUT/tp_qwen3-4b.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # this checkout's package, installed or not
    sys.path.insert(0, str(REPO))

AR_KERNELS = ("all_reduce", "allreduce", "AllReduce")  # one_shot_all_reduce*, two_shot_*, ncclDevKernel_AllReduce*


def run_one(model_dir: str, tp: int, all_reduce: str, batch: int, input_len: int, output_len: int,
            profile_dir: str | None, overrides: dict, host_profile: int = 0, timeline: bool = False,
            rules: dict | None = None) -> dict:
    """One configuration in this process: warm up, time one batch, optionally capture a short profile."""
    import random

    from infertrace.engine import LLM, SamplingParams

    llm = LLM(model_dir, tensor_parallel_size=tp, all_reduce=all_reduce, max_num_seqs=batch,
              kv_cache_tokens=batch * (input_len + output_len) + 1024, max_num_batched_tokens=2048,
              cuda_graph_batch_sizes=(1, 2, 4, 8, 16), cuda_graph_token_sizes=(128, 256, 512, 1024, 2048),
              **overrides)
    path = llm.engine.decode_path()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(input_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))  # warm-up: Triton compiles, graphs warm
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        runs.append(time.perf_counter() - t0)
        assert all(len(o.token_ids) == output_len for o in outs)
    elapsed = min(runs)
    result = {"tp": tp, "all_reduce": path["all_reduce"], "all_reduce_fusion": path["all_reduce_fusion"],
              "overrides": overrides | (rules or {}), "all_reduce_note": path["all_reduce_note"],
              "tok_s": batch * output_len / elapsed, "elapsed_s": elapsed, "runs_s": runs,
              "async_scheduling": path["async_scheduling"], "skinny_gemm": path["skinny_gemm"],
              "prefill_cuda_graphs_captured": path["prefill_cuda_graphs_captured"]}
    result |= decode_graph_time(llm, batch)
    if timeline:
        result["timeline"] = host_timeline_summary(llm, prompts)
    if host_profile:
        result["host_profile"] = host_hotspots(llm, prompts, host_profile)
    if profile_dir is not None:
        engine = llm.engine
        engine.start_profile(profile_dir, activities=("CPU", "GPU"), label=f"tp{tp}-{path['all_reduce']}")
        steps = 64
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
        wall = time.perf_counter() - t0
        traces = engine.stop_profile()
        result |= all_reduce_share(traces[0])
        result["ranks"] = [rank_summary(t) for t in traces]
        result["profiled_wall_ms_per_step"] = wall * 1e3 / steps
        result["traces"] = [str(p) for p in traces]
    llm.shutdown()
    return result


def decode_graph_time(llm, batch: int, replays: int = 200) -> dict:
    """The batch's decode graph replayed back to back on every rank at once, no host in between: the GPU's own time
    per decode step (each rank's, by CUDA events), against which the measured step interval shows the host's part."""
    engine = llm.engine
    runner = engine.runner
    if runner.graphs is None:
        return {}
    if engine.other_ranks is None:
        return {"graph_ms_ranks": [runner.time_decode_graph(batch, replays)]}
    mine, theirs = engine.other_ranks.call_together("time_decode_graph", (batch, replays),
                                                    lambda: runner.time_decode_graph(batch, replays))
    return {"graph_ms_ranks": [mine, *theirs]}


def host_timeline_summary(llm, prompts, steps: int = 128) -> dict:
    """Medians over `steps` decode steps of the host path between the ranks (OtherRanks.record_timeline): rank 0's
    send of a step's inputs, rank 1's receipt and launch, rank 0's launch, and rank 0's turnaround from step N's
    tokens landing to sending step N+2 (async scheduling's critical host path), in microseconds."""
    from infertrace.engine import SamplingParams

    others = llm.engine.other_ranks
    if others is None:
        return {}
    others.record_timeline(True)
    llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
    mine, ranks = others.record_timeline(False)
    theirs = ranks[0]

    def times(events, what):
        return [t for w, t in events if w == what]

    send, launched0, landed = times(mine, "send"), times(mine, "launched"), times(mine, "landed")
    recv, launched1 = times(theirs, "recv"), times(theirs, "launched")
    n = min(len(send), len(launched0), len(landed), len(recv), len(launched1))

    def median_us(values):
        values = sorted(values)
        return round(values[len(values) // 2] / 1e3, 1) if values else None

    body = range(2, n - 2)  # the prefill and the last steps left out
    return {
        "steps": n,
        "send_interval_us": median_us([send[i + 1] - send[i] for i in body]),
        "pipe_us": median_us([recv[i] - send[i] for i in body]),
        "rank1_launch_us": median_us([launched1[i] - recv[i] for i in body]),
        "rank0_launch_us": median_us([launched0[i] - send[i] for i in body]),
        "rank1_after_rank0_us": median_us([launched1[i] - launched0[i] for i in body]),
        "turnaround_us": median_us([send[i + 2] - landed[i] for i in body]),
        "wait_for_tokens_us": median_us([landed[i] - launched0[i + 1] for i in body]),
    }


def host_hotspots(llm, prompts, top: int, steps: int = 128) -> list[list]:
    """Rank 0's host time by function over `steps` decode steps under cProfile: (function, own us per step,
    cumulative us per step, calls per step), the `top` by own time. cProfile slows every Python call alike, so the
    figures compare configurations rather than give absolute costs."""
    import cProfile
    import pstats

    from infertrace.engine import SamplingParams

    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [[f"{Path(f).name}:{line}:{name}", round(tt * 1e6 / steps, 1), round(ct * 1e6 / steps, 1),
             round(nc / steps, 2)] for (f, line, name), (cc, nc, tt, ct, _) in rows]


def exclusive_us(kernels: list[dict]) -> list[float]:
    """Each kernel's own time: from the later of its start and the end of the kernels before it on its stream, to its
    end. With programmatic dependent launch a kernel starts while the one before it runs and waits inside, so its
    recorded duration includes that wait (rank 0's kernels summed to 9.76 ms a 5.18 ms step, qwen3-14b TP=2 on two
    H200s); `infertrace analyze` counts GPU time by category the same way (phases.exclusive_ns)."""
    out = [0.0] * len(kernels)
    last_end: dict = {}
    for i in sorted(range(len(kernels)), key=lambda i: (kernels[i].get("args", {}).get("stream", -1), kernels[i]["ts"])):
        k = kernels[i]
        stream = k.get("args", {}).get("stream", -1)
        end = k["ts"] + k["dur"]
        out[i] = max(end - max(k["ts"], last_end.get(stream, k["ts"])), 0.0)
        last_end[stream] = max(last_end.get(stream, end), end)
    return out


def all_reduce_share(trace_path: Path) -> dict:
    """GPU time of all-reduce kernels per decode step and their share of the decode steps' GPU kernel time, from
    rank 0's trace, each kernel's own time (`exclusive_us`): kernels are assigned to the step[DECODE ..] range whose
    launches they follow."""
    trace = json.loads(gzip.decompress(Path(trace_path).read_bytes()))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    decode = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "user_annotation" and e["name"].startswith("step[DECODE"))
    if not decode or not kernels:
        return {"profile_decode_steps": len(decode)}
    # GPU kernels of the decode window: from the first decode step's start to the last kernel before the next
    # non-decode step (the capture ends with decode steps)
    start = decode[0][0]
    window = [k for k in kernels if k["ts"] >= start]
    own = exclusive_us(window)
    ar = sum(t for k, t in zip(window, own) if any(s in k["name"] for s in AR_KERNELS))
    busy = sum(own)
    span = (max(k["ts"] + k["dur"] for k in window) - start) if window else 0
    n = len(decode)
    return {"profile_decode_steps": n, "all_reduce_us_per_step": ar / n, "gpu_busy_us_per_step": busy / n,
            "gpu_span_us_per_step": span / n, "all_reduce_share_of_busy": ar / busy if busy else None,
            "all_reduce_share_of_span": ar / span if span else None,
            "all_reduce_kernel_names": sorted({k["name"][:60] for k in window
                                               if any(s in k["name"] for s in AR_KERNELS)})}


def rank_summary(trace_path: Path, top: int = 20) -> dict:
    """One rank's decode steps: host time inside each step range (CPU), and its top GPU kernels in us per step."""
    trace = json.loads(gzip.decompress(Path(trace_path).read_bytes()))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("step[DECODE")]
    if not steps:
        return {}
    start = min(e["ts"] for e in steps)
    per: dict[str, float] = {}
    window = [k for k in events if k.get("cat") == "kernel" and k["ts"] >= start]
    for k, own in zip(window, exclusive_us(window)):
        name = k["name"][:70]
        per[name] = per.get(name, 0.0) + own
    n = len(steps)
    host = sorted(e["dur"] for e in steps)
    starts = sorted(e["ts"] for e in steps)
    gaps = sorted(b - a for a, b in zip(starts, starts[1:]))
    return {"steps": n, "host_us_per_step_median": host[n // 2],
            "step_start_interval_us_median": gaps[len(gaps) // 2] if gaps else None,
            "top_kernels_us_per_step": {k: round(v / n, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]}}


def shard_preset(name: str, n: int) -> str:
    """Register (in this process) and return the name of a preset whose attention heads, KV heads and MLP width are
    `name`'s divided by `n`: one rank's layers at TP=n, which the engine then runs whole on one GPU."""
    from dataclasses import replace

    from infertrace.modelgen import PRESETS

    spec = PRESETS[name]
    if spec.num_attention_heads % n or spec.num_key_value_heads % n or spec.intermediate_size % n:
        raise SystemExit(f"--shard-of {n}: {name}'s heads and MLP width do not divide by {n}")
    shard = f"{name}-rank-of-tp{n}"
    PRESETS[shard] = replace(spec, num_attention_heads=spec.num_attention_heads // n,
                             num_key_value_heads=spec.num_key_value_heads // n,
                             intermediate_size=spec.intermediate_size // n)
    return shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--model", default=None, help="an existing model directory (else one is written)")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--all-reduce", default="nccl,custom", help="implementations tried at TP>1")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--profile-dir", default=None, help="capture a profile of each configuration here")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also print rank 0's N costliest Python functions per decode step (cProfile)")
    ap.add_argument("--timeline", action="store_true",
                    help="also time the host path between the ranks per decode step (OtherRanks.record_timeline)")
    ap.add_argument("--variants", default="", help="more TP>1 runs, ';'-separated, each tp:all_reduce:key=value,... "
                    "(an engine setting, or a rule of kernels/tuning.py RULES)")
    ap.add_argument("--out", default=None, help="JSON file for every figure")
    ap.add_argument("--config-timeout", type=float, default=900.0, help="seconds one configuration may take")
    ap.add_argument("--shard-of", type=int, default=None, metavar="N",
                    help="write a model whose layers have the shapes of one rank of TP=N (heads, KV heads and the "
                         "MLP width divided by N; the vocabulary whole) and run it on one GPU: the TP=N rank's "
                         "work without the all-reduce, for one-GPU experiments on the shards' kernels")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one configuration
    args = ap.parse_args()

    if args.one:
        tp, ar, *rest = args.one.split(":")
        from infertrace.config_fields import parse_overrides
        from infertrace.engine.config import EngineConfig
        from infertrace.engine.kernels import tuning

        text = dict(kv.split("=", 1) for kv in rest[0].split(",")) if rest and rest[0] else {}
        rules = {k: v for k, v in text.items() if k in tuning.RULES}  # the kernels' rules, not settings
        if rules:
            os.environ[tuning.ENV] = tuning.with_rules(rules)
        overrides = parse_overrides(EngineConfig, {k: v for k, v in text.items() if k not in rules}, "engine")
        res = run_one(args.model, int(tp), ar, args.batch, args.input_len, args.output_len, args.profile_dir,
                      overrides, args.host_profile, args.timeline, rules)
        print("RESULT " + json.dumps(res), flush=True)
        return

    model = args.model
    if model is None:
        from infertrace.modelgen import init_model

        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        preset = args.preset if args.shard_of is None else shard_preset(args.preset, args.shard_of)
        model = str(root / f"tp-bench-{preset}")
        t0 = time.perf_counter()
        if not (Path(model) / "config.json").exists():
            init_model(preset, model, seed=0, device="cuda")
        print(f"model {args.preset} ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if args.shard_of is not None:
        args.tp = "1"  # the shard's model is one rank's: TP=1 (and TP=1 variants) only
    configs = []
    for tp in (int(t) for t in args.tp.split(",")):
        import torch

        if torch.cuda.is_available() and tp > torch.cuda.device_count():
            print(f"skipping TP={tp}: {torch.cuda.device_count()} GPUs", file=sys.stderr)
            continue
        configs += [f"{tp}:nccl"] if tp == 1 else [f"{tp}:{ar}" for ar in args.all_reduce.split(",")]
    configs += [v for v in args.variants.split(";") if v]
    results = []
    for one in configs:
        tp, ar = one.split(":")[:2]
        cmd = [sys.executable, __file__, "--one", one, "--model", model, "--batch", str(args.batch),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        if args.profile_dir:
            cmd += ["--profile-dir", args.profile_dir]
        if args.host_profile:
            cmd += ["--host-profile", str(args.host_profile)]
        if args.timeline:
            cmd += ["--timeline"]
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.config_timeout, env=os.environ)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-2000:]
            print(f"{one}: no result within {args.config_timeout:.0f} s\n"
                  f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}", file=sys.stderr, flush=True)
            continue
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{one}: failed (code {out.returncode})\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        res = json.loads(line[len("RESULT "):])
        res["process_s"] = time.perf_counter() - t0
        results.append(res)
        graph = res.get("graph_ms_ranks")
        graph_text = f", decode graph alone {'/'.join(f'{g:.3f}' for g in graph)} ms" if graph else ""
        print(f"{one}: {res['tok_s']:.0f} tok/s, step {res['elapsed_s'] * 1e3 / args.output_len:.3f} ms{graph_text} "
              f"({res['process_s']:.0f} s)", file=sys.stderr, flush=True)
        if res.get("timeline"):
            print(f"  host path: {json.dumps(res['timeline'])}", file=sys.stderr, flush=True)
        for rank, summary in enumerate(res.get("ranks", [])):
            print(f"  rank {rank}: {json.dumps(summary)}", file=sys.stderr, flush=True)
        for fn, own, cum, calls in res.get("host_profile", []):
            print(f"  host {own:>8.1f} us own {cum:>8.1f} us cum {calls:>6.2f}/step  {fn}", file=sys.stderr, flush=True)
    base = next((r["tok_s"] for r in results if r["tp"] == 1), None)
    shard = f" (one rank of TP={args.shard_of}, on one GPU)" if args.shard_of else ""
    print(f"\n{args.preset}{shard}, batch {args.batch}, {args.input_len} in / {args.output_len} out, greedy")
    print(f"{'TP':>3} {'all-reduce':>10} {'overrides':>24} {'tok/s':>8} {'x TP=1':>7} {'AR us/step':>10} {'AR share':>8} "
          f"{'GPU busy us/step':>16} {'wall ms/step':>12} {'graph ms':>8}")
    def fmt(value, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for r in results:
        ratio = r["tok_s"] / base if base else float("nan")
        extra = ",".join(f"{k}={v}" for k, v in r["overrides"].items())
        print(f"{r['tp']:>3} {r['all_reduce']:>10} {extra:>24} {r['tok_s']:>8.0f} {ratio:>7.2f} "
              f"{fmt(r.get('all_reduce_us_per_step'), '.0f'):>10} {fmt(r.get('all_reduce_share_of_span'), '.1%'):>8} "
              f"{fmt(r.get('gpu_busy_us_per_step'), '.0f'):>16} {fmt(r.get('profiled_wall_ms_per_step'), '.2f'):>12} "
              f"{fmt((r.get('graph_ms_ranks') or [None])[0], '.3f'):>8}")
    if args.out:
        Path(args.out).write_text(json.dumps({"preset": args.preset, "batch": args.batch, "input_len": args.input_len,
                                              "output_len": args.output_len, "results": results}, indent=2))


if __name__ == "__main__":
    main()
