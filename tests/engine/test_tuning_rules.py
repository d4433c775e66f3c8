"""The tuning rules beside the kernels (all-reduce fusion, its kernel's spread, pull, payload and push, the early
GEMM) resolve per rank count and hidden size to the values the engine has always taken by default."""

from __future__ import annotations

import types

import pytest

from infertrace.engine.config import EngineConfig
from infertrace.engine.kernels.allreduce_norm import PushBuffers
from infertrace.engine.model_runner import resolve_fusion, resolve_push, resolve_spread

# (ranks, hidden) -> fusion, spread, pull, payload, push, early GEMM
PINNED = {
    (2, 2560): ("norm", 4, "each", "model", "off", True),
    (2, 5120): ("norm", 4, "each", "model", "off", True),
    (3, 5120): ("planes", 4, "each", "model", "off", True),
    (4, 1024): ("norm", 8, "all", "model", "on", True),
    (4, 5120): ("norm", 8, "all", "model", "on", True),
    (4, 8192): ("norm", 8, "all", "model", "on", True),
    (6, 5120): ("planes", 8, "each", "model", "on", True),
    (8, 2560): ("planes", 8, "all", "model", "on", True),
    (8, 5120): ("planes", 8, "each", "model", "on", True),
}


def resolved(ranks: int, hidden: int) -> tuple:
    config = EngineConfig()
    buffers = types.SimpleNamespace(world_size=ranks, hidden_size=hidden)
    pull = "all" if PushBuffers.pulls_all(buffers, config.all_reduce_pull) else "each"
    early = config.gemm_early_weights == "on" or (config.gemm_early_weights == "auto" and ranks > 1)
    return (resolve_fusion(config.all_reduce_fusion, ranks), resolve_spread(config.all_reduce_spread, ranks), pull,
            config.all_reduce_payload, resolve_push(config.all_reduce_push, ranks), early)


@pytest.mark.parametrize(("ranks", "hidden"), list(PINNED))
def test_the_rules_resolve_to_the_engine_s_defaults(ranks, hidden):
    assert resolved(ranks, hidden) == PINNED[ranks, hidden]
