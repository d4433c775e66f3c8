"""Each numbered step's requests from the request log beside a capture: tokens, token share, GPU time."""

from __future__ import annotations

import pandas as pd
import pytest

from infertrace.analyze.requests import step_requests


def test_gpu_time_is_the_token_share_of_the_step_s_busy_time():
    steps = pd.DataFrame({"rank": [0, 0, 0], "type": ["PREFILL", "MIXED", "DECODE"],
                          "label": ["step[PREFILL bs=1 toks=512 #7]", "step[MIXED bs=2 toks=513 #8]",
                                    "step[DECODE bs=2]"],  # an unnumbered step (an older capture) is left out
                          "step_ms": [30.0, 40.0, 5.0], "busy_ms": [20.0, 30.0, 4.0]})
    log = {"requests": [{"request_id": "a", "steps": [[7, 512, 1, 1], [8, 1, 0, 1], [9, 1, 0, 1]]},
                        {"request_id": "b", "steps": [[8, 512, 1, 1]]}]}
    table = step_requests(steps, log)
    assert list(zip(table["step"], table["request_id"], table["tokens"])) == [(7, "a", 512), (8, "b", 512),
                                                                              (8, "a", 1)]
    assert table["request gpu (ms)"].tolist() == pytest.approx([20.0, 30.0 * 512 / 513, 30.0 / 513])
    assert table.groupby("step")["token share"].sum().tolist() == pytest.approx([1.0, 1.0])


def test_no_numbered_step_no_rows():
    steps = pd.DataFrame({"rank": [0], "type": ["DECODE"], "label": ["step[DECODE bs=2]"], "step_ms": [5.0],
                          "busy_ms": [4.0]})
    assert step_requests(steps, {"requests": [{"request_id": "a", "steps": [[1, 1, 0, 1]]}]}).empty


def test_step_numbers_leave_the_step_label_as_it_was():
    from infertrace.analyze.phases import StepLabel, parse_step_name

    assert parse_step_name("step[DECODE bs=16 #42]") == StepLabel("DECODE", 16, None)
    assert parse_step_name("step[PREFILL bs=2 toks=300 #7]") == StepLabel("PREFILL", 2, 300)
    assert parse_step_name("step[MIXED bs=9 toks=72 #1234]") == StepLabel("MIXED", 9, 72)
