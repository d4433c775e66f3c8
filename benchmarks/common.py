"""What the benchmark scripts share: the model directories they build, the GPU's copy bandwidth (the ceiling a
memory-bound figure is set against), the timing of a call replayed back to back, the figures' rows, and a run of
`infertrace bench` against a server."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (figure, value, setup): each script's printed table, in the order the figures were measured
ROWS: list[tuple[str, str, str]] = []


def row(name: str, value: str, note: str = "") -> None:
    ROWS.append((name, value, note))
    print(f"  {name}: {value}  {note}", flush=True)


def print_rows(out: Path | None = None) -> None:
    """The figures as the markdown table docs/benchmarks.md takes, and as JSON at `out`."""
    print("\n| figure | value | setup |\n| --- | --- | --- |")
    for name, value, note in ROWS:
        print(f"| {name} | {value} | {note} |")
    if out is not None:
        from infertrace.output import write_json

        write_json(out, [dict(zip(("figure", "value", "setup"), r)) for r in ROWS])


def model_dir(root: Path, preset: str, dtype: str = "bfloat16", device: str = "cpu",
              max_positions: int | None = None) -> Path:
    """The model directory of `preset` under `root`, written on first use (`device="cuda"` draws the weights on
    the GPU: seconds for the larger presets); `max_positions` raises the context a long-prompt test needs."""
    from infertrace.modelgen import init_model

    path = root / f"{preset}-{dtype}" if max_positions is None else root / f"{preset}-{dtype}-{max_positions}pos"
    if not (path / "config.json").exists():
        init_model(preset, path, seed=0, dtype=dtype, device=device)
        if max_positions is not None:
            cfg = json.loads((path / "config.json").read_text())
            cfg["max_position_embeddings"] = max_positions
            (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def median_call_ms(call, reps: int = 5, each: int = 40) -> float:
    """Milliseconds a `call` (a CUDA graph replay, a kernel launch) takes back to back: the median of `reps` rounds
    of `each` calls, after 5 untimed calls, with the device synchronized before each clock read."""
    import torch

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(each):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / each)
    return 1e3 * statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s the GPU reads plus writes in a 2 GiB device-to-device copy, the median of 10 copies timed by CUDA
    events after 3 untimed ones: the practical ceiling of a memory-bound kernel. Events, not the host clock, since a
    copy is under a millisecond and a launch and a synchronize would be a few percent of it."""
    import torch

    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() / statistics.median(times)


def run_bench(base_url: str, tokenizer: Path | str, *options: str) -> dict:
    """One `infertrace bench` run against `base_url` (in a process of its own, as a user runs it): its result JSON.
    A failed run ends the script with bench's last lines."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "infertrace", "bench", "--base-url", base_url, "--tokenizer", str(tokenizer),
               "--scrape-interval", "0", *options, "--result-json", str(out)]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"bench failed: {done.stderr[-2000:]}")
        return json.loads(out.read_text())
