"""Fixtures for the ablation tests: recipe files written from text."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(text, name="r.yaml") -> path of a recipe file holding the dedented text."""

    def write(text: str, name: str = "r.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return write


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch):
    """Every ablation test sees a CPU machine with 64 GiB free, whatever runs it, so that what a phase can do here
    (ablate/device.py) is the same on a GPU runner; tests of other machines build their own Machine."""
    from infertrace.ablate import device

    machine = device.Machine(0, host_bytes=64 * device.GiB)
    monkeypatch.setattr(device.Machine, "here", classmethod(lambda cls: machine))
    return machine
