"""The load worker as Ray actors, `--workers` of them on every node of the cluster: a thin way of starting
worker.run_slice, holding no logic of its own.

Each actor's clock is read against the driver's a few times before the start (the offset of the round trip with
the least delay is kept and reported), so that every actor starts at the same instant on its own clock; after
that each actor times its own requests, and no two hosts' clocks are compared.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from infertrace.load.run.worker import Batch, Slice, run_slice

CLOCK_PROBES = 5
POLL_S = 0.2


def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray needs Ray: pip install -e '.[distributed]'") from None
    return ray


def connect(address: str):
    """The Ray module, joined to the cluster at `address` (`auto`: the one `ray start` made); a process that
    already called ray.init keeps its cluster."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    return ray


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
