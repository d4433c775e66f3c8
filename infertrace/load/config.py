"""Every knob of `infertrace bench`, declared once (the CLI reads its defaults from here) and validated once."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from infertrace import config_fields

ENDPOINTS = ("completions", "chat", "embeddings")
SERVER_METRICS_MODES = ("auto", "on", "off")  # --server-metrics
DATASETS = ("random", "shared-prefix", "sharegpt", "jsonl", "trace", "conversation", "agent-trace")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")  # per-request bounds: goodput
SLO_STATS = {"median": 50, "p90": 90, "p95": 95, "p99": 99}  # run-level bounds, e.g. p99_ttft_ms: --find-max
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
RAMP_UP_STRATEGIES = ("linear", "exponential")
FIND_MAX_PARAMS = {"concurrency": "concurrency", "request-rate": "request_rate"}
SWEEP_PARAMS = {"concurrency": "concurrency", "request-rate": "request_rate"}
DEFAULT_OUTPUT_LEN = 64  # --output-len for random prompts and files that name no length
DEFAULT_CONCURRENCY = 8  # closed loop when neither --concurrency nor --request-rate is given
DEFAULT_WARMUP = 2  # warmup requests, except for trace replay (none: they would seed the prefix cache)
DEFAULT_SWEEP_PLOT = "bench-sweep.png"
DEFAULT_SCRAPE_INTERVAL_S = 1.0  # --scrape-interval; also the scraper's own default
DEFAULT_CAPACITY_PLOT = "bench-capacity.png"
MIN_REQUEST_RATE = 1 / 3600  # one request an hour; below it the first gaps outlast any benchmark
RESERVED_BODY_KEYS = {  # request-body keys bench sets itself, and the option that sets each
    "stream": "bench always streams",
    "stream_options": "bench asks for usage itself (see --no-continuous-usage)",
    "model": "use --served-model-name", "max_tokens": "use --output-len", "max_completion_tokens": "use --output-len",
    "temperature": "use --temperature", "ignore_eos": "use --ignore-eos",
    "prompt": "the dataset gives the prompts", "messages": "the dataset gives the prompts",
    "n": "bench measures one choice a request",
    "input": "the dataset gives the inputs (--random-batch-size of them a request)",
}
EMBEDDINGS_DATASETS = ("random", "shared-prefix", "sharegpt", "jsonl")  # one answer a request: no session, no trace
STREAMED_SLO_METRICS = ("ttft", "tpot", "itl")
STRUCTURED_MODES = ("json-schema", "tools")  # --structured
DEFAULT_IMAGE_SIZE = (512, 512)  # generated images, width x height
TOOL_CHOICES = ("required", "named")
LORA_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")  # an embeddings answer comes whole: only E2EL is measured


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
    time_scale: float = 1.0  # trace: every timestamp multiplied by this (0.5 replays twice as fast)
    token_scale: float = 1.0  # trace: lengths and the hash block multiplied by this (1/32: 16-token blocks)
    turns: int = 3  # conversation without a file: turns of each synthetic session
    turn_input_len: int = 128  # conversation without a file: tokens of each user message
    think_time_s: float = 0.0  # conversation: pause between a reply and the next turn
    embed_batch_size: int = 1  # embeddings: inputs each request carries (vLLM's --random-batch-size)
    lora_modules: dict = field(default_factory=dict)  # LoRA adapter name -> its share of the requests (relative)
    structured: str | None = None  # "json-schema" (response_format) or "tools" (tools + tool_choice)
    schemas_path: str | None = None  # --schemas: a JSONL of JSON schemas (None: generated ones)
    structured_share: float = 1.0  # the share of requests constrained; the rest are the run's unconstrained baseline
    tool_choice: str = "required"  # tools: "required" (any offered tool) or "named" (the offered tool, by name)
    images: int = 0  # chat: images each request carries (vLLM's --random-mm-base-items-per-request)
    image_size: tuple = DEFAULT_IMAGE_SIZE  # generated images: width, height in pixels
    image_dir: str | None = None  # images from this folder's files instead of generated ones
    # load shape
    num_prompts: int = 32
    duration_s: float | None = None
    concurrency: int | None = None
    request_rate: float | None = None  # None: closed loop; math.inf: everything at once
    burstiness: float = 1.0
    ramp_up_strategy: str | None = None  # an open loop whose rate ramps from start to end over the requests
    ramp_up_start_rps: float | None = None
    ramp_up_end_rps: float | None = None
    warmup: int | None = None  # None: DEFAULT_WARMUP, or none for trace replay (see effective_warmup)
    sweep_param: str | None = None  # "concurrency" or "request_rate"
    sweep_values: tuple[int | float, ...] = ()
    find_max: str | None = None  # "concurrency" or "request_rate": the highest load meeting every --slo bound
    find_max_start: float = 1.0  # the first load tried, doubled until a bound is missed
    find_max_limit: float = 1024.0  # the highest load tried
    find_max_points: int = 12  # the most loads tried
    find_max_repeats: int = 3  # the most runs at one load whose verdict the first run leaves uncertain
    # load generators: worker processes on this host (per node with Ray), and the Ray cluster to place them on
    workers: int = 1
    ray_address: str | None = None
    # request body
    ignore_eos: bool = False
    temperature: float = 0.0
    continuous_usage: bool = True
    server_metrics: str = "auto"  # vLLM's per-request metrics: auto (a vLLM that has them), on, off
    extra_body: dict = field(default_factory=dict)
    request_timeout_s: float = 600.0
    headers: dict = field(default_factory=dict)  # on every HTTP call (--api-key, --header); values never written
    # measurement
    slo: dict = field(default_factory=dict)
    profile: bool = False
    profile_steps: int | None = None
    profile_seconds: float | None = None
    # the server's side: /metrics scraped every this many seconds (0: off), from metrics_url or the base URL's
    scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S
    metrics_url: str | None = None
    # repeated runs against one server: a line before every prompt (random: a new one each run), and emptying the
    # server's prefix cache before the run
    prompt_salt: str | None = None
    reset_prefix_cache: bool = False
    # the server's own record of each request, joined by id (docs/bench.md, "The server's side of each request"):
    # its OTLP spans received here while the run goes on, or a file of them (or SGLang's log) read after it; and
    # bench's own request spans exported to an OTLP endpoint after the run
    otlp_receiver: tuple[str, ...] = ()
    peer_log: str | None = None
    otlp_traces_endpoint: str | None = None
    # outputs
    result_json: str | None = None
    requests_jsonl: str | None = None
    plot: str | None = None
    report: str | None = None  # the self-contained HTML run report

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.server_metrics not in SERVER_METRICS_MODES:
            raise ValueError(f"server_metrics must be one of {', '.join(SERVER_METRICS_MODES)}, "
                             f"got {self.server_metrics!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.dataset in ("sharegpt", "jsonl", "agent-trace") and not self.dataset_path:
            raise ValueError(f"--dataset {self.dataset} needs --dataset-path FILE")
        self._check_trace_and_sessions()
        self._check_embeddings()
        self._check_lora()
        self._check_structured()
        self._check_images()
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
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        _finite_positive("request_timeout", self.request_timeout_s, " of seconds")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if (self.workers > 1 or self.ray_address) and self.base_url is None:
            raise ValueError("--workers and --ray send load to a server (--base-url); the bundled engine runs "
                             "in this process")
        if self.report and (self.sweep_param is not None or self.find_max is not None):
            raise ValueError("--report explains one run; it cannot be combined with --sweep or --find-max")
        if not (self.scrape_interval_s >= 0 and math.isfinite(self.scrape_interval_s)):
            raise ValueError(f"scrape_interval must be 0 (off) or a positive number of seconds, "
                             f"got {self.scrape_interval_s}")
        if not (0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        for key, why in RESERVED_BODY_KEYS.items():
            if key in self.extra_body:
                raise ValueError(f"--extra-body may not set {key!r}: {why}")
        for key, value in self.slo.items():
            if key not in SLO_KEYS and percentile_slo(key) is None:
                raise ValueError(f"unknown SLO {key!r}; use {', '.join(SLO_KEYS)} (goodput) or "
                                 f"{'|'.join(SLO_STATS)}_{'|'.join(SLO_METRICS)}_ms (--find-max), e.g. p99_ttft_ms")
            if not (value > 0 and math.isfinite(value)):  # the result file is strict JSON: no infinity
                raise ValueError(f"SLO {key} must be a positive number, got {value}")
        self._check_ramp_up()
        self._check_find_max()
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
        self._check_tracing()

    def _check_embeddings(self) -> None:
        if self.embed_batch_size < 1:
            raise ValueError(f"embed_batch_size must be at least 1, got {self.embed_batch_size}")
        if self.endpoint != "embeddings":
            if self.embed_batch_size > 1:
                raise ValueError("--random-batch-size batches the inputs of /v1/embeddings: add --endpoint embeddings")
            return
        if self.base_url is None:
            raise ValueError("--endpoint embeddings sends to a server: pass --base-url (infertrace serve answers "
                             "/v1/embeddings)")
        if self.dataset not in EMBEDDINGS_DATASETS:
            raise ValueError(f"--endpoint embeddings takes prompts of --dataset {', '.join(EMBEDDINGS_DATASETS)}, "
                             f"not {self.dataset}")
        for key in self.slo:
            metric = "ttft" if key == "ttft_ms" else "tpot" if key == "tpot_ms" else (percentile_slo(key) or (0, ""))[1]
            if metric in STREAMED_SLO_METRICS:
                raise ValueError(f"SLO {key}: an embeddings answer comes whole, so there is no {metric.upper()}; "
                                 "bound e2el_ms instead")

    def _check_lora(self) -> None:
        if not self.lora_modules:
            return
        for name, share in self.lora_modules.items():
            if not (isinstance(name, str) and LORA_NAME.fullmatch(name)):
                raise ValueError(f"--lora-modules: adapter name {name!r} must be letters, digits, '.', '_' or '-'")
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0 < share < math.inf):
                raise ValueError(f"--lora-modules: the share of {name} must be a positive number, got {share!r}")
        if self.base_url is None:
            raise ValueError("--lora-modules names adapters a server serves: pass --base-url (the bundled engine "
                             "serves no LoRA adapters)")

    def _check_structured(self) -> None:
        if self.structured is None:
            for flag, value, default in (("--schemas", self.schemas_path, None),
                                         ("--structured-share", self.structured_share, 1.0),
                                         ("--tool-choice", self.tool_choice, "required")):
                if value != default:
                    raise ValueError(f"{flag} needs --structured json-schema|tools")
            return
        if self.structured not in STRUCTURED_MODES:
            raise ValueError(f"structured must be one of {', '.join(STRUCTURED_MODES)}, got {self.structured!r}")
        if self.tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {self.tool_choice!r}")
        if not 0 < self.structured_share <= 1:
            raise ValueError(f"--structured-share must be in (0, 1], got {self.structured_share}")
        if self.base_url is None:
            raise ValueError("--structured constrains a server's output: pass --base-url (`infertrace serve` "
                             "honours json-schema; no server of ours serves tools)")
        if self.endpoint == "embeddings" or (self.structured == "tools" and self.endpoint != "chat"):
            raise ValueError(f"--structured {self.structured} needs --endpoint chat"
                             + (" or completions" if self.structured == "json-schema" else ""))
        for key in ("response_format", "tools", "tool_choice"):
            if key in self.extra_body:
                raise ValueError(f"--extra-body may not set {key!r} with --structured, which sets it")

    def _check_images(self) -> None:
        if not self.images:
            if self.image_dir is not None or tuple(self.image_size) != DEFAULT_IMAGE_SIZE:
                raise ValueError("--image-size and --image-dir need --random-mm-base-items-per-request N (--images)")
            return
        self.image_size = tuple(self.image_size)
        if self.images < 0:
            raise ValueError(f"--images must be at least 0, got {self.images}")
        if self.base_url is None:
            raise ValueError("images are not supported by the bundled engine: pass --base-url of a server that "
                             "serves a vision-language model")
        if self.endpoint != "chat" or self.dataset not in EMBEDDINGS_DATASETS:
            raise ValueError("--images needs --endpoint chat and --dataset random, shared-prefix, sharegpt or jsonl")

    def _check_tracing(self) -> None:
        self.otlp_receiver = tuple(self.otlp_receiver)
        if len({parse_receiver_url(u)[2] for u in self.otlp_receiver}) < len(self.otlp_receiver):
            raise ValueError("--otlp-receiver: each URL needs a port of its own")
        if self.otlp_receiver and self.find_max is not None:
            raise ValueError("--otlp-receiver joins the spans of one run or a sweep; use --peer-log with --find-max")
        if self.otlp_receiver and self.peer_log:
            raise ValueError("--otlp-receiver and --peer-log are two sources of the same spans: give one")
        for flag, value in (("--otlp-receiver", self.otlp_receiver), ("--peer-log", self.peer_log),
                            ("--otlp-traces-endpoint", self.otlp_traces_endpoint)):
            if value and self.base_url is None:
                raise ValueError(f"{flag} joins a server's own records or traces its requests; it needs --base-url")

    def _check_ramp_up(self) -> None:
        if self.ramp_up_strategy is None:
            for name in ("ramp_up_start_rps", "ramp_up_end_rps"):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name.replace('_', '-')} needs --ramp-up-strategy linear|exponential")
            return
        if self.ramp_up_strategy not in RAMP_UP_STRATEGIES:
            raise ValueError(f"ramp_up_strategy must be one of {', '.join(RAMP_UP_STRATEGIES)}, "
                             f"got {self.ramp_up_strategy!r}")
        if self.ramp_up_start_rps is None or self.ramp_up_end_rps is None:
            raise ValueError("--ramp-up-strategy needs both --ramp-up-start-rps and --ramp-up-end-rps")
        _finite_positive("ramp_up_start_rps", self.ramp_up_start_rps, " of requests per second")
        _finite_positive("ramp_up_end_rps", self.ramp_up_end_rps, " of requests per second")
        if self.ramp_up_start_rps > self.ramp_up_end_rps:
            raise ValueError(f"ramp-up goes up: --ramp-up-start-rps {self.ramp_up_start_rps:g} is above "
                             f"--ramp-up-end-rps {self.ramp_up_end_rps:g}")
        if self.request_rate is not None:
            raise ValueError("--ramp-up-strategy sets the request rate itself; drop --request-rate")
        if self.duration_s is not None:
            raise ValueError("a ramp runs over --num-prompts requests; it cannot be combined with --duration")

    def _check_find_max(self) -> None:
        percentiles = [k for k in self.slo if k not in SLO_KEYS]
        if self.find_max is None:
            if percentiles:
                raise ValueError(f"SLO {percentiles[0]} bounds a whole run and is used by --find-max; for "
                                 "goodput use ttft_ms, tpot_ms, e2el_ms")
            return
        if self.find_max not in FIND_MAX_PARAMS.values():
            raise ValueError(f"find_max must be one of {', '.join(FIND_MAX_PARAMS)}, got {self.find_max!r}")
        if not percentiles:
            raise ValueError("--find-max needs --slo with run-level bounds, e.g. --slo p99_ttft_ms=500,p99_tpot_ms=50")
        if self.sweep_param is not None:
            raise ValueError("--find-max chooses its own loads; it cannot be combined with --sweep")
        if self.profile:
            raise ValueError("--profile profiles one run; it cannot be combined with --find-max")
        if self.ramp_up_strategy is not None:
            raise ValueError("--find-max holds each load steady; it cannot be combined with --ramp-up-strategy")
        if self.find_max == "request_rate" and self.request_rate is not None:
            raise ValueError("--find-max request-rate chooses the request rate; drop --request-rate")
        if self.find_max == "concurrency" and self.request_rate is not None:
            raise ValueError("--find-max concurrency runs closed loops; drop --request-rate")
        _finite_positive("find_max_start", self.find_max_start)
        _finite_positive("find_max_limit", self.find_max_limit)
        if self.find_max == "concurrency" and not (self.find_max_start == int(self.find_max_start)
                                                   and self.find_max_limit == int(self.find_max_limit)):
            raise ValueError("--find-max concurrency needs whole numbers for --find-max-start and --find-max-limit")
        if self.find_max_start > self.find_max_limit:
            raise ValueError(f"--find-max-start {self.find_max_start:g} is above --find-max-limit "
                             f"{self.find_max_limit:g}")
        if self.find_max_points < 1:
            raise ValueError(f"find_max_points must be at least 1, got {self.find_max_points}")
        if self.find_max_repeats < 1:
            raise ValueError(f"find_max_repeats must be at least 1, got {self.find_max_repeats}")

    @property
    def open_loop(self) -> bool:
        """Requests go out on a schedule (a rate, a ramp, or a trace's own times), not when one ends."""
        return (self.request_rate is not None or self.ramp_up_strategy is not None
                or self.dataset in ("trace", "agent-trace"))

    @property
    def request_slo(self) -> dict[str, float]:
        """The per-request bounds (goodput)."""
        return {k: v for k, v in self.slo.items() if k in SLO_KEYS}

    @property
    def run_slo(self) -> dict[str, float]:
        """The run-level bounds (--find-max): p99_ttft_ms and the like."""
        return {k: v for k, v in self.slo.items() if k not in SLO_KEYS}

    def _check_trace_and_sessions(self) -> None:
        _finite_positive("time_scale", self.time_scale)
        _finite_positive("token_scale", self.token_scale)
        if self.dataset == "trace":
            if self.request_rate is not None:
                raise ValueError("trace replay sends each request at the trace's time (scale them with "
                                 "--time-scale); drop --request-rate")
            if self.duration_s is not None:
                raise ValueError("trace replay sends --num-prompts requests of the trace; drop --duration")
        if self.dataset == "agent-trace":
            for name, value in (("--request-rate", self.request_rate), ("--duration", self.duration_s),
                                ("--concurrency", self.concurrency), ("--ramp-up-strategy", self.ramp_up_strategy),
                                ("--sweep", self.sweep_param), ("--find-max", self.find_max)):
                if value is not None:
                    raise ValueError(f"agent-trace replay starts each session at its time in the trace (scale them "
                                     f"with --time-scale); drop {name}")
            if self.base_url is not None and self.endpoint != "chat":
                raise ValueError("--dataset agent-trace sends each model call with its history over chat: use "
                                 "--endpoint chat")
        for name in ("turns", "turn_input_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not (0 <= self.think_time_s < math.inf):
            raise ValueError(f"think_time must be a finite number of seconds >= 0, got {self.think_time_s}")
        if self.dataset == "conversation" and self.base_url is not None and self.endpoint != "chat":
            raise ValueError("--dataset conversation sends each turn with its history over chat: use --endpoint chat")
        if self.dataset == "conversation" and self.request_rate is not None and self.concurrency is not None:
            raise ValueError("with --request-rate, sessions start on their own schedule and run to their end: "
                             "drop --concurrency (or drop --request-rate for a closed loop of users)")

    @property
    def effective_warmup(self) -> int:
        """--warmup, else DEFAULT_WARMUP; trace replay warms up only when asked."""
        if self.warmup is not None:
            return self.warmup
        return 0 if self.dataset in ("trace", "agent-trace") else DEFAULT_WARMUP

    @property
    def effective_concurrency(self) -> int | None:
        """In-flight cap: the closed loop's workers, or the open loop's optional cap (None: no cap)."""
        return self.concurrency if self.open_loop else (self.concurrency or DEFAULT_CONCURRENCY)

    @property
    def max_in_flight(self) -> int | None:
        """The most requests the run can have in flight at once, over every point (None: no cap, an uncapped
        open loop); what the open-file limit must allow. The connection pool itself has no cap: the runner's slots
        are the only one, so a request never waits for a connection after its send time is taken."""
        if self.find_max == "concurrency":
            return int(self.find_max_limit)
        if self.find_max == "request_rate":  # every load an open loop, capped only by --concurrency
            return self.concurrency
        caps = [p.effective_concurrency for p in self.points()]
        return None if None in caps else max(caps)

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
        paths = {"--result-json": self.result_json, "--requests-jsonl": self.requests_jsonl, "--report": self.report}
        if self.sweep_param is not None or self.find_max is not None:
            paths["--plot"] = self.plot or (str(Path(self.result_json).with_suffix(".png")) if self.result_json
                                            else DEFAULT_SWEEP_PLOT if self.find_max is None
                                            else DEFAULT_CAPACITY_PLOT)
        return {flag: path for flag, path in paths.items() if path}

    def to_json(self) -> dict:
        """The config as the result file holds it; an infinite request rate is written "inf" (JSON has no
        infinity), and `from_json` reads it back."""
        d = config_fields.to_json(self)
        del d["headers"]  # how to reach the server, not what was measured; provenance names them, redacted
        d["warmup"] = self.effective_warmup  # what ran, so results of runs that differ only in spelling compare
        return d

    @classmethod
    def from_json(cls, data: dict) -> BenchConfig:
        """The config `to_json` wrote (with "headers" put back where they are wanted); ValueError as for flags."""
        return cls(**config_fields.from_json(cls, data))


def parse_receiver_url(url: str) -> tuple[str, str, int]:
    """--otlp-receiver's `grpc://HOST:PORT` or `http://HOST:PORT` (the path, if any, OTLP/HTTP's /v1/traces) ->
    (scheme, host, port); ValueError naming what is wrong."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("grpc", "http") or not parts.hostname or port is None \
            or parts.path not in ("", "/", "/v1/traces"):
        raise ValueError(f"--otlp-receiver {url!r}: expected grpc://HOST:PORT or http://HOST:PORT")
    return parts.scheme, parts.hostname, port


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


def percentile_slo(key: str) -> tuple[int, str] | None:
    """`p99_ttft_ms` -> (99, "ttft"); None for anything that is not STAT_METRIC_ms."""
    stat, _, rest = key.partition("_")
    metric, _, unit = rest.partition("_")
    if stat in SLO_STATS and metric in SLO_METRICS and unit == "ms":
        return SLO_STATS[stat], metric
    return None


def parse_image_size(text: str) -> tuple[int, int]:
    """`512x384` -> (512, 384): width and height in pixels."""
    w, sep, h = text.lower().partition("x")
    try:
        size = int(w), int(h)
    except ValueError:
        size = None
    if not sep or size is None or not all(1 <= v <= 8192 for v in size):
        raise ValueError(f"expected WIDTHxHEIGHT in pixels (1 to 8192 each), got {text!r}")
    return size


def parse_lora_modules(text: str) -> dict[str, float]:
    """`a=3,b=1,c` -> {"a": 3.0, "b": 1.0, "c": 1.0}: each adapter's share of the requests (relative; 1 when not
    given)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, share = (x.strip() for x in part.partition("="))
        if name in out:
            raise ValueError(f"adapter {name!r} is named twice")
        try:
            out[name] = float(share) if sep else 1.0
        except ValueError:
            raise ValueError(f"{name}={share!r}: expected NAME or NAME=SHARE (a number; the server, not bench, "
                             "takes the adapter's path)") from None
    if not out:
        raise ValueError("expected NAME[=SHARE],...")
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
