"""Incremental Server-Sent Events parser: body bytes as they arrive in, the data payload of each finished event out."""

from __future__ import annotations

MAX_LINE_BYTES = 16 * 1024 * 1024  # one SSE line, or one event's data; past it the stream is malformed


class SSELineTooLong(ValueError):
    """A line (or an event's data) exceeded MAX_LINE_BYTES: a broken or hostile stream, not a response."""


class SSEParser:
    """Feed raw body bytes in any split; get back each event's `data` (lines joined by newline) as text.

    Lines end in LF or CRLF; comment lines (`:`) and other fields (`event:`, `id:`, `retry:`) are skipped, and
    an event whose data is empty (`data:` alone) is not handed back.
    Bytes are split at the last newline of each read and only the complete lines are decoded, so a UTF-8
    character split across reads is decoded whole (no multi-byte character contains a newline byte), and the
    unfinished line is kept as a list of pieces: a long line costs linear time however many reads it spans.
    A line, or an event's data, longer than `max_line_bytes` raises SSELineTooLong. `close()` hands back an
    event the stream ended without its blank line.
    """

    __slots__ = ("_data", "_data_len", "_max", "_pending", "_pending_len")

    def __init__(self, max_line_bytes: int | None = None) -> None:
        self._max = max_line_bytes or MAX_LINE_BYTES
        self._pending: list[bytes] = []  # the unfinished last line, as received
        self._pending_len = 0
        self._data: list[str] = []
        self._data_len = 0

    def feed(self, chunk: bytes) -> list[str]:
        cut = chunk.rfind(b"\n")
        if cut < 0:
            self._pending.append(chunk)
            self._pending_len += len(chunk)
            if self._pending_len > self._max:
                raise SSELineTooLong(f"an SSE line exceeds {self._max} bytes")
            return []
        head = chunk[:cut]
        if self._pending:
            first = chunk.find(b"\n")
            if self._pending_len + first > self._max:
                raise SSELineTooLong(f"an SSE line exceeds {self._max} bytes")
            self._pending.append(head)
            head = b"".join(self._pending)
        if len(head) > self._max and max(map(len, head.split(b"\n"))) > self._max:
            raise SSELineTooLong(f"an SSE line exceeds {self._max} bytes")
        rest = chunk[cut + 1:]
        self._pending = [rest] if rest else []
        self._pending_len = len(rest)
        return self._lines(head.decode("utf-8", "replace").split("\n"))

    def _lines(self, lines: list[str]) -> list[str]:
        events: list[str] = []
        data = self._data
        for line in lines:
            if line[-1:] == "\r":
                line = line[:-1]
            if not line:
                if data:
                    payload = data[0] if len(data) == 1 else "\n".join(data)
                    if payload:  # an event with empty data (a keep-alive) is not dispatched
                        events.append(payload)
                    data.clear()
                    self._data_len = 0
            elif line[:5] == "data:":
                value = line[6:] if line[5:6] == " " else line[5:]
                self._data_len += len(value) + 1
                if self._data_len > self._max:
                    raise SSELineTooLong(f"an SSE event's data exceeds {self._max} bytes")
                data.append(value)
        return events

    def close(self) -> list[str]:
        events = self.feed(b"\n\n") if self._pending or self._data else []
        self._pending, self._pending_len = [], 0
        return events
