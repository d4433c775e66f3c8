"""Profiler endpoints: vLLM-style and SGLang-style starts, self-stopping windows, and the profile-dir fence."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import threading
import time
from pathlib import Path

import pytest

from infertrace.server.frontend.profiler import parse_profile_request, resolve_output_dir
from infertrace.server.frontend.protocol import ApiError


def test_output_dir_resolution_stays_inside_the_profile_dir(tmp_path):
    root = tmp_path / "profiles"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "link-out")
    os.symlink(root, tmp_path / "link-in")

    assert resolve_output_dir(root, "run1") == root / "run1"
    assert resolve_output_dir(root, "a/b/../c") == root / "a" / "c"
    assert resolve_output_dir(root, str(root / "abs")) == root / "abs"
    assert resolve_output_dir(root, str(tmp_path / "link-in" / "x")) == root / "x"  # a link into it is fine
    assert resolve_output_dir(root, None).parent == root
    for escaping in ("..", "../elsewhere", "a/../../elsewhere", str(tmp_path / "elsewhere"), "/etc", "link-out",
                     "link-out/deeper"):
        with pytest.raises(ApiError) as err:
            resolve_output_dir(root, escaping)
        assert err.value.status == 400 and err.value.param == "output_dir"


def test_profile_request_parsing():
    default = parse_profile_request(None)
    assert default.output_dir is None and default.num_steps is None
    assert default.activities == ("CPU", "GPU")
    sglang = parse_profile_request({"output_dir": "x", "num_steps": 5, "activities": ["cpu", "CUDA_PROFILER"],
                                    "record_shapes": True, "with_stack": False, "profile_by_stage": False,
                                    "merge_profiles": False})
    assert sglang.num_steps == 5 and sglang.activities == ("CPU", "CUDA_PROFILER") and sglang.record_shapes
    for bad in ({"num_steps": 0}, {"num_steps": "3"}, {"num_steps": True}, {"activities": "CPU"},
                {"activities": []}, {"output_dir": ""}, {"record_shapes": "yes"}):
        with pytest.raises(ApiError):
            parse_profile_request(bad)


def _load_trace(path: str) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


async def test_profiling_without_profile_dir_is_404(serve_tiny):
    async with serve_tiny() as client:
        for method, path in (("POST", "/start_profile"), ("POST", "/stop_profile")):
            resp = await client.request(method, path)
            assert resp.status == 404
            error = (await resp.json())["error"]
            assert error["code"] == "profiling_disabled" and "--profile-dir" in error["message"]


async def test_vllm_style_start_stop_writes_a_loadable_trace(serve_tiny, tmp_path):
    async with serve_tiny(profile_dir=tmp_path) as client:
        resp = await client.post("/start_profile")
        assert resp.status == 200
        started = await resp.json()
        assert Path(started["output_dir"]).parent == tmp_path

        again = await client.post("/start_profile")
        assert again.status == 409

        assert (await client.post("/v1/completions", json={"prompt": "profile me", "max_tokens": 3})).status == 200
        resp = await client.post("/stop_profile")
        assert resp.status == 200
        stopped = await resp.json()
        assert stopped["output_dir"] == started["output_dir"]
        [trace_file] = stopped["trace_files"]
        assert all(Path(p).parent == Path(started["output_dir"]) and Path(p).exists() for p in stopped["files"])
        names = {e.get("name", "") for e in _load_trace(trace_file)["traceEvents"]}
        assert any(n.startswith("step[PREFILL") for n in names)
        assert any(n.startswith("step[DECODE") for n in names)
        assert {"forward", "sample"} <= names

        resp = await client.post("/stop_profile")
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "no_capture"


async def test_sglang_style_num_steps_stops_by_itself(serve_tiny, tmp_path):
    async with serve_tiny(profile_dir=tmp_path) as client:
        resp = await client.post("/start_profile", json={
            "output_dir": "sglang-run", "num_steps": 2, "activities": ["CPU"], "record_shapes": True})
        assert resp.status == 200, await resp.text()
        assert (await client.post("/v1/completions", json={"prompt": "a few steps", "max_tokens": 6})).status == 200

        out_dir = tmp_path / "sglang-run"
        for _ in range(200):  # the window closes on the engine thread after its second step
            if list(out_dir.glob("*.pt.trace.json.gz")):
                break
            await asyncio.sleep(0.02)
        [trace_file] = out_dir.glob("*.pt.trace.json.gz")
        [manifest_file] = out_dir.glob("*.manifest.json")
        manifest = json.loads(manifest_file.read_text())
        assert len(manifest["steps"]) == 2 and manifest["num_steps"] == 2
        names = [e.get("name", "") for e in _load_trace(str(trace_file))["traceEvents"]]
        assert sum(n.startswith("step[") for n in names) == 2

        # the next /stop_profile hands the finished capture's files out
        stopped = await (await client.post("/stop_profile")).json()
        assert stopped["trace_files"] == [str(trace_file)]


async def test_output_dir_escaping_the_profile_dir_is_400(serve_tiny, tmp_path):
    root, outside = tmp_path / "profiles", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "sneaky")
    async with serve_tiny(profile_dir=root) as client:
        for output_dir in ("../outside", str(outside), "sneaky", "sneaky/x"):
            resp = await client.post("/start_profile", json={"output_dir": output_dir})
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["param"] == "output_dir" and error["code"] == "output_dir_outside_profile_dir"
        resp = await client.post("/start_profile", json={"activities": ["TPU"]})
        assert resp.status == 400 and "TPU" in (await resp.json())["error"]["message"]
        resp = await client.post("/start_profile", data=b"{not json", headers={"Content-Type": "application/json"})
        assert resp.status == 400
    assert list(outside.iterdir()) == []
    assert list(root.iterdir()) == [root / "sneaky"]


async def test_a_folder_swapped_for_a_symlink_after_start_is_not_written_through(serve_tiny, tmp_path):
    root, outside = tmp_path / "profiles", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    async with serve_tiny(profile_dir=root) as client:
        started = await (await client.post("/start_profile", json={"output_dir": "run"})).json()
        assert started["output_dir"] == str(root / "run")
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status == 200
        os.rename(root / "run", tmp_path / "run-moved")
        os.symlink(outside, root / "run")  # the checked folder now points outside the profile dir
        resp = await client.post("/stop_profile")
        assert resp.status == 200, await resp.text()
        stopped = await resp.json()
    assert list(outside.iterdir()) == [] and list((tmp_path / "run-moved").iterdir()) == []
    assert Path(stopped["output_dir"]).parent == root and "replaced" in stopped["note"]
    assert stopped["trace_files"] and all(Path(p).parent == Path(stopped["output_dir"]) for p in stopped["files"])


async def test_a_symlink_inside_the_profile_dir_is_refused(serve_tiny, tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")  # stays inside, but could be re-pointed later
    async with serve_tiny(profile_dir=tmp_path) as client:
        for output_dir in ("alias", "alias/deeper", str(tmp_path / "alias")):
            error = (await (await client.post("/start_profile", json={"output_dir": output_dir})).json())["error"]
            assert error["param"] == "output_dir" and error["code"] == "output_dir_symlink"
    assert list((tmp_path / "real").iterdir()) == []


async def test_a_failed_start_leaves_no_folder_behind(serve_tiny, tmp_path):
    async with serve_tiny(profile_dir=tmp_path) as client:
        for body in ({"activities": ["CUDA_PROFILER"]}, {"activities": ["CUDA_PROFILER"], "output_dir": "a/b/c"}):
            resp = await client.post("/start_profile", json=body)
            assert resp.status == 400 and "CUDA" in (await resp.json())["error"]["message"]
        assert list(tmp_path.iterdir()) == []
        assert (await client.post("/start_profile")).status == 200  # and the profiler is free again
        assert (await client.post("/stop_profile")).status == 200


async def test_a_start_while_a_finished_window_is_written_does_not_lose_it(serve_tiny, tmp_path, monkeypatch):
    from infertrace.capture.torch_capture import CaptureSession

    real_stop, writing = CaptureSession.stop, threading.Event()

    def slow_stop(self):
        writing.set()
        time.sleep(0.5)  # a big trace takes a while to write
        return real_stop(self)

    monkeypatch.setattr(CaptureSession, "stop", slow_stop)
    async with serve_tiny(profile_dir=tmp_path) as client:
        resp = await client.post("/start_profile", json={"output_dir": "first", "num_steps": 1, "activities": ["CPU"]})
        assert resp.status == 200
        generating = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}))
        for _ in range(200):  # the window has closed: its files are being written between two engine steps
            if writing.is_set():
                break
            await asyncio.sleep(0.01)
        assert writing.is_set()
        # the start waits for the files, then hands over the finished window it replaces
        second = await client.post("/start_profile", json={"output_dir": "second"})
        assert second.status == 200, await second.text()
        previous = (await second.json())["previous"]
        assert previous["status"] == "stopped" and Path(previous["output_dir"]) == tmp_path / "first"
        assert previous["trace_files"] and all(Path(p).is_file() for p in previous["trace_files"])
        assert (await generating).status == 200
        stopped = await client.post("/stop_profile")
        assert stopped.status == 200, await stopped.text()
        assert Path((await stopped.json())["output_dir"]) == tmp_path / "second"
        statuses = []
        for _ in range(3):  # start and stop racing each other: never a 500
            start, stop = await asyncio.gather(client.post("/start_profile"), client.post("/stop_profile"))
            statuses.append((start.status, stop.status))
            await client.post("/stop_profile")
        assert all(s in ((200, 200), (200, 400), (409, 200)) for s in statuses), statuses


async def test_a_named_capture_on_two_tensor_parallel_ranks_writes_one_trace_per_rank(serve_tiny, tmp_path):
    async with serve_tiny({"tensor_parallel_size": 2}, profile_dir=tmp_path) as client:
        resp = await client.post("/start_profile", json={"profile_id": "tp-run.1", "activities": ["CPU"]})
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["output_dir"] == str(tmp_path / "capture-tp-run.1")
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})).status == 200
        stopped = await (await client.post("/stop_profile")).json()
        bad = await client.post("/start_profile", json={"profile_id": "../up"})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "profile_id"
    traces = sorted(Path(p) for p in stopped["trace_files"])
    assert [t.name.split(".")[-5] for t in traces] == ["rank0", "rank1"]
    assert all(t.name.startswith("tp-run.1.") and t.parent == tmp_path / "capture-tp-run.1" for t in traces)
    for rank, trace in enumerate(traces):
        with gzip.open(trace, "rt") as f:
            doc = json.load(f)
        assert doc["distributedInfo"]["rank"] == rank and doc["distributedInfo"]["world_size"] == 2
        assert any(e.get("name", "").startswith("step[") for e in doc["traceEvents"])


async def test_an_output_dir_too_long_for_the_file_system_is_a_400(serve_tiny, tmp_path):
    async with serve_tiny(profile_dir=tmp_path) as client:
        for output_dir in ("x" * 5000, "a/" + "y" * 300, "/".join(["z" * 200] * 30)):  # it was a 500
            resp = await client.post("/start_profile", json={"output_dir": output_dir})
            assert resp.status == 400, (len(output_dir), await resp.text())
            assert (await resp.json())["error"]["param"] == "output_dir"
        ok = await client.post("/start_profile", json={"output_dir": "fine", "activities": ["CPU"]})
        assert ok.status == 200, await ok.text()
        assert (await client.post("/stop_profile")).status == 200


async def test_an_output_dir_nested_too_deep_is_one_clear_400(serve_tiny, tmp_path):
    async with serve_tiny(profile_dir=tmp_path) as client:
        resp = await client.post("/start_profile", json={"output_dir": "/".join(["a"] * 2040)})  # it was a 500
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
        assert error["param"] == "output_dir" and error["message"] == ("output_dir is too deep: at most 64 folders, "
                                                                       "got 2040")
        assert not (tmp_path / "a").exists()
        ok = await client.post("/start_profile", json={"output_dir": "/".join(["b"] * 64), "activities": ["CPU"]})
        assert ok.status == 200, await ok.text()
        assert (await client.post("/stop_profile")).status == 200
