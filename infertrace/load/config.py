"""Every knob of `infertrace bench`, declared once (the CLI reads its defaults from here) and validated once."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

ENDPOINTS = ("completions", "chat")
DATASETS = ("random", "shared-prefix", "sharegpt", "jsonl")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
SWEEP_PARAMS = {"concurrency": "concurrency", "request-rate": "request_rate"}
DEFAULT_OUTPUT_LEN = 64  # --output-len for random prompts and files that name no length
DEFAULT_CONCURRENCY = 8  # closed loop when neither --concurrency nor --request-rate is given
DEFAULT_SWEEP_PLOT = "bench-sweep.png"
MIN_REQUEST_RATE = 1 / 3600  # one request an hour; below it the first gaps outlast any benchmark
RESERVED_BODY_KEYS = {  # request-body keys bench sets itself, and the option that sets each
    "stream": "bench always streams",
    "stream_options": "bench asks for usage itself (see --no-continuous-usage)",
    "model": "use --served-model-name", "max_tokens": "use --output-len", "max_completion_tokens": "use --output-len",
    "temperature": "use --temperature", "ignore_eos": "use --ignore-eos",
    "prompt": "the dataset gives the prompts", "messages": "the dataset gives the prompts",
    "n": "bench measures one choice a request",
}


def _finite_positive(name: str, value: float | None, unit: str = "") -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number{unit}, got {value}")


@dataclass(slots=True)
class BenchConfig:
    # target
    base_url: str | None = None  # None: the bundled engine in-process
    endpoint: str = "completions"
    model: str | None = None  # server: the model name sent (or a local model directory); embedded: a directory
    served_model_name: str | None = None  # server: the name sent when it differs from --model
    tokenizer: str | None = None  # a local tokenizer directory (default: --model when it is a directory)
    engine_overrides: dict = field(default_factory=dict)  # embedded engine config fields
    # dataset
    dataset: str = "random"
    dataset_path: str | None = None
    input_len: int = 256
    output_len: int | None = None  # None: DEFAULT_OUTPUT_LEN, or the length a dataset file gives
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 4
    seed: int = 0
    # load shape
    num_prompts: int = 32
    duration_s: float | None = None
    concurrency: int | None = None
    request_rate: float | None = None  # None: closed loop; math.inf: everything at once
    burstiness: float = 1.0
    warmup: int = 2
    sweep_param: str | None = None  # "concurrency" or "request_rate"
    sweep_values: tuple = ()
    # request body
    ignore_eos: bool = False
    temperature: float = 0.0
    continuous_usage: bool = True
    extra_body: dict = field(default_factory=dict)
    request_timeout_s: float = 600.0
    headers: dict = field(default_factory=dict)  # on every HTTP call (--api-key, --header); values never written
    # measurement
    slo: dict = field(default_factory=dict)
    profile: bool = False
    profile_steps: int | None = None
    profile_seconds: float | None = None
    # outputs
    result_json: str | None = None
    requests_jsonl: str | None = None
    plot: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.dataset in ("sharegpt", "jsonl") and not self.dataset_path:
            raise ValueError(f"--dataset {self.dataset} needs --dataset-path FILE")
        for name in ("input_len", "prefix_len", "num_prefixes", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"output_len must be at least 1, got {self.output_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        _finite_positive("duration", self.duration_s, " of seconds")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and not (self.request_rate >= MIN_REQUEST_RATE):  # NaN fails too
            raise ValueError(f"request_rate must be at least {MIN_REQUEST_RATE:.6g} (one request an hour) "
                             f"or inf, got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        _finite_positive("request_timeout", self.request_timeout_s, " of seconds")
        if not (0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        for key, why in RESERVED_BODY_KEYS.items():
            if key in self.extra_body:
                raise ValueError(f"--extra-body may not set {key!r}: {why}")
        for key, value in self.slo.items():
            if key not in SLO_KEYS:
                raise ValueError(f"unknown SLO {key!r}; use {', '.join(SLO_KEYS)}")
            if not (value > 0 and math.isfinite(value)):  # the result file is strict JSON: no infinity
                raise ValueError(f"SLO {key} must be a positive number, got {value}")
        if self.sweep_param is not None:
            if self.sweep_param not in SWEEP_PARAMS.values() or not self.sweep_values:
                raise ValueError(f"a sweep needs one of {', '.join(SWEEP_PARAMS)} and at least one value")
            if self.profile:
                raise ValueError("--profile profiles one run; it cannot be combined with --sweep")
            self.points()  # each point validates its own value
        if self.profile_steps is not None and self.profile_steps < 1:
            raise ValueError(f"profile_steps must be at least 1, got {self.profile_steps}")
        _finite_positive("profile_seconds", self.profile_seconds)
        if (self.profile_steps is not None or self.profile_seconds is not None) and not self.profile:
            self.profile = True
        if self.profile and self.base_url is None:
            raise ValueError("--profile starts a server's profiler; it needs --base-url")

    @property
    def open_loop(self) -> bool:
        return self.request_rate is not None

    @property
    def effective_concurrency(self) -> int | None:
        """In-flight cap: the closed loop's workers, or the open loop's optional cap (None: no cap)."""
        return self.concurrency if self.open_loop else (self.concurrency or DEFAULT_CONCURRENCY)

    @property
    def max_connections(self) -> int:
        """The HTTP connection pool for every point of the run; 0 means no limit (an uncapped open loop)."""
        caps = [p.effective_concurrency for p in self.points()]
        return 0 if None in caps else max(caps)

    @property
    def effective_output_len(self) -> int:
        return self.output_len or DEFAULT_OUTPUT_LEN

    def points(self) -> list[BenchConfig]:
        """One config per sweep value (the config itself when there is no sweep)."""
        if self.sweep_param is None:
            return [self]
        out = []
        for value in self.sweep_values:
            fields = asdict(self) | {self.sweep_param: value, "sweep_param": None, "sweep_values": ()}
            out.append(BenchConfig(**fields))
        return out

    def output_paths(self) -> dict[str, str]:
        """Every file the run will write, by the option that names it (checked before any request)."""
        paths = {"--result-json": self.result_json, "--requests-jsonl": self.requests_jsonl}
        if self.sweep_param is not None:
            paths["--plot"] = self.plot or (str(Path(self.result_json).with_suffix(".png")) if self.result_json
                                            else DEFAULT_SWEEP_PLOT)
        return {flag: path for flag, path in paths.items() if path}

    def to_json(self) -> dict:
        d = asdict(self)
        del d["headers"]  # how to reach the server, not what was measured; provenance names them, redacted
        for key in ("request_rate",):
            if d[key] is not None and math.isinf(d[key]):
                d[key] = "inf"
        d["sweep_values"] = ["inf" if isinstance(v, float) and math.isinf(v) else v for v in d["sweep_values"]]
        return d


def parse_slo(text: str) -> dict[str, float]:
    """`ttft_ms=500,tpot_ms=50` -> {"ttft_ms": 500.0, "tpot_ms": 50.0}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=MILLISECONDS, got {part!r}")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{key.strip()}: {value!r} is not a number") from None
    return out


def parse_sweep(text: str) -> tuple[str, tuple]:
    """`concurrency=1,2,4` or `request-rate=1,2,inf` -> (field name, values)."""
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in SWEEP_PARAMS:
        raise ValueError(f"expected concurrency=N,N,... or request-rate=R,R,...; got {text!r}")
    try:
        if name == "concurrency":
            parsed = tuple(int(v) for v in values.split(",") if v.strip())
        else:
            parsed = tuple(float(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{name} values must be numbers, got {values!r}") from None
    if not parsed:
        raise ValueError(f"{name} needs at least one value")
    return SWEEP_PARAMS[name], parsed
