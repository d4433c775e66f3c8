"""The `infertrace profile` command: toggle a live server's profiler, or run a command under nsys."""

from __future__ import annotations

import asyncio
import shlex
import time
from pathlib import Path

import click

from infertrace.auth import check_url, request_headers, server_auth_options
from infertrace.capture.peers import SERVER_ACTIVITIES, Flavour
from infertrace.capture.session import WHERE_UNKNOWN
from infertrace.console import err_console, fail, out_console
from infertrace.exits import BAD_INPUT, FAILURE

FLAVOURS = ("vllm", "sglang", "infertrace")
ACTIVITY_NAMES = ", ".join(SERVER_ACTIVITIES)


@click.command(name="profile")
@click.option("--url", "--base-url", "url", help="Base URL of the live server, e.g. http://127.0.0.1:8000 (--base-url "
              "is the same flag, as `bench` spells it).")
@click.option("--server", "flavour", type=click.Choice(FLAVOURS),
              help="Server flavour; detected from /server_info, /get_server_info or /version when omitted.")
@click.option("--start", "start", is_flag=True, help="Start the server's profiler.")
@click.option("--stop", "stop", is_flag=True, help="Stop the server's profiler and list the traces it wrote.")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True),
              help="Start, capture for S seconds, stop (any server flavour).")
@click.option("--nsys", is_flag=True,
              help="Run COMMAND (an infertrace subcommand or any program) under nsys with the cudaProfilerApi "
                   "capture range; with --url/--server, print the nsys line that launches that server.")
@click.option("--output-dir", help="Where traces go: sent to SGLang and infertrace (a relative path is made absolute "
                                   "only for a server on this host); for vLLM, which fixes it in --profiler-config, "
                                   "where to look for the files; the directory of the nsys report with --nsys.")
@click.option("--name", help="The capture's name, which every trace file name starts with (vLLM profile_prefix, "
                             "SGLang profile_id); default infertrace-YYYYmmdd-HHMMSS.")
@click.option("--num-steps", type=click.IntRange(min=1),
              help="Stop by itself after N engine steps (vLLM max_iterations, SGLang and infertrace num_steps).")
@click.option("--delay-steps", type=click.IntRange(min=0),
              help="vLLM: start capturing N engine steps after the start (delay_iterations).")
@click.option("--activities", help=f"Comma-separated activities among {ACTIVITY_NAMES} (server default "
                                   "when omitted).")
@click.option("--with-stack/--no-with-stack", default=None, help="Record Python stacks (server default when "
                                                                   "omitted).")
@click.option("--record-shapes/--no-record-shapes", default=None,
              help="Record operator input shapes (server default when omitted).")
@click.option("--frontend", is_flag=True, default=None,
              help="infertrace serve: also trace the HTTP front end's Python (frontend{i}-{pid}.trace.json).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds to wait for each server answer (a large trace can take minutes to flush).")
@server_auth_options
@click.option("--dry-run", is_flag=True, help="With --nsys: print the command line instead of running it.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def profile(ctx, url, flavour, start, stop, seconds, nsys, output_dir, name, num_steps, delay_steps, activities,
            with_stack, record_shapes, frontend, timeout, api_key, header, dry_run, command):
    """Start or stop profiler capture on a live server (vLLM, SGLang, infertrace), or run under nsys.

    \b
      infertrace profile --url http://127.0.0.1:8000 --start --num-steps 20
      infertrace profile --url http://127.0.0.1:8000 --stop
      infertrace profile --url http://127.0.0.1:8000 --seconds 5
      infertrace profile --nsys -- bench --concurrency 8 --profile
      infertrace profile --nsys --server vllm -- vllm serve Qwen/Qwen3-0.6B --profiler-config '{"profiler": "cuda"}'
    """
    chosen = [name for name, on in (("--start", start), ("--stop", stop), ("--seconds", seconds is not None),
                                     ("--nsys", nsys)) if on]
    if len(chosen) != 1:
        raise click.UsageError("choose exactly one of --start, --stop, --seconds S or --nsys")
    if command and not nsys:
        raise click.UsageError(f"unexpected argument {command[0]!r} (a COMMAND is only taken with --nsys)")
    if dry_run and not nsys:
        raise click.UsageError("--dry-run only goes with --nsys")
    if nsys:
        _nsys(ctx, url, flavour, output_dir, timeout, dry_run, list(command))
        return
    if not url:
        raise click.UsageError(f"{chosen[0]} needs --url")
    try:
        check_url(url, "--url")
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if seconds is not None and num_steps is not None:
        raise click.UsageError("give either --seconds or --num-steps, not both")
    given = [flag for flag, value in (("--output-dir", output_dir), ("--name", name), ("--num-steps", num_steps),
                                      ("--delay-steps", delay_steps), ("--activities", activities),
                                      ("--with-stack", with_stack), ("--record-shapes", record_shapes),
                                      ("--frontend", frontend))
             if value is not None]
    if stop and given:
        raise click.UsageError(f"{given[0]} applies when a capture starts, not to --stop")
    from infertrace.capture.peers import ProfileOptions, default_capture_name

    try:
        options = ProfileOptions(name=name or default_capture_name(), output_dir=output_dir, num_steps=num_steps,
                                 delay_steps=delay_steps, activities=_parse_activities(activities),
                                 with_stack=with_stack, record_shapes=record_shapes, frontend=frontend)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    headers = request_headers(api_key, header)
    if stop:
        _run(_stop(url, flavour, timeout, headers))
    else:
        _run(_start(url, flavour, timeout, headers, options, seconds))


