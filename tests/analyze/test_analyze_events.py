"""The per-rank event table (events.py): narrow id columns, HTA's float times on demand, no copies of the columns."""

from __future__ import annotations

import numpy as np

from infertrace.analyze.events import event_frame
from infertrace.analyze.kineto import TraceColumns


def _columns(pid: list[int]) -> TraceColumns:
    n = len(pid)
    ids = np.arange(n, dtype=np.int64)
    return TraceColumns(names=["a", "b"], name=(ids % 2).astype(np.int32), cats=["kernel", "cpu_op"],
                        cat=(ids % 2).astype(np.int32), pid=np.array(pid, dtype=np.int64), tid=ids + 7,
                        ts_ns=1_700_000_000_000_000_123 + ids * 1001, dur_ns=ids * 3 + 1, stream=ids + 1,
                        correlation=ids * 2, external_id=-np.ones(n, dtype=np.int64))


def test_ids_that_fit_become_int32_and_the_others_stay_int64():
    cols = _columns([1, 2, 3, 4])
    frame = event_frame(cols, int(cols.ts_ns.min()))
    for column in ("index", "pid", "tid", "stream", "correlation", "external_id"):
        assert frame[column].dtype == np.int32, column
    assert frame["stream"].tolist() == [1, -1, 3, -1]  # CPU events get -1, as in HTA
    big = _columns([1, 2**40, 3, 4])
    wide = event_frame(big, 0)
    assert wide["pid"].dtype == np.int64 and wide["pid"].tolist() == [1, 2**40, 3, 4]
    assert wide["tid"].dtype == np.int32


def test_hta_times_are_left_out_on_request_and_nanoseconds_are_the_columns_own():
    cols = _columns([1, 1, 1])
    origin = int(cols.ts_ns.min())
    full = event_frame(cols, origin)
    assert full["ts"].tolist() == [0.0, 1.001, 2.002] and full["end"].tolist() == [0.001, 1.005, 2.009]
    assert full["dur"].tolist() == [0.001, 0.004, 0.007]
    lean = event_frame(cols, origin, hta_times=False)
    assert not {"ts", "dur", "end"} & set(lean.columns)
    assert list(lean.columns) == [c for c in full.columns if c not in ("ts", "dur", "end")]
    assert np.shares_memory(lean["ts_ns"].to_numpy(), cols.ts_ns)  # the table holds the columns, not copies
    assert lean["ts_ns"].tolist() == cols.ts_ns.tolist()
