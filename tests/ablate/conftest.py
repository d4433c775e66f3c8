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
