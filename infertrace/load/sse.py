"""Incremental Server-Sent Events parser: body bytes as they arrive in, the data payload of each finished event out."""

from __future__ import annotations

import codecs


class SSEParser:
    """Feed raw body bytes in any split; get back each event's `data` (lines joined by newline) as text.

    Lines end in LF or CRLF; comment lines (`:`) and other fields (`event:`, `id:`, `retry:`) are skipped, and
    an event whose data is empty (`data:` alone) is not handed back.
    A UTF-8 character split across two reads is decoded whole. `close()` hands back an event the stream ended
    without its blank line.
    """

    __slots__ = ("_data", "_tail", "_utf8")

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._tail = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        text = self._utf8.decode(chunk)
        if self._tail:
            text = self._tail + text
        lines = text.split("\n")
        self._tail = lines.pop()
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
            elif line[:5] == "data:":
                data.append(line[6:] if line[5:6] == " " else line[5:])
        return events

    def close(self) -> list[str]:
        events = self.feed(b"\n\n") if self._tail or self._data else []
        self._tail = ""
        return events
