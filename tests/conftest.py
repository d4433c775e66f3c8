"""Shared fixtures: a tiny model built once per test session, and skipping GPU tests without CUDA."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A float32 `tiny` model directory written by `infertrace model init`."""
    from infertrace.modelgen import init_model

    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0, dtype="float32")
