"""Nsight Systems: find `nsys`, build the cudaProfilerApi capture command, run a command under it."""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# Set for the wrapped process; CaptureSession then opens only the cudaProfilerApi range (no Kineto).
NSYS_OUTPUT_ENV = "INFERTRACE_NSYS_OUTPUT"

INSTALL_GLOBS = (
    "/opt/nvidia/nsight-systems*/bin/nsys",
    "/opt/nvidia/nsight-systems*/*/bin/nsys",
    "/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys",
    "/usr/local/cuda*/bin/nsys",
)

# Capture only between cudaProfilerStart and cudaProfilerStop; without sampling and context-switch
# tracing a capture of a few steps stays megabytes instead of gigabytes.
CAPTURE_ARGS = (
    "--capture-range=cudaProfilerApi",
    "--capture-range-end=stop",
    "--trace=cuda,nvtx,osrt",
    "--sample=none",
    "--cpuctxsw=none",
)
# vLLM and SGLang run the model in forked worker processes; graphs are traced per kernel node.
MULTIPROCESS_ARGS = ("--trace-fork-before-exec=true", "--cuda-graph-trace=node")

# How each server flavour is launched so that its /start_profile calls cudaProfilerStart.
SERVER_LAUNCH = {
    "infertrace": ["infertrace", "serve", "--model", "MODEL_DIR"],
    "vllm": ["vllm", "serve", "MODEL", "--profiler-config", '{"profiler": "cuda"}'],
    "sglang": ["python", "-m", "sglang.launch_server", "--model-path", "MODEL"],
}
# What then opens the capture range on a running server.
SERVER_START_HINT = {
    "infertrace": "infertrace profile --url URL --start --activities CUDA_PROFILER",
    "vllm": "infertrace profile --url URL --start --num-steps N   (vLLM < 0.13: launch with "
            "VLLM_TORCH_CUDA_PROFILE=1)",
    "sglang": "infertrace profile --url URL --start --activities CUDA_PROFILER",
}


class NsysNotFoundError(RuntimeError):
    pass


def find_nsys(env: dict[str, str] | None = None) -> Path | None:
    """The nsys binary: $NSYS, then PATH, then the usual install directories (newest version first)."""
    env = os.environ if env is None else env
    explicit = env.get("NSYS")
    if explicit:
        path = Path(explicit)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    on_path = shutil.which("nsys", path=env.get("PATH"))
    if on_path:
        return Path(on_path)
    found = [p for pattern in INSTALL_GLOBS for p in glob.glob(pattern) if os.access(p, os.X_OK)]
    found.sort(key=lambda p: [int(n) for n in re.findall(r"\d+", p)], reverse=True)
    return Path(found[0]) if found else None


def require_nsys(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    nsys = find_nsys(env)
    if nsys is not None:
        return nsys
    if env.get("NSYS"):
        raise NsysNotFoundError(f"NSYS={env['NSYS']} is not an executable file")
    raise NsysNotFoundError(
        "nsys (Nsight Systems) not found: not on PATH, NSYS is unset, and none under "
        + ", ".join(INSTALL_GLOBS) + "; install Nsight Systems or set NSYS=/path/to/nsys")


def nsys_profile_command(output: str | Path, command: list[str], nsys: str | Path = "nsys",
                         multiprocess: bool = False, repeat: bool = False) -> list[str]:
    """`nsys profile <capture args> -o OUTPUT COMMAND...` (nsys adds .nsys-rep to OUTPUT). `repeat`: every
    cudaProfilerStart/Stop pair of a long-lived server becomes its own report (OUTPUT.1, OUTPUT.2, ...) instead
    of the first one ending the capture."""
    extra = MULTIPROCESS_ARGS if multiprocess else ()
    args = [a.replace("--capture-range-end=stop", "--capture-range-end=repeat") if repeat else a for a in CAPTURE_ARGS]
    return [str(nsys), "profile", *args, *extra, "-o", str(output), *command]


def infertrace_argv(args: list[str]) -> list[str]:
    """The command line that re-executes infertrace with `args`, with this interpreter."""
    return [sys.executable, "-c", "import sys; from infertrace.cli import main; sys.exit(main())", *args]


def run_under_nsys(command: list[str], output: str | Path, nsys: str | Path) -> tuple[int, list[Path]]:
    """Run `command` under nsys; return its exit status and the reports nsys wrote."""
    output = str(output)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, NSYS_OUTPUT_ENV: output}
    rc = subprocess.run(nsys_profile_command(output, command, nsys), env=env, check=False).returncode
    reports = sorted(Path(p) for p in glob.glob(glob.escape(output).replace("%p", "*") + ".nsys-rep"))
    return rc, reports


def server_nsys_line(flavour: str, output: str | Path, server_command: list[str] | None = None,
                     nsys: str | Path = "nsys") -> str:
    """The shell line that launches a server of `flavour` under nsys with the cudaProfilerApi range; each
    start/stop window the server is then given lands in a report of its own."""
    command = list(server_command) if server_command else SERVER_LAUNCH[flavour]
    return shlex.join(nsys_profile_command(output, command, nsys, multiprocess=flavour != "infertrace",
                                           repeat=True))
