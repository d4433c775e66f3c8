"""The page: self-contained, plotly inlined once, the same findings as the JSON, and drawn by a real browser."""

import json
import re
import shutil

import pytest

from infertrace.load.observe.findings import find_all
from infertrace.load.report import render_html, report_document, write_report


def _doc(run, **overrides):
    findings = find_all(run["results"], run["origin"], run["scrape"], run["telemetry"], run["client_cpu"],
                        run["client_lag_p99_ms"])
    kwargs = dict(scrape=run["scrape"], telemetry=run["telemetry"], findings=findings,
                  profile_window=run["profile_window"], result=run["result"], phases=run["phases"])
    kwargs.update(overrides)
    return report_document(run["results"], run["origin"], **kwargs)


def test_document_is_json_and_holds_the_findings(run):
    doc = _doc(run)
    text = json.dumps(doc, allow_nan=False)  # NaN in the phases table becomes null
    assert [f["rule"] for f in doc["findings"]] == ["queueing", "kv_pressure", "clock_drop"]
    assert doc["phases"][0]["toks"] is None and doc["timeline"]["server"]["deltas"]["preemptions"] > 0
    assert json.loads(text)["findings"] == doc["findings"]


def test_page_is_self_contained_with_plotly_inlined_once(run, tmp_path):
    doc = _doc(run)
    path = write_report(tmp_path / "out" / "run.html", doc)
    html = path.read_text()
    assert html.count("plotly.js v") == 1  # the library, inlined once
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)  # nothing fetched when it opens
    assert html.count('class="plotly-graph-div"') == 2
    embedded = re.search(r'<script type="application/json" id="findings-data">(.*?)</script>', html, re.S)
    assert json.loads(embedded.group(1)) == doc["findings"]  # the HTML's findings are the JSON's
    for f in doc["findings"]:
        assert f["what"].replace(">", "&gt;") in html and f["rule"] in html
    assert "Profiler window: inference phases" in html and "GPU-bound" in html


def test_phases_table_is_analyze_s_own(run):
    import pandas as pd

    from infertrace.analyze.html import display as _display
    from infertrace.analyze.html import html_table as _table

    html = render_html(_doc(run))
    # the very table `infertrace analyze --html` draws: shares in percent, its column names
    assert _table(_display("phases", run["phases"])) in html
    assert ">GPU busy</th>" in html and "91.0%" in html and "gpu_busy_share" not in html
    assert ">0.91<" not in html
    # names in words with their units, no identifiers
    assert "kernels/step" in html and "step mean (ms)" in html and "kernels_per_step" not in html
    # from the document alone (its JSON holds the fractions, nulls for NaN)
    assert _table(_display("phases", pd.DataFrame(_doc(run)["phases"]))) in html


def test_page_without_server_gpu_or_findings(run):
    html = render_html(_doc(run, scrape=None, telemetry=None, findings=[], phases=None, result=None,
                            profile_window=None))
    assert "No rule fired" in html and "inference phases" not in html and "server: running" not in html


def test_titles_and_notes_are_escaped(run):
    run["scrape"].note("<b>x</b> answered HTTP 404")
    html = render_html(_doc(run, title="</script><i>t"))
    assert "<i>t" not in html and "&lt;b&gt;x&lt;/b&gt; answered HTTP 404" in html


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_charts_draw_in_headless_chromium_without_errors(run, tmp_path, browse):
    path = tmp_path / "run.html"
    path.write_text(render_html(_doc(run, trace_span_s=2.5)))
    result, done = browse(path)
    assert result["errors"] == []
    assert result["svgs"] >= 2 and done.stdout.count('class="main-svg"') >= 4  # both figures drew
    # the profiled window's band and its label drew, and the phases table is in analyze's format
    assert "profiled window (2.50 s traced, from the start call)" in done.stdout
    bands = re.findall(r'class="shape-group"[^>]*><path[^>]* d="M([\d.]+),[\d.]+H([\d.]+)V[^"]*" style="[^"]*'
                       r'fill: rgb\(255, 165, 0\)', done.stdout)
    assert bands and all(float(x1) > float(x0) for x0, x1 in bands)  # one drawn band a panel, of some width
    assert ">GPU busy</th>" in done.stdout and "91.0%" in done.stdout
    assert "Uncaught" not in done.stderr and not re.search(r"CONSOLE.*(Error|error)", done.stderr)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_probe_catches_a_broken_page(tmp_path, browse):
    path = tmp_path / "broken.html"
    path.write_text("<html><head></head><body><script>undefinedFunction()</script></body></html>")
    result, done = browse(path)
    assert any("undefinedFunction" in e for e in result["errors"]) and "Uncaught" in done.stderr


