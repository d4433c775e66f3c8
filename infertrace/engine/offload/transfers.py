"""Copies between the device and the host pool, with their bytes and time counted.

On CUDA, loads (host to device) and stores (device to host) each run on a dedicated stream; a copy is ordered after
the compute stream's work only where it must be (a store reads what compute wrote; a staging buffer was allocated
on the compute stream), and compute waits for a load through its event just before it needs the data. An unsynced
stream is how slot mappings get corrupted, so every cross-stream use below goes through an event or wait_stream.
On a CPU device the same calls are plain synchronous copies, so that tests run the code paths the GPU runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch

H2D = "h2d"
D2H = "d2h"


class Transfer:
    """A batch of copies issued together; done once its end event completed (at once on a CPU device)."""

    __slots__ = ("direction", "nbytes", "start", "end", "callbacks")

    def __init__(self, direction: str, nbytes: int, start=None, end=None):
        self.direction = direction
        self.nbytes = nbytes
        self.start = start
        self.end = end  # torch.cuda.Event, or None when the copies already finished
        self.callbacks: list[Callable[[], None]] = []


class Transfers:
    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.load_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.store_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._pending: list[Transfer] = []
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.seconds = 0.0  # copy time: event-timed on CUDA, wall time of the copies on a CPU device

    def copy(
        self,
        direction: str,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        after_compute: bool = True,
        after: Iterable[Transfer | torch.cuda.Event | None] = (),
        keep_alive: Iterable[torch.Tensor] = (),
        on_done: Callable[[], None] | None = None,
    ) -> Transfer:
        """`dst.copy_(src)` for each pair on the direction's stream; `on_done` runs once they finished.

        after_compute: order the copies after everything the compute stream has queued so far.
        after: further transfers or events to wait for. keep_alive: device tensors the copies use that were
        allocated on the compute stream (kept from reuse until the copies finished).
        """
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        if direction == H2D:
            self.bytes_h2d += nbytes
        else:
            self.bytes_d2h += nbytes
        if not self.is_cuda:
            t0 = time.perf_counter()
            for dst, src in pairs:
                dst.copy_(src)
            self.seconds += time.perf_counter() - t0
            if on_done is not None:
                on_done()
            return Transfer(direction, nbytes)

        stream = self.load_stream if direction == H2D else self.store_stream
        if after_compute:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for dep in after:
            event = dep.end if isinstance(dep, Transfer) else dep
            if event is not None:
                stream.wait_event(event)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        for tensor in keep_alive:
            if tensor.device.type == "cuda":
                tensor.record_stream(stream)
        transfer = Transfer(direction, nbytes, start, end)
        if on_done is not None:
            transfer.callbacks.append(on_done)
        self._pending.append(transfer)
        return transfer

    def wait(self, transfer: Transfer | None) -> None:
        """Make the compute stream wait for `transfer` before whatever it runs next."""
        if transfer is not None and transfer.end is not None:
            torch.cuda.current_stream(self.device).wait_event(transfer.end)

    def stores_before_loads(self) -> None:
        """Order every load issued from now on after every store issued so far."""
        if self.is_cuda:
            self.load_stream.wait_stream(self.store_stream)

    def fence(self, on_done: Callable[[], None]) -> None:
        """Run `on_done` once everything queued so far, on the compute stream and on both copy streams, finished."""
        if not self.is_cuda:
            on_done()
            return
        self.store_stream.wait_stream(self.load_stream)
        self.copy(D2H, [], on_done=on_done)

    def poll(self) -> None:
        """Account finished transfers and run their callbacks (releasing the host blocks they pinned)."""
        still = []
        for transfer in self._pending:
            if transfer.end.query():
                self._finish(transfer)
            else:
                still.append(transfer)
        self._pending = still

    def synchronize(self) -> None:
        """Wait for every transfer in flight."""
        for transfer in self._pending:
            transfer.end.synchronize()
            self._finish(transfer)
        self._pending = []

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _finish(self, transfer: Transfer) -> None:
        self.seconds += transfer.start.elapsed_time(transfer.end) / 1000.0
        for callback in transfer.callbacks:
            callback()
        transfer.callbacks = []
        transfer.end = None  # done: nobody needs to wait for it any more
