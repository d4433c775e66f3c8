"""The load worker as Ray actors, `--workers` of them on every node of the cluster: a thin way of starting
worker.run_slice, holding no logic of its own.

Each actor's clock is read against the driver's a few times before the start (the offset of the round trip with
the least delay is kept and reported), so that every actor starts at the same instant on its own clock; after
that each actor times its own requests, and no two hosts' clocks are compared.
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
        self.stop: asyncio.Event | None = None

    def clock(self) -> float:
        return time.time()

    async def run(self, cfg_json: dict, part: Slice, start_at: float) -> None:
        self.stop = asyncio.Event()
        await run_slice(cfg_json, part, start_at, lambda b: self.batches.append(msgspec.msgpack.encode(b)),
                        self.stop)

    def drain(self) -> list[bytes]:
        out, self.batches = self.batches, []
        return out

    def halt(self) -> None:
        if self.stop is not None:
            self.stop.set()


_ACTOR = None


def _actor_class():
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _ray().remote(num_cpus=1)(LoadActor)
    return _ACTOR


async def run_on_ray(fleet, parts: list[Slice], start_at: float) -> None:
    ray = connect(fleet.ray_address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = node_ids(fleet.ray_address)
    actors = [_actor_class().options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        nodes[k % len(nodes)], soft=False)).remote() for k in range(len(parts))]
    offsets = [await asyncio.to_thread(_clock_offset, ray, actor) for actor in actors]
    fleet.clock_offsets_s = offsets
    start_at = max(start_at, time.time() + 0.5)  # actors take a moment to come up
    runs = [actor.run.remote(fleet.cfg.to_json() | {"headers": dict(fleet.cfg.headers)}, part, start_at + offset)
            for actor, part, offset in zip(actors, parts, offsets)]
    decoder = msgspec.msgpack.Decoder(Batch)

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
        for actor in actors:
            actor.halt.remote()
        await asyncio.to_thread(ray.wait, runs, num_returns=len(runs), timeout=30)
        await collect()
        raise
    finally:
        for actor in actors:
            ray.kill(actor)


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
