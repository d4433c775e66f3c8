"""The engine's rule for torch's CPU threads: one core fewer than the host has, unless OMP_NUM_THREADS is set."""

from __future__ import annotations

import torch

from infertrace.engine import threads


def test_the_cpu_engine_leaves_a_core_to_the_event_loop_unless_told(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
        assert threads.cpu_threads() == 1 == torch.get_num_threads()
        monkeypatch.setattr(threads.os, "cpu_count", lambda: 16)
        assert threads.cpu_threads() == 15
        for count in (1, None):
            monkeypatch.setattr(threads.os, "cpu_count", lambda: count)
            assert threads.cpu_threads() == 1
        torch.set_num_threads(3)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
        monkeypatch.setattr(threads.os, "cpu_count", lambda: 16)
        assert threads.cpu_threads() == 3
    finally:
        torch.set_num_threads(before)
