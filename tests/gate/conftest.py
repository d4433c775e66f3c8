"""Result files for gate tests, made from the hand-written samples in data/ with chosen metric values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture
def make_result(tmp_path):
    """make_result(name, sample="infertrace", config=None, **metrics) writes a result file and returns its path."""

    def make(name: str, sample: str = "infertrace", config: dict | None = None, **metrics) -> Path:
        data = json.loads((DATA / f"{sample}_result.json").read_text())
        data.update(metrics)
        for key, value in (config or {}).items():  # dotted keys into the nested config block
            node = data["config"]
            *parents, leaf = key.split(".")
            for parent in parents:
                node = node[parent]
            node[leaf] = value
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return path

    return make


@pytest.fixture
def make_runs(make_result):
    """make_runs(prefix, metric, values, **kwargs) writes one result per value and returns their paths."""

    def make(prefix: str, metric: str, values: list[float], **kwargs) -> list[Path]:
        return [make_result(f"{prefix}{i}.json", **{metric: value}, **kwargs) for i, value in enumerate(values)]

    return make
