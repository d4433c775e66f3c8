"""The load worker as Ray actors, `--workers` of them on every node of the cluster: a thin way of starting
worker.run_slice, holding no logic of its own.

Each actor's clock is read against the driver's a few times before the start (the offset of the round trip with
the least delay is kept and reported), so that every actor starts at the same instant on its own clock; after
that each actor times its own requests, and no two hosts' clocks are compared. The start is set once every actor
is ready (its target built and open: images encoded, a schema file read), so a slow set-up costs no measured time.
"""

from __future__ import annotations

import asyncio
import socket
import time

import msgspec

from infertrace.load.client.timing import TargetError
from infertrace.load.run.worker import Batch, Slice, run_slice

CLOCK_PROBES = 5
POLL_S = 0.2
START_LEAD_S = 0.25  # the start, once all are ready, is this far ahead (one actor call to each)


CONNECT_TIMEOUT_S = 5.0  # a cluster's GCS port that does not accept in this long is not there (Ray itself waits
# minutes, silently)


def _ray():
    try:
        import ray
    except ImportError:
        raise TargetError("--ray needs Ray: pip install -e '.[distributed]'") from None
    return ray


def connect(address: str):
    """The Ray module, joined to the cluster at `address` (`auto`: the one `ray start` made); a process that
    already called ray.init keeps its cluster. TargetError, in a few seconds, when the cluster cannot be joined."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    if address.startswith("ray://"):
        try:
            import ray.util.client.worker  # noqa: F401 - Ray Client's half, which needs grpcio
        except ImportError:
            raise TargetError(f"--ray {address}: a ray:// address connects through Ray Client, which this Ray lacks "
                              "(pip install 'ray[client]'); or run bench on a node of the cluster with --ray auto or "
                              "--ray HOST:6379") from None
    else:
        check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TargetError(f"--ray {address}: cannot join the Ray cluster: {first}") from None
    return ray


def check_reachable(address: str) -> None:
    """For a HOST:PORT address: TargetError unless something accepts a connection there within
    CONNECT_TIMEOUT_S."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return  # `auto`, `local`: Ray finds its own
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise TargetError(f"--ray {address}: cannot reach a Ray cluster there ({why} within "
                          f"{CONNECT_TIMEOUT_S:g} s); start one with `ray start --head` or pass --ray auto") from None


def node_ids(address: str) -> list[str]:
    ray = connect(address)
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


class LoadActor:
    """One load worker on a Ray node (made a Ray actor class by `_actor_class`)."""

    def __init__(self) -> None:
        self.batches: list[bytes] = []
        self.ready = False  # set up and waiting for the start
        self._stop: asyncio.Event | None = None
        self._start: asyncio.Future | None = None  # the start, on this actor's clock

    def _signals(self) -> tuple[asyncio.Event, asyncio.Future]:
        """The stop and the start, made by whichever call comes first: Ray may run a halt before the run."""
        if self._stop is None:
            self._stop, self._start = asyncio.Event(), asyncio.get_running_loop().create_future()
        return self._stop, self._start

    def clock(self) -> float:
        return time.time()

    async def run(self, cfg_json: dict, part: Slice) -> None:
        stop, start = self._signals()

        async def wait_start() -> float:
            self.ready = True
            return await start

        await run_slice(cfg_json, part, None, lambda b: self.batches.append(msgspec.msgpack.encode(b)), stop,
                        wait_start)

    async def is_ready(self) -> bool:
        return self.ready

    async def begin(self, start_at: float) -> None:
        _, start = self._signals()
        if not start.done():
            start.set_result(start_at)

    def drain(self) -> list[bytes]:
        out, self.batches = self.batches, []
        return out

    async def halt(self) -> None:
        """Stop, even before the start: the actor then ends as soon as it begins."""
        self._signals()[0].set()
        await self.begin(time.time())


_ACTOR = None


def _actor_class():
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _ray().remote(num_cpus=1)(LoadActor)
    return _ACTOR


async def run_on_ray(fleet, parts: list[Slice]) -> None:
    """Every slice on an actor of its own; each batch goes to `fleet.take` (a Fleet), the start barrier, once every
    actor is ready, to `fleet.barrier`."""
    ray = connect(fleet.ray_address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = node_ids(fleet.ray_address)
    actors = [_actor_class().options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        nodes[k % len(nodes)], soft=False)).remote() for k in range(len(parts))]
    offsets = [await asyncio.to_thread(_clock_offset, ray, actor) for actor in actors]
    fleet.clock_offsets_s = offsets
    cfg_json = fleet.worker_json()
    runs = [actor.run.remote(cfg_json, part) for actor, part in zip(actors, parts)]
    decoder = msgspec.msgpack.Decoder(Batch)
    started = False

    lost: set[int] = set()

    async def collect() -> None:
        for k, actor in enumerate(actors):
            if k in lost:
                continue
            try:
                blobs = await actor.drain.remote()
            except Exception:  # the actor died: its run's reference says how, below
                continue
            for blob in blobs:
                fleet.take(decoder.decode(blob), k)

    try:
        await _until_ready(ray, actors, runs)
        start_at = fleet.barrier(START_LEAD_S)
        started = True
        for actor, offset in zip(actors, offsets):
            actor.begin.remote(start_at + offset)
        pending = list(runs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            await collect()
            if pending:
                await asyncio.sleep(POLL_S)
        await collect()
        for k, ref in enumerate(runs):
            try:
                await ref
            except Exception as e:  # the actor died or its run raised: what it never reported counts as failed
                lost.add(k)
                fleet.lose(k, len(actors), parts[k], f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"
                           if str(e) else f"failed: {type(e).__name__}")
    except asyncio.CancelledError:  # Ctrl-C: every actor stops and sends what it measured
        if not started:  # an actor told to stop before the start begins now: its records are timed from here
            fleet.barrier(0.0)
        for actor in actors:
            actor.halt.remote()
        await asyncio.to_thread(ray.wait, runs, num_returns=len(runs), timeout=30)
        await collect()
        raise
    finally:
        for actor in actors:
            ray.kill(actor)


async def _until_ready(ray, actors, runs) -> None:
    """Until every actor is set up and waiting for the start, or has ended (a run that raised is lost, below)."""
    waiting = set(range(len(actors)))
    while waiting:
        for k in sorted(waiting):
            ended, _ = ray.wait([runs[k]], timeout=0)
            try:
                ready = bool(ended) or await actors[k].is_ready.remote()
            except Exception:  # noqa: BLE001 - the actor died: its run's reference says how
                ready = True
            if ready:
                waiting.discard(k)
        if waiting:
            await asyncio.sleep(POLL_S)


def _clock_offset(ray, actor) -> float:
    """The actor's clock minus the driver's, from the round trip with the least delay."""
    best = None
    for _ in range(CLOCK_PROBES):
        sent = time.time()
        theirs = ray.get(actor.clock.remote())
        back = time.time()
        if best is None or back - sent < best[0]:
            best = (back - sent, theirs - (sent + back) / 2)
    return best[1]
