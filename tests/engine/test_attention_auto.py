"""`attention_backend=auto` on a GPU where FlashAttention-4 runs: each step's attention from the backend measured
faster for its phase and size (decode and short prefills Triton, long prefills FA4), and the token-count graphs
capture each bucket with the backend its steps take. The backends here are stand-ins that record their calls, so
the choice is checked on any machine; the kernels themselves run in tests/engine/test_flash_attention_gpu.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from infertrace.ablate.device import Machine, _in_effect
from infertrace.engine import attention
from infertrace.engine.attention import AttentionMetadata, PhasedAttention, flash_prefill_rule
from infertrace.engine.config import EngineConfig
from infertrace.engine.cuda_graph import TokenGraphs
from infertrace.engine.kernels import tuning
from infertrace.engine.step_buffers import StepBuffers

FLASH_FROM = 1536


class Recorder:
    """A backend that records which steps reached it."""

    def __init__(self, name: str, tiles: bool):
        self.name, self.tiles = name, tiles
        self.forwards: list[tuple[int, bool]] = []
        self.begun: list[int] = []

    def uses_tiles(self, num_tokens: int) -> bool:
        return self.tiles

    def begin_forward(self, meta: AttentionMetadata) -> None:
        self.begun.append(meta.slot_mapping.shape[0])

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, kv_stored=False):
        self.forwards.append((meta.slot_mapping.shape[0], kv_stored))
        return q


def step_meta(query_lens: list[int], contexts: list[int]) -> AttentionMetadata:
    tokens = sum(query_lens)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.arange(tokens), query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(contexts),
        block_tables=torch.zeros(len(query_lens), 1, dtype=torch.long), query_lens_list=query_lens,
        seq_lens_list=contexts, max_query_len=max(query_lens), max_seq_len=max(contexts), block_size=16)


@pytest.fixture
def phased():
    return PhasedAttention(Recorder("triton", True), Recorder("flash", False), FLASH_FROM)


@pytest.mark.parametrize(("query_lens", "backend"), [
    ([1] * 256, "triton"),  # decode, however large the batch
    ([1] * 2048, "triton"),  # one token a request is decode's kernel even past the bound
    ([512], "triton"),  # a short prefill
    ([1535], "triton"),
    ([1536], "flash"),  # from the bound on
    ([8192], "flash"),
    ([1024, 256, 256] + [1] * 8, "flash"),  # a mixed step of 1,544 tokens
    ([5] * 8, "triton"),  # a verify step
])
def test_a_step_takes_the_backend_its_phase_and_size_were_measured_faster_with(phased, query_lens, backend):
    meta = step_meta(query_lens, [q + 100 for q in query_lens])
    q = torch.zeros(sum(query_lens), 2, 4)
    phased.begin_forward(meta)
    assert phased.forward(q, None, None, None, None, meta, 1.0, kv_stored=True) is q
    chosen = phased.flash if backend == "flash" else phased.triton
    other = phased.triton if backend == "flash" else phased.flash
    assert chosen.forwards == [(len(q), True)] and other.forwards == []
    # only FA4 converts the step's index tensors to int32 ahead of its layers
    assert phased.flash.begun == ([len(q)] if backend == "flash" else [])


def test_each_token_graph_captures_the_backend_its_bucket_s_steps_take(phased):
    buckets = (512, 1024, 1536, 2048, 4096)
    graphs = TokenGraphs(None, StepBuffers(4096, 64, 8, torch.device("cpu"), max_tiles=512), buckets, 4096, 64, 16,
                         group=2, uses_tiles=phased.uses_tiles)
    for bucket in buckets:
        meta = graphs.meta(bucket)
        flash = bucket >= FLASH_FROM
        assert phased.backend_for(meta) is (phased.flash if flash else phased.triton)
        # a Triton bucket replays over a tile list, a FA4 bucket over its padded cu_seqlens
        assert (meta.tiles is None) == flash == (not graphs.uses_tiles(bucket))


def test_the_rule_gives_fa4_long_prefills_on_hopper_only():
    assert flash_prefill_rule((9, 0)) == FLASH_FROM
    assert flash_prefill_rule((10, 0)) is None  # not measured there: Triton alone
    assert flash_prefill_rule((8, 0)) is None


def test_auto_is_triton_alone_where_flash_attention_cannot_run(monkeypatch):
    """Without FA4 installed, or with a setting it cannot serve, auto is the Triton backend as before."""
    made = []
    monkeypatch.setattr(attention, "TritonAttention", lambda *a: made.append("triton") or "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def no_flash(config, device, dtype):
        raise ImportError("flash-attn-4 does not import here")

    monkeypatch.setattr(attention, "FlashAttention", no_flash)
    cuda = torch.device("cuda")
    assert attention.make_attention_backend(EngineConfig(), cuda) == "triton"
    monkeypatch.setattr(attention, "FlashAttention", lambda config, device, dtype: Recorder("flash", False))
    both = attention.make_attention_backend(EngineConfig(), cuda)
    assert isinstance(both, PhasedAttention) and both.flash_from == FLASH_FROM and both.triton == "triton"
    # an experiment moves the bound or turns FA4 off (kernels/tuning.py)
    assert attention.make_attention_backend(EngineConfig(), cuda, overrides={"flash_prefill_from": 512}).flash_from == 512
    assert attention.make_attention_backend(EngineConfig(), cuda, overrides={"flash_prefill_from": "off"}) == "triton"
    # the two named backends are untouched by the rule
    assert attention.make_attention_backend(EngineConfig(attention_backend="triton"), cuda) == "triton"


def test_the_bound_is_a_tuning_rule_an_experiment_may_override(monkeypatch):
    monkeypatch.setenv(tuning.ENV, json.dumps({"rules": {"flash_prefill_from": 1024}}))
    assert tuning.rules() == {"flash_prefill_from": 1024}
    monkeypatch.setenv(tuning.ENV, json.dumps({"rules": {"flash_prefill_from": 1000}}))
    with pytest.raises(ValueError, match="flash_prefill_from takes 256, 512"):
        tuning.rules()


def test_ablate_says_what_auto_runs_on_the_machine(monkeypatch):
    config = dataclasses.asdict(EngineConfig())
    hopper = Machine(1, (9, 0), 80 * 2**30, 64 * 2**30)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object() if name == "flash_attn" else None)
    said = _in_effect(dict(config), {}, "cuda", hopper)["attention_backend"]
    assert said == f"triton, flash for prefill and mixed steps of {FLASH_FROM}+ tokens"
    assert _in_effect(dict(config) | {"kv_cache_dtype": "fp8"}, {}, "cuda", hopper)["attention_backend"] == "triton"
    assert _in_effect(dict(config), {"flash_prefill_from": "off"}, "cuda", hopper)["attention_backend"] == "triton"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert _in_effect(dict(config), {}, "cuda", hopper)["attention_backend"] == "triton"
    assert _in_effect(dict(config), {}, "cpu", Machine(0, host_bytes=2**30))["attention_backend"] == "torch"
