"""The load worker in local processes (`--workers N`): a thin way of starting worker.run_slice, one spawned process
per slice, each on a pipe to the parent. Every worker starts at one barrier, set once every one of them is ready,
so a slow start-up costs no measured time."""

from __future__ import annotations

import asyncio
import time

import msgspec

from infertrace.load.run.worker import Batch, Slice, run_slice

START_LEAD_S = 0.05  # the start, once all are ready, is this far ahead (a pipe write to each)


def _process_main(conn, cfg_json: dict, part: Slice) -> None:
    """A local worker process: say it is ready, run the slice from the start the parent sends, stream batches
    down `conn`, stop when the parent says so."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which tells every worker

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        start = loop.create_future()

        def message() -> None:
            msg = conn.recv_bytes()
            if msg.startswith(b"start ") and not start.done():
                start.set_result(float(msg[6:]))
                return
            stop.set()  # "stop", even before the start: the worker then ends as soon as it begins
            if not start.done():
                start.set_result(time.time())

        def emit(batch: Batch) -> None:
            conn.send_bytes(msgspec.msgpack.encode(batch))

        async def wait_start() -> float:
            emit(Batch([], ready=True))
            return await start

        loop.add_reader(conn.fileno(), message)
        await run_slice(cfg_json, part, None, emit, stop, wait_start)

    asyncio.run(main())


async def run_local(fleet, parts: list[Slice]) -> None:
    """Every slice in a process of its own; each batch goes to `fleet.take` (a Fleet), the start barrier to
    `fleet.barrier`."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    cfg_json = fleet.worker_json()
    procs, conns = [], []
    for part in parts:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_process_main, args=(child, cfg_json, part), daemon=True,
                           name="infertrace-load")
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    loop = asyncio.get_running_loop()
    open_conns = set(range(len(conns)))
    waiting = set(open_conns)  # not ready yet
    finished = asyncio.Event()
    losses: list[asyncio.Future] = []
    decoder = msgspec.msgpack.Decoder(Batch)

    def start_when_ready(k: int) -> None:
        """The start barrier, once every worker still alive is ready (a worker that died waits for nothing)."""
        if k not in waiting:
            return
        waiting.discard(k)
        if not waiting:
            start_at = fleet.barrier(START_LEAD_S)
            for j in open_conns:
                try:
                    conns[j].send_bytes(b"start %r" % start_at)
                except OSError:
                    pass

    def close(k: int) -> None:
        loop.remove_reader(conns[k].fileno())
        open_conns.discard(k)
        start_when_ready(k)
        if not open_conns:
            finished.set()

    async def lost(k: int) -> None:
        """The pipe closed before the final batch: the process died (killed, or raised). What it never reported
        counts as failed, under its exit code or signal."""
        await asyncio.to_thread(procs[k].join, 10)
        fleet.lose(k, len(procs), parts[k], _how_it_ended(procs[k].exitcode), procs[k].pid)
        close(k)

    gone: set[int] = set()  # the pipe ended without a final batch: lost(k) is under way

    def give_up(k: int) -> None:
        gone.add(k)
        loop.remove_reader(conns[k].fileno())
        losses.append(asyncio.ensure_future(lost(k)))

    def readable(k: int) -> None:
        try:
            batch = decoder.decode(conns[k].recv_bytes())
        except (EOFError, OSError):
            give_up(k)
            return
        if batch.ready:
            start_when_ready(k)
            return
        fleet.take(batch, k)
        if batch.done:
            close(k)

    def exited(k: int) -> None:
        """The process ended. What it wrote is in the pipe: read it all; if no final batch came, it is lost, even
        when the pipe does not report its end (another process that holds a copy of the worker's end keeps it
        open: the parent would otherwise wait for ever)."""
        loop.remove_reader(procs[k].sentinel)
        while k in open_conns and k not in gone and conns[k].poll():
            readable(k)
        if k in open_conns and k not in gone:
            give_up(k)

    for k, conn in enumerate(conns):
        loop.add_reader(conn.fileno(), readable, k)
        loop.add_reader(procs[k].sentinel, exited, k)
    try:
        await finished.wait()
    except asyncio.CancelledError:  # Ctrl-C: every worker stops, sends what it measured, and the parent keeps it
        for k in list(open_conns):
            try:
                conns[k].send_bytes(b"stop")
            except OSError:
                pass
        deadline = time.monotonic() + 30
        while open_conns and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        raise
    finally:
        for k in list(open_conns):
            loop.remove_reader(conns[k].fileno())
        for proc in procs:
            loop.remove_reader(proc.sentinel)
        for task in losses:
            task.cancel()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        for conn in conns:
            conn.close()


def _how_it_ended(exitcode: int | None) -> str:
    import signal

    if exitcode is None:
        return "closed its pipe and did not exit"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
