"""The `infertrace serve` command: the bundled engine behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from infertrace.console import err_console, fail
from infertrace.server.engine_options import engine_config_options, engine_overrides
from infertrace.server.settings import ServerSettings

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerSettings) if f.default is not dataclasses.MISSING}
_SERVER_FLAGS = {"model", "served-model-name", "host", "port", "max-queue", "profile-dir", "drain-timeout"}


@click.command(
    "serve",
    epilog="The options from --engine-opt on configure the engine; an option not given keeps the engine's "
           "default. Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /version, "
           "/server_info, /metrics, POST /start_profile, POST /stop_profile.",
)
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Hugging Face model directory (config.json, safetensors, tokenizer).")
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
def serve(model_dir: Path, served_model_name: str | None, host: str, port: int, max_queue: int,
          profile_dir: Path | None, drain_timeout: float, **engine_params) -> None:
    """Serve the bundled engine over an OpenAI-compatible HTTP API, with profiler endpoints."""
    from infertrace.engine.config import EngineConfig

    try:
        settings = ServerSettings(model_dir=str(model_dir), served_model_name=served_model_name or str(model_dir),
                                  host=host, port=port, max_queue=max_queue, drain_timeout_s=drain_timeout,
                                  profile_dir=profile_dir.resolve() if profile_dir else None)
        config = EngineConfig.from_overrides(engine_overrides(engine_params))
    except ValueError as e:
        fail(str(e))
    if settings.profile_dir is not None:
        _prepare_profile_dir(settings.profile_dir)
    _serve(settings, config)


def _prepare_profile_dir(profile_dir: Path) -> None:
    """Create --profile-dir and prove it writable now, not at the first capture."""
    from infertrace.capture.torch_capture import check_writable

    try:
        check_writable(profile_dir)
    except ValueError as e:
        fail(f"--profile-dir: {e}")


for _option in engine_config_options(reserved=_SERVER_FLAGS):
    serve.params.append(_option)


def _serve(settings: ServerSettings, config) -> None:
    import asyncio

    from infertrace.engine import Engine
    from infertrace.server.runner import run_server

    _say(f"loading {settings.model_dir} ...")
    try:
        engine = Engine(settings.model_dir, config)
    except (ValueError, OSError) as e:
        raise click.ClickException(f"cannot load the model: {e}") from None

    def listening(url: str) -> None:
        _say(f"serving {settings.served_model_name!r} on {url} (max context {engine.max_model_len}, "
             f"{engine.kv_blocks_total} KV blocks of {config.block_size} tokens)")

    def draining(in_flight: int) -> None:
        _say(f"shutting down: draining {in_flight} in-flight request(s) for up to {settings.drain_timeout_s:g}s")

    try:
        aborted = asyncio.run(run_server(engine, settings, dataclasses.asdict(config), listening, draining))
    except OSError as e:
        raise click.ClickException(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None
    _say(f"stopped ({aborted} request(s) aborted)")


def _say(message: str) -> None:
    err_console.print(message, highlight=False, soft_wrap=True)
