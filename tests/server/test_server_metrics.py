"""Prometheus exposition, without a server."""

from __future__ import annotations

import math

import pytest

from infertrace.server.frontend.metrics import Histogram, ServerMetrics, render


def test_histogram_buckets_are_cumulative_with_inf():
    h = Histogram((0.01, 0.1))
    for v in (0.005, 0.05, 0.05, 3.0):
        h.observe(v)
    counts, total, count = h.snapshot()
    assert h.buckets == (0.01, 0.1, math.inf)
    assert counts == [1, 3, 4] and count == 4
    assert total == pytest.approx(3.105)


def _stats(**over):
    stats = {"running": 3, "waiting": 2, "kv_blocks_used": 25, "kv_blocks_total": 100,
             "counters": {"prompt_tokens": 400, "generation_tokens": 90, "prefix_cache_queries": 400,
                          "prefix_cache_hits": 100, "preemptions": 1, "steps": 12}}
    stats.update(over)
    return stats


def test_render_reports_engine_and_server_state():
    server = ServerMetrics()
    server.count({"finished:length": 4, "finished:stop": 1, "rejected:queue_full": 2, "client_disconnects": 3})
    server.count({"in_flight": 6})
    server.count({"in_flight": -1})  # front ends send deltas
    server.observe_step("decode", 0.004)
    server.observe_step("decode", 0.2)
    server.observe_step("prefill", 0.03)
    text = render('my "model"', _stats(), server.snapshot())
    lines = text.splitlines()
    label = 'model_name="my \\"model\\""'
    assert f"infertrace:num_requests_running{{{label}}} 3" in lines
    assert f"infertrace:num_requests_waiting{{{label}}} 2" in lines
    assert f"infertrace:num_requests_in_flight{{{label}}} 5" in lines
    assert f"infertrace:kv_blocks_used{{{label}}} 25" in lines
    assert f"infertrace:kv_blocks_total{{{label}}} 100" in lines
    assert f"infertrace:kv_cache_usage_perc{{{label}}} 0.25" in lines
    assert f"infertrace:prefix_cache_hit_rate{{{label}}} 0.25" in lines
    assert f"infertrace:prompt_tokens_total{{{label}}} 400" in lines
    assert f"infertrace:generation_tokens_total{{{label}}} 90" in lines
    assert f'infertrace:request_success_total{{{label},finished_reason="length"}} 4' in lines
    assert f'infertrace:requests_rejected_total{{{label},reason="queue_full"}} 2' in lines
    assert f"infertrace:client_disconnects_total{{{label}}} 3" in lines
    assert f'infertrace:step_duration_seconds_bucket{{{label},kind="decode",le="0.005"}} 1' in lines
    assert f'infertrace:step_duration_seconds_bucket{{{label},kind="decode",le="+Inf"}} 2' in lines
    assert f'infertrace:step_duration_seconds_count{{{label},kind="prefill"}} 1' in lines
    assert "# TYPE infertrace:step_duration_seconds histogram" in lines
    assert text.endswith("\n")


def test_garbage_collections_are_timed_by_generation_until_the_metrics_are_gone():
    import gc
    import weakref

    server = ServerMetrics()
    server.time_gc()
    gc.collect(2)
    gc.collect(0)
    pauses = server.snapshot()["gc_pauses"]
    assert pauses["2"][2] >= 1 and pauses["0"][2] >= 1  # counts
    assert 0 < pauses["2"][1] < 10  # seconds
    lines = render("m", _stats(), server.snapshot()).splitlines()
    assert "# TYPE infertrace:gc_pause_seconds histogram" in lines
    assert any(line.startswith('infertrace:gc_pause_seconds_count{model_name="m",generation="2"} ') for line in lines)
    server.forget_gc()  # the engine process drops its start-up collection this way
    assert server.snapshot()["gc_pauses"] == {}
    gone = weakref.ref(server)
    del server
    gc.collect()  # the callback holds no reference: the metrics object goes, and later collections are not counted
    assert gone() is None
    callbacks = len(gc.callbacks)
    ServerMetrics().time_gc()  # a new timer drops the dead one's callback as it adds its own
    assert len(gc.callbacks) == callbacks


def test_a_collection_while_the_metrics_lock_is_held_does_not_hang():
    """The collector calls back at any allocation: here inside `count()`'s lock, in the same thread (a test run hung
    there when the callback took that lock)."""
    import gc
    import threading

    server = ServerMetrics()
    server.time_gc()

    def collect_under_the_lock():
        with server._lock:
            gc.collect()

    worker = threading.Thread(target=collect_under_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the collector's callback waited for a lock its own thread holds"
    assert server.snapshot()["gc_pauses"]["2"][2] >= 1


def test_render_with_an_idle_fresh_engine():
    text = render("m", _stats(kv_blocks_total=0, kv_blocks_used=0, counters={}), ServerMetrics().snapshot())
    assert 'infertrace:kv_cache_usage_perc{model_name="m"} 0.0' in text
    assert 'infertrace:prefix_cache_hit_rate{model_name="m"} 0.0' in text


def test_render_is_valid_prometheus_text():
    parser = pytest.importorskip("prometheus_client.parser")
    server = ServerMetrics()
    server.count({"finished:length": 1})
    server.observe_step("mixed", 0.02)
    families = {f.name: f for f in parser.text_string_to_metric_families(render("m", _stats(), server.snapshot()))}
    assert families["infertrace:step_duration_seconds"].type == "histogram"
    assert families["infertrace:prompt_tokens"].type == "counter"
    assert families["infertrace:num_requests_running"].samples[0].value == 3
