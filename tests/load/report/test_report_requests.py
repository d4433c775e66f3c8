"""The report's "Where the tail's time went": cohorts and the slowest requests drawn from the joined requests, in
the page and in headless Chromium."""

from __future__ import annotations

import json
import shutil

import pytest

from infertrace.load.report import report_document, write_report
from infertrace.load.report.requests import requests_data
from infertrace.load.results.tail import tail_findings
from tests.load.test_load_tail import joined_run

JOIN = {"source": "infertrace", "requests": 200, "matched": 200, "explained": 200, "offset_ms": 0.4,
        "offset_error_ms": 0.5, "offset_consistent": True}


def test_data_holds_both_cohorts_and_the_slowest_with_their_steps():
    data = requests_data(joined_run(), JOIN)
    json.dumps(data, allow_nan=False)
    assert set(data["cohorts"]) == {"p50", "p99"}
    slow = data["slowest"]
    assert len(slow) == 20 and slow[0]["ttft_ms"] == max(s["ttft_ms"] for s in slow)
    assert slow[0]["steps"][0]["kind"] == "prefill" and slow[0]["queue_behind"]["prefill_rows"] == 4
    assert requests_data(joined_run(), None) is None


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_section_draws_in_headless_chromium(tmp_path, browse):
    results = joined_run()
    doc = report_document(results, 0.0, findings=tail_findings(results), requests=requests_data(results, JOIN))
    html = write_report(tmp_path / "run.html", doc).read_text()
    assert "Where the tail&#x27;s time went" in html or "Where the tail's time went" in html
    assert "0.400 ms ± 0.500 ms" in html and "200 of 200 requests explained" in html
    assert html.count('class="plotly-graph-div"') == 4  # timeline, latency, cohorts, slowest
    assert "p99 TTFT is queueing" in html and "step #209 PREFILL bs=1 512 tok" in html  # the slowest, its steps
    probe, done = browse(tmp_path / "run.html")
    assert probe["errors"] == [] and probe["svgs"] >= 4
    for div in ("ttft-cohorts", "ttft-slowest"):  # each drew its bars
        drawn = done.stdout.split(f'id="{div}"', 1)[1].split('class="plotly-graph-div"', 1)[0]
        assert drawn.count('class="point"') >= 6, div
