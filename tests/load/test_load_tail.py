"""The tail explained from joined requests: the p50 and p99 cohorts, and the findings that name the TTFT tail's and
the ITL tail's cause with their evidence."""

from __future__ import annotations

import numpy as np
import pytest

from infertrace.load.records import RequestResult
from infertrace.load.results.join import TTFT_PARTS
from infertrace.load.results.tail import cohorts, slowest, tail_findings, tail_summary


def joined_run(n: int = 200, seed: int = 0) -> list[RequestResult]:
    """Requests whose TTFT is mostly prefill, except the last 5% that waited behind 3-5 prefills; every 40th gap is a
    mixed step beside a 1,024-2,048-token prefill of another request, the rest plain decode steps."""
    rng = np.random.default_rng(seed)
    results = []
    for i in range(n):
        queued = i >= n * 0.95
        parts = {"network_and_frontend": 0.3, "tokenize": 0.5, "queue": 60.0 + 10 * rng.random() if queued else 1.0,
                 "prefill_steps": 8.0 + rng.random(), "between_prefill_waits": 0.0, "first_token_send": 0.4}
        ttft = sum(parts.values()) / 1e3
        gaps, itl_steps = [], []
        for k in range(20):
            mixed = (i * 20 + k) % 40 == 0
            gap = 0.030 if mixed else 0.005 + 0.0002 * rng.random()
            gaps.append(gap)
            itl_steps.append({"step": 100 + k, "cause": "mixed" if mixed else "decode",
                              "others_prefill_tokens": int(1024 + 1024 * rng.random()) if mixed else 0,
                              "gap_ms": gap * 1e3, "step_ms": gap * 1e3 - 0.2, "server_gap_ms": gap * 1e3 - 0.1})
        r = RequestResult(i, float(i), float(i), float(i) + 1, ttft=ttft, itl=gaps, chunk_tokens=[1] * 21)
        r.request_id = f"run-{i}"
        r.server = {"ttft_parts": parts, "waiting_ahead": 4 if queued else 0, "itl_steps": itl_steps,
                    "queue_behind": {"steps": 4 if queued else 0, "prefill_rows": 4 if queued else 0,
                                     "prefill_tokens": 2048 if queued else 0},
                    "ttft_steps": [{"step": 10 + i, "tokens": 512, "prefill": True, "kind": "prefill",
                                    "batch_size": 1, "step_tokens": 512, "others_prefill_tokens": 0,
                                    "step_ms": parts["prefill_steps"]}]}
        results.append(r)
    return results


def test_cohorts_side_by_side():
    c = cohorts(joined_run())
    assert set(c) == {"p50", "p99"} and c["p99"]["requests"] == 2 and c["p50"]["requests"] >= 40
    assert c["p99"]["parts_ms"]["queue"] > 50 and c["p50"]["parts_ms"]["queue"] == pytest.approx(1.0)
    for cohort in c.values():
        assert sum(cohort["parts_ms"].values()) == pytest.approx(cohort["ttft_ms"])
        assert sum(cohort["shares"].values()) == pytest.approx(1.0)
    assert c["p99"]["queued_behind_prefills"] == 4


def test_findings_name_the_cause_with_evidence():
    results = joined_run()
    ttft, itl = tail_findings(results)
    assert ttft.rule == "ttft_tail" and ttft.what.startswith("p99 TTFT is queueing: ")
    assert "waiting behind 4 prefills" in ttft.what
    share = int(ttft.what.split(": ")[1].split("%")[0])
    c = cohorts(results)["p99"]
    assert share == round(100 * c["parts_ms"]["queue"] / c["ttft_ms"])
    assert itl.rule == "itl_tail"
    assert itl.what.startswith("ITL p99 gaps are mixed steps carrying prefills of >= 1,")
    assert "mixed" in itl.evidence and "gaps at or above ITL p99" in itl.evidence


def test_a_p99_cohort_of_one_request_is_singular():
    ttft, _ = tail_findings(joined_run(n=50))  # 50 requests: the p99 cohort is the slowest one alone
    assert cohorts(joined_run(n=50))["p99"]["requests"] == 1
    assert ttft.evidence.startswith("1 request at or above TTFT p99")


def test_a_tail_without_one_cause_says_so():
    results = joined_run()
    for r in results:  # every part equal
        r.server["ttft_parts"] = dict.fromkeys(TTFT_PARTS, 1.0)
        r.ttft = 6e-3
    ttft = tail_findings(results)[0]
    assert ttft.what.startswith("p99 TTFT has no single cause")


def test_nothing_joined_nothing_found():
    plain = [RequestResult(i, 0.0, 0.0, 1.0, ttft=0.01) for i in range(10)]
    assert cohorts(plain) == {} and tail_findings(plain) == [] and slowest(plain) == []
    summary = tail_summary(joined_run(), {"matched": 200})
    assert summary["matched"] == 200 and len(summary["slowest"]) == 20
    assert summary["slowest"][0]["ttft_ms"] >= summary["slowest"][-1]["ttft_ms"]
