"""The runner's ownership of the other front-end processes: every exit heard, nothing waited for that is gone."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time


def _child(target, *args) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


async def test_every_front_end_exit_is_heard_with_its_code_not_only_the_first():
    from infertrace.server.engine_link.runner import _watch_frontends

    failed, sleeper = _child(os._exit, 3), _child(time.sleep, 600)
    heard: list[tuple[str, int | None]] = []
    first = asyncio.Event()

    def exited(why: str, code: int | None) -> None:
        heard.append((why, code))
        first.set()

    watch = asyncio.ensure_future(_watch_frontends([failed, sleeper], exited))
    try:
        await asyncio.wait_for(first.wait(), timeout=120)
        assert heard == [(f"front end {failed.name} (pid {failed.pid}) exited with code 3", 3)]
        sleeper.kill()  # a front end killed while the server drains must not go unheard
        await asyncio.wait_for(watch, timeout=120)
    finally:
        sleeper.kill()
    assert heard[1] == (f"front end {sleeper.name} (pid {sleeper.pid}) was killed by SIGKILL", -signal.SIGKILL)


async def test_stopping_front_ends_that_are_already_gone_does_not_wait_out_the_drain_time():
    from infertrace.server.engine_link.runner import _stop_children

    gone = _child(os._exit, 1)
    await asyncio.to_thread(gone.join, 120)
    assert gone.exitcode == 1
    # the drain time plus 10 s was slept out on an empty wait after a front end had died
    await asyncio.wait_for(_stop_children([gone], grace_s=3600, signal_them=True), timeout=60)


def test_the_other_front_ends_drains_are_counted_from_their_pipes():
    from infertrace.server.engine_link.runner import _aborted_by

    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(3)]
    (r0, w0), (r1, w1), (r2, w2) = pipes
    w0.send("listening"), w0.send(("aborted", 4)), w0.close()
    w1.send("listening"), w1.close()  # killed before it could tell
    w2.send("listening"), w2.send(("aborted", 2))
    assert _aborted_by([r0, r1, r2]) == 6
