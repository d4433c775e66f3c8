"""Where a served request's TTFT goes, stage by stage, on the server's clock: `infertrace serve` as a user starts it,
loaded by `infertrace bench` at an open-loop rate, each request's stages read back from the server's request log
(`GET /v1/request_log`, docs/serve.md "The request log"). Nothing in the server is wrapped or patched, so what is
timed is the code that serves.

    python benchmarks/request_path.py MODEL_DIR [--mode graphs|eager] [--num-prompts 600] [--rate 60]
    python benchmarks/request_path.py tiny --device cpu --num-prompts 40 --rate 10 --input-len 32 --output-len 8

Stages, each request's own, between the times the log keeps: the front end has the request (`received`), has it
tokenized and handed to the engine (`tokenized`), the engine takes it in (`arrival`: after the step running then),
the first step that carries it begins (`first_step`), the step that samples its first token ends (`first_token`),
and the front end's handler has that output (`first_output`). Printed: the median (mean) of each stage over the
measured requests, and the client's TTFT beside the server's share of it (the rest is the client's send, the
write of the first chunk and the network).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `python benchmarks/request_path.py`: the package
from benchmarks.common import run_bench  # noqa: E402
from infertrace.modelgen.cached import preset_model_dir  # noqa: E402

STAGES = ("received", "tokenized", "arrival", "first_step", "first_token", "first_output")
READY_TIMEOUT_S = 600.0  # a real model's weights load and its graphs are captured before /health answers


def step_times(ridden: list[list], steps: dict[int, dict]) -> dict[str, float] | None:
    """When the first step a request rode began and when the step that sampled its first token ended, from its
    `[step, tokens, prefill, sampled]` rows and the log's steps by number; None for a request without a first token
    (aborted) or whose steps left the log."""
    rows = [r for r in ridden if r[0] in steps]
    sampled = next((r for r in rows if r[3]), None)
    if not rows or sampled is None:
        return None
    first, token = steps[rows[0][0]], steps[sampled[0]]
    return {"first_step": first["start"], "first_token": token["start"] + token["duration"]}


def request_stages(log_pages: list[dict]) -> list[dict[str, float]]:
    """Every request the pages hold with all of STAGES, in log order."""
    steps = {s["step"]: s for page in log_pages for s in page["steps"]}
    found = []
    for page in log_pages:
        for rec in page["requests"]:
            times = step_times(rec.get("steps") or [], steps)
            if times is None:
                continue
            times.update({k: rec.get(k) for k in ("received", "tokenized", "arrival", "first_output")})
            if all(times[k] is not None for k in STAGES):
                found.append(times)
    return found


def read_log(base_url: str, since: int) -> list[dict]:
    """The request log's pages from request number `since` on, following `next` until a page comes back empty."""
    pages = []
    while True:
        with urllib.request.urlopen(f"{base_url}/v1/request_log?since={since}", timeout=60) as resp:
            page = json.load(resp)
        if not page["requests"]:
            return pages
        pages.append(page)
        since = page["next"]


def log_cursor(base_url: str) -> int:
    with urllib.request.urlopen(f"{base_url}/v1/request_log?limit=0", timeout=60) as resp:
        return json.load(resp)["next"]


def wait_ready(base_url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"serve exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise SystemExit(f"serve did not answer /health within {timeout_s:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary(stages: list[dict[str, float]], result: dict) -> list[str]:
    """The printed lines: each stage's median (mean) in ms, then the server's share of the client's TTFT."""
    lines = ["stage, ms: median (mean)"]
    for start, end in zip(STAGES, STAGES[1:]):
        values = [1e3 * (s[end] - s[start]) for s in stages]
        lines.append(f"  {start:>12} -> {end:<12} {statistics.median(values):7.3f} ({statistics.mean(values):.3f})")
    total = [1e3 * (s["first_output"] - s["received"]) for s in stages]
    lines.append(f"  server, received to first output: {statistics.median(total):.3f} ({statistics.mean(total):.3f}); "
                 f"the client's TTFT beyond it: {result['median_ttft_ms'] - statistics.median(total):.3f} "
                 f"({result['mean_ttft_ms'] - statistics.mean(total):.3f})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model directory or preset, as `infertrace serve --model` takes it")
    parser.add_argument("--mode", choices=("graphs", "eager"), default="graphs", help="token-count CUDA graphs")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rate", type=float, default=60.0)
    parser.add_argument("--num-prompts", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()

    tokenizer = Path(args.model) if Path(args.model).is_dir() else preset_model_dir(args.model)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "infertrace", "serve", "--model", args.model, "--port", str(port),
           "--device", args.device, "--max-queue", str(max(1000, args.num_prompts))]
    if args.mode == "eager":
        cmd.append("--no-prefill-cuda-graphs")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        wait_ready(base_url, server, READY_TIMEOUT_S)
        # bench's own --warmup requests would land in the log among the measured ones: they get a run of their own
        if args.warmup:
            run_bench(base_url, tokenizer, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                      "--ignore-eos", "--num-prompts", str(args.warmup), "--warmup", "0")
        since = log_cursor(base_url)
        result = run_bench(base_url, tokenizer, "--input-len", str(args.input_len), "--output-len",
                           str(args.output_len), "--ignore-eos", "--num-prompts", str(args.num_prompts),
                           "--request-rate", str(args.rate), "--warmup", "0")
        stages = request_stages(read_log(base_url, since))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if not stages:
        raise SystemExit("no request in the request log has every stage")
    print(f"{args.model} ({args.mode}): {len(stages)} requests at {args.rate:g}/s, client TTFT p50 "
          f"{result['median_ttft_ms']:.3f} ms (mean {result['mean_ttft_ms']:.3f})")
    print("\n".join(summary(stages, result)))


if __name__ == "__main__":
    main()