def test_the_summary_shows_headline_figures_energy_reasoning_and_warnings(run):
    result = {"output_throughput": 1234.5, "median_ttft_ms": 80.0, "p99_ttft_ms": 200.0, "median_ttfct_ms": 900.0,
              "p99_ttfct_ms": 1500.0, "server_prefix_cache_hit_rate": 0.928, "implied_prefix_cache_hit_rate": 0.0,
              "energy_per_output_token_j": 0.4567, "prefix_cache_warnings": ["a warm <cache>"],
              "headroom_warnings": [], "token_count_warnings": []}
    html = render_html(_doc(run, result=result))
    summary = html[html.index("<h2>Summary</h2>"):html.index("<h2>Findings</h2>")]
    assert "1,234.5 tok/s" in summary and "80.0 / 200.0 ms" in summary and "900.0 / 1,500.0 ms" in summary
    assert "92.8 / 0.0 %" in summary and "0.457 J" in summary and "warning: a warm &lt;cache&gt;" in summary
    plain = render_html(_doc(run, result={**result, "median_ttfct_ms": 80.0, "p99_ttfct_ms": 200.0,
                                          "energy_per_output_token_j": None}))
    assert "TTFCT" not in plain[:plain.index("<h2>Findings</h2>")] and "energy per output token" not in plain


def test_an_embeddings_summary_shows_its_input_throughput_and_latency(run):
    result = {"input_sequence_throughput": 94.8, "median_e2el_ms": 339.0, "p99_e2el_ms": 544.25}
    html = render_html(_doc(run, result=result))
    summary = html[html.index("<h2>Summary</h2>"):html.index("<h2>Findings</h2>")]
    assert "94.8 inputs/s" in summary and "339.0 / 544.2 ms" in summary and "tok/s" not in summary


def test_a_load_shape_s_own_figures_are_the_terminal_s_tables(run, tmp_path, browse):
    """Per LoRA adapter, structured output and images: the page shows the tables bench prints, cell for cell."""
    latencies = {f"{s}_{m}_ms": 10.0 + i for i, m in enumerate(("ttft", "tpot", "itl", "e2el"))
                 for s in ("median", "p99")}
    group = {"requests": 4, "completed": 4, "median_ttft_ms": 12.5, "p99_ttft_ms": 30.25, "median_itl_ms": 2.0,
             "p99_itl_ms": 4.0}
    result = {"output_throughput": 100.0,
              "per_adapter": {"sql": {"share": 0.75, "requests": 6, "completed": 6, "failed": 0,
                                      "request_throughput": 1.5, "output_throughput": 48.0, **latencies},
                              "chat": {"share": 0.25, "requests": 2, "completed": 1, "failed": 1,
                                       "request_throughput": 0.25, "output_throughput": 8.0, **latencies}},
              "structured": {"mode": "json-schema", "valid": 3, "invalid": 1, "total": 4, "constrained": group,
                             "unconstrained": {**group, "median_ttft_ms": 11.0}},
              "images": {"source": "generated 64x64", "images_per_request": 2, "distinct_images": 16,
                         "images_sent": 16, "requests_counted": 8, "mean_image_tokens": 12.0,
                         "median_image_tokens": 12.0, "max_image_tokens": 12, "mean_tokens_per_image": 6.0,
                         "image_tokens_unknown": None}}
    html = render_html(_doc(run, result=result))
    for heading in ("Per LoRA adapter", "Structured output", "Images"):
        assert f"<h2>{heading}</h2>" in html
    assert "<td>6 (6/0)</td>" in html and "<td>2 (1/1)</td>" in html and "<td>75%</td>" in html
    assert "<td>3 / 1 / 4</td>" in html and "<td>12.50 / 30.25</td>" in html
    assert "<td>12.0 / 12.0 / 12.0</td>" in html
    assert "<h2>Per LoRA adapter</h2>" not in render_html(_doc(run, result={"output_throughput": 1.0}))
    page = tmp_path / "shapes.html"
    page.write_text(html)
    probe, _ = browse(page)
    assert probe["errors"] == []


def test_the_summary_says_what_of_the_server_s_log_was_not_joined(run):
    result = {"output_throughput": 1.0, "request_log": {"warnings": ["the server's request log had 2 malformed "
                                                                     "request records, skipped"]}}
    html = render_html(_doc(run, result=result))
    summary = html[html.index("<h2>Summary</h2>"):html.index("<h2>Findings</h2>")]
    assert "warning: the server&#x27;s request log had 2 malformed request records, skipped" in summary
