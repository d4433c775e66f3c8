"""Each step's requests, where a server's request log lies beside the capture (`<capture>.request_log.json`, written
by `infertrace serve` at /stop_profile): the step ranges carry the log's step numbers (`step[DECODE bs=16 #42]`),
and each request's GPU time in a step is its share of the step's tokens times the step's GPU busy time."""

from __future__ import annotations

import json
import re

import pandas as pd

LOG_SUFFIX = ".request_log.json"
_NUMBER = re.compile(r" #(\d+)\]$")


def find_request_log(capture) -> dict | None:
    """The request log written beside the capture's rank-0 trace, or None."""
    for rank in capture.ranks:
        name = rank.path.name
        stem = name.split(".rank")[0] if ".rank" in name else name.split(".pt.trace")[0]
        path = rank.path.with_name(stem + LOG_SUFFIX)
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                return None
    return None


def step_requests(steps: pd.DataFrame, log: dict) -> pd.DataFrame:
    """One row per request in each numbered step of the capture: its tokens, their share of the step's tokens,
    and its GPU time (that share of the step's GPU busy time)."""
    numbers = steps["label"].str.extract(_NUMBER, expand=False)
    numbered = steps.assign(step=pd.to_numeric(numbers, errors="coerce"))
    numbered = numbered[numbered["step"].notna()]
    if "rank" in numbered.columns:
        numbered = numbered[numbered["rank"] == numbered["rank"].min()]
    busy = "busy_ms" if "busy_ms" in numbered.columns else "step_ms"
    by_step = {int(r["step"]): r for r in numbered[["step", "type", "step_ms", busy]].to_dict("records")}
    rows = []
    for rec in log.get("requests") or []:
        for number, tokens, prefill, _ in rec.get("steps") or []:
            step = by_step.get(number)
            if step is not None:
                rows.append({"step": number, "type": step["type"], "step (ms)": step["step_ms"],
                             "gpu busy (ms)": step[busy], "request_id": rec["request_id"], "tokens": tokens,
                             "prefill": bool(prefill)})
    columns = ["step", "type", "step (ms)", "gpu busy (ms)", "request_id", "tokens", "prefill", "token share",
               "request gpu (ms)"]
    if not rows:
        return pd.DataFrame(columns=columns)
    table = pd.DataFrame(rows)
    table["token share"] = table["tokens"] / table.groupby("step")["tokens"].transform("sum")
    table["request gpu (ms)"] = table["gpu busy (ms)"] * table["token share"]
    return table.sort_values(["step", "tokens"], ascending=[True, False], ignore_index=True)[columns]
