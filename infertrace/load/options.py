"""Every flag of `infertrace bench`, and the BenchConfig they make (the command itself is infertrace/load/command.py)."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction

import click

from infertrace.auth import request_headers, server_auth_options
from infertrace.engine.config import ENGINE_FLAGS
from infertrace.load.config import (
    DATASETS,
    DEFAULT_CONCURRENCY,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_WARMUP,
    ENDPOINTS,
    FIND_MAX_PARAMS,
    RAMP_UP_STRATEGIES,
    SERVER_METRICS_MODES,
    STRUCTURED_MODES,
    TOOL_CHOICES,
    BenchConfig,
    parse_image_size,
    parse_lora_modules,
    parse_slo,
    parse_sweep,
)
from infertrace.load.run.worker import resolve_workers
from infertrace.modelgen.presets import PRESETS

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BenchConfig)}
# the bundled engine's settings, as `serve` has them, where bench runs it in-process (a flag bench has itself, such
# as --seed, stays bench's: the engine's is then reached with --engine-opt)
EMBEDDED_ENGINE_FLAGS = dataclasses.replace(ENGINE_FLAGS, help_prefix="(embedded engine) ")


def _d(name: str) -> str:
    return f"[default: {_DEFAULTS[name]}]"


def _parsed(parse):
    def callback(ctx, param, value):
        if value is None:
            return None
        try:
            return parse(value)
        except (ValueError, TypeError) as e:
            raise click.BadParameter(str(e)) from None
    return callback


def _fraction(text: str) -> float:
    """`1/32` or `0.03125` -> 0.03125."""
    try:
        return float(Fraction(text.strip()))
    except ZeroDivisionError:
        raise ValueError(f"{text!r} divides by zero") from None


def _json_object(text: str) -> dict:
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise TypeError("expected a JSON object")
    return obj


_OPTIONS = (  # in the order --help lists them
    click.option("--base-url", "--url", "base_url", metavar="URL", help="An OpenAI-compatible server, e.g. "
                  "http://127.0.0.1:8000 (--url is the same flag, as `profile` spells it). Without it the bundled "
                  "engine runs in-process."),
    click.option("--endpoint", type=click.Choice(ENDPOINTS),
                  help="Which API to load: /v1/completions or /v1/chat/completions (streamed), or /v1/embeddings "
                  f"(one answer a request: E2EL, no TTFT/TPOT/ITL). {_d('endpoint')}"),
    click.option("--random-batch-size", "--embed-batch-size", "embed_batch_size", type=int, metavar="N",
                  help="Embeddings: inputs each request carries, as `vllm bench serve --random-batch-size` batches "
                  f"them (--num-prompts still counts requests). {_d('embed_batch_size')}"),
    click.option("--lora-modules", callback=_parsed(parse_lora_modules), metavar="NAME[=SHARE],...",
                  help="Send each request to one of these LoRA adapters (its name as the request's model), drawn by "
                  "the shares (default 1 each) from --seed and the request's index; the result gets per_adapter "
                  "figures. The server must serve them (vLLM: --enable-lora --lora-modules NAME=DIR)."),
    click.option("--structured", type=click.Choice(STRUCTURED_MODES),
                  help="Constrain the output: json-schema sends response_format {type: json_schema}; tools sends "
                  "one tool (its parameters the schema) with --tool-choice. The result counts the outputs that "
                  "parse and hold to their schema, and TTFT/ITL of constrained against unconstrained requests."),
    click.option("--schemas", "schemas_path", type=click.Path(dir_okay=False), help="With --structured: a JSONL "
                  "file of JSON schemas, one per line, cycled over the requests [default: generated object "
                  "schemas of booleans and string enums]."),
    click.option("--structured-share", type=float, help="With --structured: the share of requests constrained, "
                  f"drawn from --seed; the rest run unconstrained beside them, for comparison. "
                  f"{_d('structured_share')}"),
    click.option("--tool-choice", type=click.Choice(TOOL_CHOICES), help="With --structured tools: tool_choice "
                  f"\"required\", or the offered function named. {_d('tool_choice')}"),
    click.option("--random-mm-base-items-per-request", "--images", "images", type=int, metavar="N",
                  help="Chat: images each request carries, as `image_url` parts with base64 data URLs before its "
                  "text (vLLM's random-mm option name); the result counts the image tokens the server reports. "
                  f"{_d('images')}"),
    click.option("--image-size", callback=_parsed(parse_image_size), metavar="WxH",
                  help="With --images: generated random-pixel JPEGs of this size, as vLLM's random-mm makes them "
                  f"[default: {'x'.join(map(str, _DEFAULTS['image_size']))}]."),
    click.option("--image-dir", type=click.Path(file_okay=False), help="With --images: send the image files of "
                  "this folder (JPEG, PNG, GIF, WEBP, BMP; cycled over the requests) instead of generated ones."),
    click.option("--model", metavar="NAME|DIR", help="Server: the model name to send (default: the first one the "
                  "server lists), or its local directory, which then also gives the tokenizer. Embedded: a model "
                  f"directory or a preset ({', '.join(PRESETS)}; default: tiny), made on first use under "
                  "$INFERTRACE_CACHE or ~/.cache/infertrace."),
    click.option("--served-model-name", metavar="NAME", help="Server: the model name to send when it differs "
                  "from --model."),
    click.option("--tokenizer", metavar="DIR", help="A local tokenizer directory, for prompts of exact token "
                  "length and for counting output tokens a server does not report (default: --model when it is a "
                  "directory)."),
    click.option("--dataset", type=click.Choice(DATASETS),
                  help="random: prompts of exact token length; shared-prefix: --num-prefixes prefixes of "
                  "--prefix-len tokens shared by the requests; sharegpt: a ShareGPT-format JSON file; jsonl: one "
                  f"{{\"prompt\": ..., \"max_tokens\": ...}} per line; trace: replay a Mooncake JSONL, Azure or "
                  "BurstGPT CSV trace at its times; conversation: multi-turn sessions over chat (a ShareGPT file, "
                  "else synthetic); agent-trace: replay an agent's OpenTelemetry GenAI spans (OTLP JSON), each "
                  f"trace and subagent a chat session at its times. {_d('dataset')}"),
    click.option("--dataset-path", type=click.Path(dir_okay=False), help="The file for --dataset "
                  "sharegpt/jsonl/trace/agent-trace (and conversation, optional)."),
    click.option("--time-scale", type=float, help="Trace, agent-trace: multiply every timestamp by this (0.5 "
                  f"replays twice as fast). {_d('time_scale')}"),
    click.option("--token-scale", callback=_parsed(_fraction), metavar="F", help="Trace, agent-trace: multiply "
                  "input and output lengths and the 512-token hash block by F, e.g. 1/32 for 16-token blocks. "
                  f"{_d('token_scale')}"),
    click.option("--turns", type=int, help=f"Conversation without a file: turns of each session. {_d('turns')}"),
    click.option("--turn-input-len", type=int, help="Conversation without a file: tokens of each user message. "
                  f"{_d('turn_input_len')}"),
    click.option("--think-time", "think_time_s", type=float, metavar="SECONDS", help="Conversation: pause between a "
                  f"reply and the user's next turn. {_d('think_time_s')}"),
    click.option("--input-len", type=int, help=f"Prompt tokens of random prompts (the part after the prefix for "
                  f"shared-prefix). {_d('input_len')}"),
    click.option("--output-len", type=int, help=f"max_tokens of each request [default: {DEFAULT_OUTPUT_LEN}, or "
                  "the reply length in a ShareGPT file, or max_tokens in a JSONL line]."),
    click.option("--range-ratio", type=float, help="Random lengths are uniform integers in [L*(1-r), L*(1+r)] for "
                  f"L = --input-len and --output-len; 0 gives exact lengths. {_d('range_ratio')}"),
    click.option("--prefix-len", type=int, help=f"Tokens of each shared prefix. {_d('prefix_len')}"),
    click.option("--num-prefixes", type=int, help=f"How many distinct shared prefixes. {_d('num_prefixes')}"),
    click.option("--seed", type=int, help=f"Seed of prompts, lengths and arrivals: the same seed sends the same "
                  f"bytes. {_d('seed')}"),
    click.option("--num-prompts", type=int, help="Requests to measure; with --duration, how many distinct prompts "
                  f"are cycled. {_d('num_prompts')}"),
    click.option("--duration", "duration_s", type=float, metavar="SECONDS",
                  help="Send for this long instead of a fixed number of requests."),
    click.option("--concurrency", type=int, help="Closed loop: requests in flight [default: "
                  f"{DEFAULT_CONCURRENCY}]. With --request-rate: a cap on requests in flight (default: none)."),
    click.option("--request-rate", type=float, help="Open loop: requests per second, arrivals drawn up front "
                  "(inf sends them all at once)."),
    click.option("--burstiness", type=float, help="Open loop: shape of the gamma-distributed gaps; 1 is Poisson, "
                  f"lower is burstier. {_d('burstiness')}"),
    click.option("--ramp-up-strategy", type=click.Choice(RAMP_UP_STRATEGIES),
                  help="Open loop whose rate ramps over the --num-prompts requests, as vllm bench serve does: request i "
                  "is due at the rate for progress i/(N-1), linear or by a constant ratio (exponential); replaces "
                  "--request-rate."),
    click.option("--ramp-up-start-rps", type=float, help="With --ramp-up-strategy: the rate of the first request."),
    click.option("--ramp-up-end-rps", type=float, help="With --ramp-up-strategy: the rate of the last request."),
    click.option("--warmup", type=int, help="Requests sent before measuring, excluded from the figures [default: "
                  f"{DEFAULT_WARMUP}; none for trace replay, whose warmup, when asked, shares no block with the trace]."),
    click.option("--sweep", "sweep", callback=_parsed(parse_sweep), metavar="PARAM=V1,V2,...",
                  help="Run once per value, e.g. concurrency=1,2,4,8 or request-rate=1,2,4; prints one table and "
                  "writes a PNG plot."),
    click.option("--slo", callback=_parsed(parse_slo), metavar="ttft_ms=..,tpot_ms=..,e2el_ms=..",
                  help="Service-level objectives. ttft_ms, tpot_ms, e2el_ms bound each request, for goodput: requests "
                  "per second meeting every bound (failed requests count as misses). median_, p90_, p95_ or p99_ "
                  "before ttft_ms, tpot_ms, itl_ms, e2el_ms bounds a whole run, for --find-max."),
    click.option("--find-max", type=click.Choice(list(FIND_MAX_PARAMS)), callback=lambda c, p, v: FIND_MAX_PARAMS.get(v),
                  help="Search the highest concurrency (closed loop) or request rate meeting every run-level --slo "
                  "bound: doubling from --find-max-start, then bisecting; prints every load tried and writes a PNG."),
    click.option("--find-max-start", type=float, help=f"The first load tried. {_d('find_max_start')}"),
    click.option("--find-max-limit", type=float, help=f"The highest load tried. {_d('find_max_limit')}"),
    click.option("--find-max-points", type=int, help=f"The most loads tried. {_d('find_max_points')}"),
    click.option("--find-max-repeats", type=int, help="The most runs at one load whose bootstrap interval "
                  f"straddles a bound. {_d('find_max_repeats')}"),
    click.option("--ignore-eos", is_flag=True, default=None, help="Ask the target to generate max_tokens even past "
                  "end-of-sequence."),
    click.option("--temperature", type=float, help=f"Sampling temperature sent with each request. "
                  f"{_d('temperature')}"),
    click.option("--continuous-usage/--no-continuous-usage", default=None,
                  help="Ask the server for usage on every chunk (stream_options.continuous_usage_stats), which "
                  "gives per-token ITL; turn off for servers that reject it. [default: on]"),
    click.option("--server-metrics", type=click.Choice(SERVER_METRICS_MODES),
                  help="vLLM's per-request metrics (queue time, TTFT from scheduling) read from each response and "
                  "joined to --requests-jsonl: auto asks a server that identifies as vLLM for them, on asks any "
                  "server, off neither asks nor reads them. The server needs --enable-per-request-metrics. "
                  f"{_d('server_metrics')}"),
    click.option("--extra-body", callback=_parsed(_json_object), metavar="JSON",
                  help="JSON object merged into every request body."),
    click.option("--request-timeout", "request_timeout_s", type=float, metavar="SECONDS",
                  help=f"A request still streaming after this long fails as a timeout. {_d('request_timeout_s')}"),
    click.option("--profile", is_flag=True, default=None, help="Start the server's profiler after warmup "
                  "(POST /start_profile) and stop it after the measured requests (POST /stop_profile); the trace "
                  "files go into the result."),
    click.option("--profile-steps", type=int, help="With --profile: the server stops capturing after this many "
                  "engine steps."),
    click.option("--profile-seconds", type=float, help="With --profile: send load for this many seconds, then stop "
                  "the profiler once the requests in flight are done."),
    click.option("--result-json", type=click.Path(dir_okay=False), help="Write the result (vLLM's key names, "
                  "config, provenance) to this file."),
    click.option("--requests-jsonl", type=click.Path(dir_okay=False), help="Write every request's timings and "
                  "failure reason, one JSON object per line."),
    click.option("--plot", type=click.Path(dir_okay=False), help="Sweep plot PNG path [default: --result-json "
                  "with .png, else bench-sweep.png]."),
    click.option("--workers", callback=_parsed(lambda v: resolve_workers(v)), metavar="N|auto",
                  help="Load generator processes on this host (per node with --ray); auto: the cores less one. The "
                       "schedule is made once and split between them; their records are merged. [default: 1]"),
    click.option("--ray", "ray_address", metavar="ADDRESS",
                  help="Place the load workers as Ray actors on the cluster at ADDRESS (auto: the one `ray start` "
                       "made), --workers per node; needs the [distributed] extra."),
    click.option("--report", type=click.Path(dir_okay=False), help="Write one self-contained HTML report of the run: "
                  "client latencies, the server's metrics and GPU telemetry on one time axis, the profiled window's "
                  "phases and what the run shows (docs/report.md)."),
    click.option("--scrape-interval", "scrape_interval_s", type=float, help="Seconds between scrapes of the server's "
                  f"Prometheus /metrics during the run; 0 turns scraping off. {_d('scrape_interval_s')}"),
    click.option("--metrics-url", metavar="URL", help="Where the server's Prometheus metrics live [default: the base "
                  "URL's /metrics]."),
    click.option("--prompt-salt", metavar="TEXT|random", help="Put this line before every prompt (random: a new "
                  "one each run), so that no prompt of an earlier run is in the server's prefix cache while the "
                  "run's own shared prefixes still are. Repeated runs against one server then compare."),
    click.option("--reset-prefix-cache", is_flag=True, default=None, help="Empty the server's prefix cache before "
                  "the run: POST /reset_prefix_cache (vLLM, with VLLM_SERVER_DEV_MODE=1), else /flush_cache "
                  "(SGLang); the run stops with one line when the server offers neither."),
    click.option("--otlp-receiver", "otlp_receiver", multiple=True, metavar="grpc://HOST:PORT|http://HOST:PORT",
                  help="Receive the server's OTLP spans here while the run goes on (point vLLM's "
                  "--otlp-traces-endpoint at it) and join its llm_request spans to the requests: queue, prefill and "
                  "TTFT parts in --requests-jsonl and the result. Repeatable (one of each protocol)."),
    click.option("--peer-log", type=click.Path(dir_okay=False), metavar="PATH",
                  help="After the run, join the server's own per-request records from this file: vLLM's spans as "
                  "OTLP JSON (a collector's file exporter) or SGLang's log (--enable-request-time-stats-logging)."),
    click.option("--otlp-traces-endpoint", metavar="URL", help="After the run, export bench's span of each request "
                  "(the traceparent it sent) to this OTLP endpoint; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc "
                  "(default) or http/protobuf, as for vLLM."),
    server_auth_options,
)


def bench_options(command):
    """Every flag of `infertrace bench` on `command`, as keyword arguments (their defaults live in BenchConfig)."""
    for option in reversed(_OPTIONS):
        command = option(command)
    taken = {flag for param in command.__click_params__ for flag in (*param.opts, *param.secondary_opts)}
    command.__click_params__[:0] = reversed(EMBEDDED_ENGINE_FLAGS.options(taken))  # listed after bench's own
    return command


def bench_config(options: dict) -> BenchConfig:
    """The run's config from the flags given (a flag not given takes BenchConfig's default); ValueError names
    what is wrong."""
    engine = EMBEDDED_ENGINE_FLAGS.values(options)
    options = EMBEDDED_ENGINE_FLAGS.own(options)
    if engine:
        options["engine_overrides"] = engine
    if headers := request_headers(options.pop("api_key"), options.pop("header")):
        options["headers"] = headers
    sweep = options.pop("sweep")
    if sweep is not None:
        options["sweep_param"], options["sweep_values"] = sweep
    given = {k: v for k, v in options.items() if v is not None}
    if given.get("dataset") in ("conversation", "agent-trace"):
        given.setdefault("endpoint", "chat")  # every turn goes with its history; completions has no messages
    return BenchConfig(**given)
