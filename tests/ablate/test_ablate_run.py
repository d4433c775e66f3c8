"""Running phases: the capture window on the engine thread, how a measured phase is judged, interruption."""

import types

import pytest

from infertrace.ablate.recipe import load_recipe
from infertrace.ablate.run import AblationHooks, PhaseStatus, StepWindow, judge, phase_dir_name, run_ablation
from infertrace.load.benchmark import Interrupter
from infertrace.load.records import RequestResult
from infertrace.load.results.metrics import compute_metrics


class FakeSession:
    def __init__(self, num_steps, fail_on_start=False):
        self.num_steps, self.fail_on_start = num_steps, fail_on_start
        self.active, self.steps, self.stopped = False, [], 0

    def start(self):
        if self.fail_on_start:
            raise ValueError("cannot write traces")
        self.active = True

    def on_step(self, stats):
        self.steps.append(stats.index)
        return len(self.steps) >= self.num_steps

    def stop(self):
        self.active, self.stopped = False, self.stopped + 1
        return ["trace.json.gz", "manifest.json"]


def _step(index, kind, bs):
    return types.SimpleNamespace(index=index, kind=kind, batch_size=bs)


def test_window_opens_at_the_first_full_decode_batch_and_closes_after_n_steps():
    session = FakeSession(num_steps=3)
    window = StepWindow(session, full_batch=4)
    for s in [_step(0, "prefill", 4), _step(1, "decode", 2), _step(2, "decode", 4), _step(3, "decode", 4),
              _step(4, "mixed", 4), _step(5, "decode", 4), _step(6, "decode", 4)]:
        window.on_step(s)
    assert session.steps == [3, 4, 5]  # the opening step itself ran before the profiler did
    assert window.closed and window.paths == ["trace.json.gz", "manifest.json"] and session.stopped == 1
    window.finish()
    assert session.stopped == 1


def test_window_closes_when_the_load_runs_out_and_keeps_errors_off_the_engine_thread():
    short = FakeSession(num_steps=10)
    window = StepWindow(short, full_batch=1)
    window.on_step(_step(0, "decode", 1))
    window.on_step(_step(1, "decode", 1))
    window.finish()
    assert short.stopped == 1 and window.paths
    broken = StepWindow(FakeSession(num_steps=1, fail_on_start=True), full_batch=1)
    broken.on_step(_step(0, "decode", 1))  # must not raise into the engine loop
    assert isinstance(broken.error, ValueError) and broken.closed


def _record(results, interrupted=False):
    return types.SimpleNamespace(metrics=compute_metrics(results, {}), results=results, interrupted=interrupted)


def _ok(i):
    return RequestResult(i, scheduled=0.0, t0=0.0, end=1.0, ttft=0.1, e2el=1.0, output_tokens=8, chunk_tokens=[8])


def _failed(i, reason):
    return RequestResult(i, scheduled=0.0, t0=0.0, end=1.0, error=reason)


def test_judge():
    assert judge(_record([_ok(0), _ok(1)])) == (PhaseStatus.OK, None, None)
    status, error, note = judge(_record([_ok(0), _failed(1, "engine error: boom")]))
    assert status is PhaseStatus.OK and error is None and note == "1 of 2 requests failed: engine error: boom"
    status, error, _ = judge(_record([_failed(0, "engine error: CUDA out of memory")]))
    assert status is PhaseStatus.FAILED and error == "engine error: CUDA out of memory"
    status, error, _ = judge(_record([_ok(0)], interrupted=True))
    assert status is PhaseStatus.INTERRUPTED and "1 request(s) done before Ctrl-C" in error


def test_phase_directory_names():
    plan = types.SimpleNamespace(index=2, name="CUDA graphs / bs=8")
    assert phase_dir_name(plan) == "03-cuda-graphs-bs-8"


@pytest.mark.asyncio
async def test_interrupt_after_a_phase_leaves_the_rest_not_run(write_recipe, tiny_model_dir):
    recipe = load_recipe(write_recipe("""
        workload: {num_prompts: 2, input_len: 8, output_len: 3, concurrency: 2, warmup: 0}
        phases:
          - name: first
          - name: second
            overrides: {attention: looped}
          - name: third
        """))
    interrupter = Interrupter()
    done = []

    def on_done(result):
        done.append(result)
        interrupter.trigger()

    results = await run_ablation(recipe, tiny_model_dir, interrupter, AblationHooks(on_phase_done=on_done))
    assert [r.status for r in results] == [PhaseStatus.OK, PhaseStatus.NOT_RUN, PhaseStatus.NOT_RUN]
    assert done == results
    assert results[0].record.metrics.completed == 2 and results[0].output_throughput > 0
    assert results[0].engine_config["attention"] == "batched"


def test_window_says_once_when_it_closes():
    told = []
    window = StepWindow(FakeSession(num_steps=1), full_batch=1, on_close=lambda: told.append(1))
    for i in range(4):
        window.on_step(_step(i, "decode", 1))
    assert told == [1]


def test_one_line_errors():
    from infertrace.ablate.run import one_line
    from infertrace.load.client.timing import TargetError

    assert one_line(TargetError("cannot start the bundled engine: no\nmore")) == "cannot start the bundled engine: no"
    assert one_line(RuntimeError("CUDA out of memory.\nTried to allocate")) == "RuntimeError: CUDA out of memory."
    assert one_line(KeyError()) == "KeyError"


def test_a_phase_runs_with_its_kernel_rules_in_the_environment_and_puts_it_back(monkeypatch):
    import json
    import os

    from infertrace.ablate.run import kernel_rules
    from infertrace.engine.kernels import tuning

    monkeypatch.setenv(tuning.ENV, '{"skinny_gemm": {"2560,2048": [64, 128, 4, 4]}}')
    before = os.environ[tuning.ENV]
    with kernel_rules({"all_reduce_fusion": "planes"}):
        table = json.loads(os.environ[tuning.ENV])
        assert table["rules"] == {"all_reduce_fusion": "planes"} and "skinny_gemm" in table  # kept, not replaced
        assert tuning.rules() == {"all_reduce_fusion": "planes"}
    assert os.environ[tuning.ENV] == before
    monkeypatch.delenv(tuning.ENV)
    with kernel_rules({"gemm_early_weights": "off"}):
        assert tuning.rules() == {"gemm_early_weights": "off"}
    assert tuning.ENV not in os.environ


async def test_the_engine_of_a_phase_starts_under_its_rules(monkeypatch, tmp_path):
    import os

    from infertrace.ablate.recipe import PlannedPhase
    from infertrace.ablate.run import run_phase
    from infertrace.engine.kernels import tuning
    from infertrace.load.benchmark import Hooks
    from infertrace.load.client.embedded_target import EmbeddedTarget

    monkeypatch.delenv(tuning.ENV, raising=False)
    seen = []

    async def opening(self):
        seen.append(tuning.rules())
        raise RuntimeError("stop here")

    monkeypatch.setattr(EmbeddedTarget, "open", opening)
    phase = PlannedPhase(0, "planes", {}, {}, None, tuning={"all_reduce_fusion": "planes"})
    cfg = _small_workload()
    result = await run_phase(phase, cfg, tmp_path, None, Interrupter(), Hooks())
    assert seen == [{"all_reduce_fusion": "planes"}]
    assert result.status is PhaseStatus.FAILED and result.error == "RuntimeError: stop here"
    assert result.tuning == {"all_reduce_fusion": "planes"} and tuning.ENV not in os.environ


def _small_workload():
    from infertrace.load.config import BenchConfig

    return BenchConfig(num_prompts=1, input_len=4, output_len=2)
