"""StepBuffers on the CPU: values land where `put` says, and its destination views are kept, boundedly."""

from __future__ import annotations

import numpy as np
import torch

from infertrace.engine import step_buffers
from infertrace.engine.step_buffers import StepBuffers


def buffers() -> StepBuffers:
    return StepBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))


def test_put_writes_values_and_returns_the_same_view_for_the_same_place():
    b = buffers()
    first = b.put("input_ids", np.arange(5))
    again = b.put("input_ids", np.arange(10, 15))
    assert again is first
    assert b.input_ids[:5].tolist() == [10, 11, 12, 13, 14]
    later = b.put("input_ids", np.array([7, 8]), 5)
    assert later is not first and b.input_ids[:7].tolist() == [10, 11, 12, 13, 14, 7, 8]
    table = b.put("block_tables", np.array([[1, 2], [3, 4]]))
    assert table.shape == (2, 2) and b.block_tables[:2, :2].tolist() == [[1, 2], [3, 4]]
    assert b.put("block_tables", np.array([[5, 6, 7]])).shape == (1, 3)
    assert b.block_tables[0, :3].tolist() == [5, 6, 7]


def test_kept_views_stay_bounded(monkeypatch):
    monkeypatch.setattr(step_buffers, "_MAX_VIEWS", 4)
    b = buffers()
    for rows in range(1, 11):
        view = b.put("positions", np.arange(rows))
        assert view.tolist() == list(range(rows))
        assert len(b._views) <= 4
