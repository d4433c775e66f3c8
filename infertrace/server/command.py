"""The `infertrace serve` command: the bundled engine behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import click

from infertrace.console import err_console, fail
from infertrace.engine.config import ENGINE_FLAGS
from infertrace.exits import FAILURE, INTERRUPTED
from infertrace.server.settings import ServerSettings

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerSettings) if f.default is not dataclasses.MISSING}
MODEL_FILES = ("config.json", "tokenizer.json")  # what the engine and the front end read first
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's; the engine checks its shards
_SERVER_FLAGS = {"model", "served-model-name", "host", "port", "max-queue", "profile-dir", "drain-timeout",
                 "api-server-count", "engine-in-process", "otlp-traces-endpoint"}


@click.command(
    "serve",
    epilog="The engine runs in a process of its own and the HTTP front end in this one (--api-server-count N: N "
           "front-end processes on one port). The options from --engine-opt on configure the engine; an option not "
           "given keeps the engine's default. Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /version, "
           "/server_info, /metrics, POST /start_profile, POST /stop_profile.",
)
@click.option("--model", "model_dir", required=True, callback=lambda ctx, param, value: _model_dir(ctx, value),
              help="Hugging Face model directory (config.json, safetensors, tokenizer), or a preset's name (tiny, "
                   "qwen3-0.6b, ...: written once into the cache folder, as `ablate --preset` does).")
@click.option("--served-model-name", default=None,
              help="Model name in the API; default: the --model argument as given (as vLLM does).")
@click.option("--host", default=_DEFAULTS["host"], show_default=True,
              help="Address to bind; pass 0.0.0.0 explicitly to listen on every interface.")
@click.option("--port", default=_DEFAULTS["port"], show_default=True, type=int,
              help="Port to bind; 0 picks a free one (the address is printed).")
@click.option("--max-queue", default=_DEFAULTS["max_queue"], show_default=True, type=int,
              help="Most accepted requests outside the running batch; past it requests get 503 with Retry-After.")
@click.option("--profile-dir", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="Enables POST /start_profile and /stop_profile; traces are written only under this directory. "
                   "Without it the profiler endpoints answer 404, as vLLM's do when not configured.")
@click.option("--drain-timeout", default=_DEFAULTS["drain_timeout_s"], show_default=True, type=float,
              help="On SIGTERM/SIGINT, seconds in-flight requests may finish before they are aborted "
                   "(a second signal aborts at once).")
@click.option("--api-server-count", default=1, show_default=True, type=click.IntRange(1, 64),
              help="HTTP front-end processes sharing the port (SO_REUSEPORT), each with its own link to the one "
                   "engine process: more when one front end's CPU is the limit.")
@click.option("--engine-in-process", is_flag=True,
              help="Run the engine on a thread of the HTTP process instead of a process of its own (the server "
                   "before the split; for A/B measurement).")
@click.option("--otlp-traces-endpoint", default=None, metavar="URL",
              help="Export each request's life as OpenTelemetry spans (vLLM's llm_request span with its tokenize, "
                   "queue, prefill-step and decode spans, under the client's W3C traceparent) to this OTLP "
                   "endpoint, as vLLM's flag does. OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc (the default, "
                   "host:port) or http/protobuf (the full URL, .../v1/traces). Off by default.")
def serve(model_dir: Path, served_model_name: str | None, host: str, port: int, max_queue: int,
          profile_dir: Path | None, drain_timeout: float, api_server_count: int, engine_in_process: bool,
          otlp_traces_endpoint: str | None, **engine_params) -> None:
    """Serve the bundled engine over an OpenAI-compatible HTTP API, with profiler endpoints."""
    from infertrace.engine.config import EngineConfig

    try:
        settings = ServerSettings(model_dir=str(model_dir), served_model_name=served_model_name or
                                  click.get_current_context().meta.get("model_as_given", str(model_dir)),
                                  host=host, port=port, max_queue=max_queue, drain_timeout_s=drain_timeout,
                                  profile_dir=profile_dir.resolve() if profile_dir else None,
                                  otlp_traces_endpoint=otlp_traces_endpoint)
        config = EngineConfig.from_overrides(ENGINE_FLAGS.values(engine_params))
        if settings.otlp_traces_endpoint is not None:
            from infertrace.server.frontend.tracing import check_available

            check_available()
    except ValueError as e:
        fail(str(e))
    if settings.profile_dir is not None:
        _prepare_profile_dir(settings.profile_dir)
    _check_model_dir(model_dir)
    _check_port(settings.host, settings.port)
    if engine_in_process:
        if api_server_count != 1:
            fail("--api-server-count needs the engine in its own process: drop --engine-in-process")
        _serve_in_process(settings, config)
    else:
        _serve(settings, config, api_server_count)


def _model_dir(ctx: click.Context, value: str) -> Path:
    """--model as a directory, or a preset made in the cache on first use; its name as given is the served name."""
    from infertrace.modelgen.cached import is_preset, preset_model_dir

    ctx.meta["model_as_given"] = value
    if is_preset(value):
        try:
            return preset_model_dir(value, lambda out: _say(f"building the {value} preset into {out} (first use "
                                                              "only)"))
        except OSError as e:
            raise click.BadParameter(f"cannot write the {value} preset: {e}") from None
    if not Path(value).is_dir():
        from infertrace.modelgen.presets import PRESETS

        # a preset's name inside what was typed ("qwen3-tiny") is closer than the most similar spelling (qwen3-8b)
        close = [name for name in PRESETS if name in value] or difflib.get_close_matches(value, list(PRESETS), n=1)
        hint = f"did you mean {max(close, key=len)!r}? " if close else ""
        raise click.BadParameter(f"{value!r} is neither a model directory nor a preset name ({hint}presets: "
                                 f"{', '.join(PRESETS)})")
    return Path(value)


def _check_model_dir(model_dir: Path) -> None:
    """A folder without the model's files is one line now, before anything starts, not a traceback from the
    tokenizer thread and the engine process."""
    missing = [name for name in MODEL_FILES if not (model_dir / name).is_file()]
    if not any(model_dir.glob("*.safetensors")) and not (model_dir / WEIGHTS_INDEX).is_file():
        missing.append("*.safetensors weights")
    if missing:
        fail(f"--model {model_dir} is not a model directory: it has no {' or '.join(missing)} (a Hugging Face "
             "model directory holds config.json, the safetensors weights and tokenizer.json)")


def _check_port(host: str, port: int) -> None:
    """A port another process listens on is reported now, not after the model has loaded (minutes, for a big
    one). The server binds it again later; this only catches what is already there."""
    from infertrace.server.engine_link.runner import check_port_free

    try:
        check_port_free(host, port)
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}", FAILURE)


def _prepare_profile_dir(profile_dir: Path) -> None:
    """Create --profile-dir and prove it writable now, not at the first capture."""
    from infertrace.output import check_writable_dir

    try:
        check_writable_dir(profile_dir, "traces to")
    except ValueError as e:
        fail(f"--profile-dir: {e}")


for _option in ENGINE_FLAGS.options(taken=_SERVER_FLAGS):
    serve.params.append(_option)


def _serve(settings: ServerSettings, config, api_servers: int) -> None:
    import asyncio

    from infertrace.server.engine_link.runner import EngineFailure, engine_spec, run_split

    _say(f"loading {settings.model_dir} in the engine process ...")
    described: dict = {}

    def ready(info: dict) -> None:
        described.update(info)

    def listening(url: str) -> None:
        front = f"{api_servers} front ends" if api_servers > 1 else "one front end"
        _say(f"serving {settings.served_model_name!r} on {url} (max context {described['max_model_len']}, "
             f"{described['kv_blocks_total']} KV blocks of {config.block_size} tokens; engine pid "
             f"{described['engine_pid']}, {front})")

    try:
        aborted = asyncio.run(run_split(settings, engine_spec(settings, config), api_servers, ready, listening,
                                        _draining(settings)))
    except EngineFailure as e:
        fail(str(e), e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C while the model loaded: the engine process is gone with it
        fail("interrupted while the model loaded", INTERRUPTED)
    except OSError as e:
        fail(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", FAILURE)
    _say(f"stopped ({aborted} request(s) aborted)")


def _serve_in_process(settings: ServerSettings, config) -> None:
    import asyncio

    from infertrace.engine import Engine
    from infertrace.engine.threads import cpu_threads
    from infertrace.server.engine_link.runner import run_in_process

    _say(f"loading {settings.model_dir} ...")
    try:
        engine = Engine(settings.model_dir, config)
    except (ValueError, OSError) as e:
        fail(f"cannot load the model: {e}")
    except KeyboardInterrupt:
        fail("interrupted while the model loaded", INTERRUPTED)
    if engine.runner.device.type == "cpu":
        cpu_threads()

    def listening(url: str) -> None:
        _say(f"serving {settings.served_model_name!r} on {url} (max context {engine.max_model_len}, "
             f"{engine.kv_blocks_total} KV blocks of {config.block_size} tokens; engine on a thread)")

    try:
        aborted = asyncio.run(run_in_process(engine, settings, dataclasses.asdict(config), listening,
                                            _draining(settings)))
    except OSError as e:
        fail(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", FAILURE)
    _say(f"stopped ({aborted} request(s) aborted)")


def _draining(settings: ServerSettings):
    def draining(in_flight: int) -> None:
        _say(f"shutting down: draining {in_flight} in-flight request(s) for up to {settings.drain_timeout_s:g}s")

    return draining


def _say(message: str) -> None:
    err_console.print(message, highlight=False, soft_wrap=True)
