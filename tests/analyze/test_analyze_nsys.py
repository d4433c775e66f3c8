"""Nsight Systems SQLite exports give the same kernel and phase tables as the Kineto trace of the same run."""

from __future__ import annotations

import sqlite3

import pandas as pd
import pytest

from infertrace.analyze import analyze_path
from infertrace.analyze.capture import CaptureError
from infertrace.analyze.kineto import TraceError
from infertrace.analyze.nsys import read_nsys_sqlite

from_kineto_cat = {"kernel": "kernel", "gpu_memcpy": "memcpy", "cuda_runtime": "api", "cuda_driver": "api",
                   "user_annotation": "nvtx"}


def write_nsys_sqlite(path, events: list[dict]) -> None:
    """The tables `nsys export --type sqlite` writes, holding `events` (Kineto-style dicts, us)."""
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, contextId INTEGER,
            streamId INTEGER, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER, shortName INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER, end INTEGER, deviceId INTEGER, streamId INTEGER,
            correlationId INTEGER, copyKind INTEGER, bytes INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, eventClass INTEGER, globalTid INTEGER,
            correlationId INTEGER, nameId INTEGER, returnValue INTEGER, callchainId INTEGER);
        CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, rangeId INTEGER, category INTEGER,
            color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER, domainId INTEGER);
    """)
    strings: dict[str, int] = {}

    def sid(text):
        if text not in strings:
            strings[text] = len(strings)
            con.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[text], text))
        return strings[text]

    for e in events:
        start, end = int(e["ts"] * 1000), int((e["ts"] + e["dur"]) * 1000)
        corr = e["args"].get("correlation")
        gtid = (e["pid"] << 24) | e["tid"]
        kind = from_kineto_cat[e["cat"]]
        if kind == "kernel":
            con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,0,1,?,?,0,?,?)",
                        (start, end, e["args"]["stream"], corr, sid(e["name"]), sid(e["name"][:20])))
        elif kind == "memcpy":
            con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?,?,0,?,?,8,1024)",
                        (start, end, e["args"]["stream"], corr))
        elif kind == "api":
            con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,0,?,?,?,0,NULL)",
                        (start, end, gtid, corr, sid(e["name"] + "_v12000")))
        else:
            con.execute("INSERT INTO NVTX_EVENTS VALUES (?,?,59,NULL,NULL,NULL,?,?,NULL,NULL,0)",
                        (start, end, e["name"], gtid))
    con.commit()
    con.close()


def test_sqlite_gives_the_same_tables_as_kineto(tmp_path, make_trace, engine_trace):
    import gzip
    import json

    events = json.loads(gzip.decompress(engine_trace.read_bytes()))["traceEvents"]
    for e in events:  # nsys names copies by direction only
        if e["cat"] == "gpu_memcpy":
            e["name"] = "Memcpy DtoD"
    kineto = make_trace(tmp_path / "kineto" / "run.json", events, rank=0)
    (tmp_path / "nsys").mkdir()
    write_nsys_sqlite(tmp_path / "nsys" / "run.sqlite", events)
    a, b = analyze_path(kineto), analyze_path(tmp_path / "nsys")
    assert set(a.tables) == set(b.tables) and not a.skipped and not b.skipped
    for name in ("temporal", "kernel_types", "top_kernels", "overlap", "categories", "phases", "phase_categories"):
        pd.testing.assert_frame_equal(a.tables[name], b.tables[name], check_dtype=False, obj=name)
    steps = b.tables["steps"]
    assert steps["type"].tolist() == ["PREFILL", "DECODE", "DECODE", "MIXED"]
    launch_apis = set(b.tables["launches"]["api"])
    assert launch_apis == {"cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernel"}  # version suffix dropped


def test_nsys_export_from_h100(traces):
    report = analyze_path(traces / "nsys" / "matmul_nvtx_h100")
    steps = report.tables["steps"]
    assert steps[["type", "bs", "kernels"]].values.tolist() == [["DECODE", 8, 10]]
    assert steps.iloc[0]["GEMM (ms)"] == pytest.approx(26.48058, abs=1e-5)  # ten sm80_xmma_gemm kernels
    top = report.tables["top_kernels"]
    assert top["count"].tolist() == [10] and top["category"].tolist() == ["GEMM"]
    assert report.tables["launches"]["api"].tolist() == ["cudaLaunchKernelExC"]
    assert report.ranks["device"].tolist() == ["NVIDIA H100 80GB HBM3"]


def test_not_an_export(tmp_path):
    path = tmp_path / "x.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (a)")
    con.close()
    with pytest.raises(TraceError, match="not an nsys export"):
        read_nsys_sqlite(path)
    (tmp_path / "y.sqlite").write_text("plain text")
    with pytest.raises(TraceError, match="not an SQLite database"):
        read_nsys_sqlite(tmp_path / "y.sqlite")


def test_nsys_report_is_exported_with_nsys_on_path(traces, tmp_path, monkeypatch):
    # a stand-in `nsys` that answers `nsys export --type sqlite --force-overwrite true --output OUT REP`
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nsys"
    sqlite = traces / "nsys" / "matmul_nvtx_h100" / "nsys_matmul_nvtx.sqlite"
    fake.write_text(f'#!/bin/sh\n[ "$1 $2 $3" = "export --type sqlite" ] || exit 3\ncp "{sqlite}" "$7"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "profile.nsys-rep").write_bytes(b"\x00")
    report = analyze_path(tmp_path / "run")
    assert report.tables["steps"][["type", "kernels"]].values.tolist() == [["DECODE", 10]]
    fake.write_text("#!/bin/sh\necho 'export failed: bad file' >&2\nexit 1\n")
    with pytest.raises(CaptureError, match="`nsys export` failed: export failed: bad file"):
        analyze_path(tmp_path / "run")