def _say(text: str) -> None:
    """Chatter to stderr, printed as is (server messages may hold brackets such as step[DECODE bs=8])."""
    err_console.print(text, highlight=False, markup=False, soft_wrap=True)


def _emit(text: str) -> None:
    """One line of data to stdout."""
    out_console.print(text, highlight=False, markup=False, soft_wrap=True)


def _parse_activities(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(a.strip().upper() for a in text.split(",") if a.strip())
    if not names:
        raise ValueError(f"--activities is empty; choose from {ACTIVITY_NAMES}")
    return names


def _run(coro):
    from infertrace.capture.client import ProfilerError, UnreachableError

    try:
        return asyncio.run(coro)
    except UnreachableError as exc:
        fail(str(exc), BAD_INPUT)
    except ProfilerError as exc:
        fail(str(exc), FAILURE)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


async def _start(url, flavour, timeout, headers, options, seconds):
    from infertrace.capture.client import ProfilerClient
    from infertrace.capture.session import ServerCapture

    async with ProfilerClient(url, flavour, timeout, headers) as client:
        kind = await client.flavour()
        started = await client.start(options)
        for note in started.notes:
            _say(f"note: {note}")
        sent_name = _sent_name(kind, started.body)
        capture = ServerCapture.begin(url, kind, sent_name, started.options.output_dir, client.local,
                                      started.options.num_steps if started.body else None, started.body)
        _say(f"{kind.value} profiler started at {url}: {started.message}")
        _say(f"capture {sent_name or '(unnamed)'} writes to {capture.where()}")
        if capture.num_steps is not None:
            _say(f"it stops by itself after {capture.num_steps} steps")
        if seconds is None:
            capture.save()
            return
        try:
            await asyncio.sleep(seconds)
        finally:
            # also on Ctrl-C: leave no capture running on the server
            await _report_stop(client, url, capture)


async def _stop(url, flavour, timeout, headers):
    from infertrace.capture.client import ProfilerClient
    from infertrace.capture.session import ServerCapture

    capture = ServerCapture.load(url)
    async with ProfilerClient(url, flavour or (capture.flavour if capture else None), timeout, headers) as client:
        await _report_stop(client, url, capture)


async def _report_stop(client, url, capture):
    result = await client.stop(self_stopping=bool(capture and capture.num_steps))
    kind = (await client.flavour()).value
    _say(f"{kind} profiler stopped at {url}: {result.message}")
    files = list(result.files)
    if capture is not None:
        capture.stopped_at = time.time()
        if not files:
            files = capture.written(wait_s=min(client.timeout_s, 10.0))
        capture.files = files
        # beside the traces whoever listed them (the server, or a look in its folder), when they are on this host
        if capture.local and (manifest := capture.write_manifest()) is not None:
            _say(f"manifest: {manifest}")
        capture.forget()
        if not files:
            _say(f"{kind} writes its traces on the server host, into {capture.where()}")
    elif not files:
        _say(f"{kind} writes its traces on the server host, into {WHERE_UNKNOWN[Flavour(kind)]}")
    for trace in files:
        _emit(trace)


def _sent_name(kind, body: dict | None) -> str | None:
    """The name the server will put into its file names, as it was really sent."""
    if not body:
        return None
    return body.get("profile_prefix") or body.get("profile_id")


def _nsys(ctx, url, flavour, output_dir, timeout, dry_run, command):
    from infertrace.capture import nsys as nsys_mod

    nsys_path = nsys_mod.find_nsys()
    out = Path(output_dir or ".") / "infertrace.%p"
    if url or flavour:
        if not flavour:
            from infertrace.capture.client import ProfilerClient

            async def detect():
                async with ProfilerClient(url, None, timeout) as client:
                    return (await client.flavour()).value

            flavour = _run(detect())
        _emit(nsys_mod.server_nsys_line(flavour, out, command or None, nsys_path or "nsys"))
        _say(f"then open the capture range with: {nsys_mod.SERVER_START_HINT[flavour]}")
        if nsys_path is None:
            _say("nsys is not installed on this machine: run that line where Nsight Systems is")
        return
    if not command:
        raise click.UsageError("--nsys needs a COMMAND to run, e.g. `infertrace profile --nsys -- bench --profile`")
    group = ctx.parent.command if ctx.parent else None
    if isinstance(group, click.Group) and command[0] in group.list_commands(ctx.parent):
        command = nsys_mod.infertrace_argv(command)
    if dry_run:
        line = nsys_mod.nsys_profile_command(out, command, nsys_path or "nsys")
        _emit(f"{nsys_mod.NSYS_OUTPUT_ENV}={shlex.quote(str(out))} {shlex.join(line)}")
        if nsys_path is None:
            _say("nsys is not installed on this machine")
        return
    from infertrace.output import OutputError, check_writable_dir

    try:
        nsys_path = nsys_mod.require_nsys()
        check_writable_dir(out.parent, "traces to")
    except nsys_mod.NsysNotFoundError as exc:
        fail(str(exc), FAILURE)
    except OutputError as exc:
        fail(str(exc), BAD_INPUT)
    rc, reports = nsys_mod.run_under_nsys(command, out, nsys_path)
    for report in reports:
        _emit(str(report))
    if rc != 0:
        raise SystemExit(rc)
    if not reports:
        fail("nsys wrote no report: the command never called cudaProfilerStart (give it a capture window, e.g. "
             "bench --profile)", FAILURE)
