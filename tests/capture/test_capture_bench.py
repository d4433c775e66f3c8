"""`bench --profile` against today's peers: the capture goes through the same client as `infertrace profile`."""

from __future__ import annotations

import asyncio

from infertrace.load.client.http_target import AiohttpTransport, HttpTarget


def target(url, headers=None):
    return HttpTarget(url, "completions", "m", AiohttpTransport(url, 30.0, headers))


def window(url, num_steps, pause_s=0.0, headers=None):
    async def scenario():
        t = target(url, headers)
        await t.open()
        try:
            started = await t.start_profile(num_steps)
            await asyncio.sleep(pause_s)
            return started, await t.stop_profile()
        finally:
            await t.close()

    return asyncio.run(scenario())


def test_profile_steps_limit_a_vllm_033_capture(vllm_server):
    started, (status, stopped) = window(vllm_server.url, 5)
    body = vllm_server.profile_calls()[0].json()
    assert body["max_iterations"] == 5 and body["profile_prefix"].startswith("infertrace-")
    assert started["flavour"] == "vllm" and started["notes"] == []
    assert status == 200 and not stopped["already_stopped"]


def test_old_vllm_is_told_the_limit_was_not_applied(vllm_old_server):
    started, _ = window(vllm_old_server.url, 5)
    assert vllm_old_server.profile_calls()[0].body == b""
    assert any("not applied" in n for n in started["notes"])


def test_sglang_self_stop_is_the_normal_end_and_its_files_are_awaited(sglang_server, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path))  # the stand-in and the client share it
    started, (status, stopped) = window(sglang_server.url, 2, pause_s=0.3)
    assert not sglang_server.profiling  # it ended by itself before the stop
    assert status == 200 and stopped["already_stopped"]
    name = sglang_server.session["profile_id"]
    assert stopped["trace_files"] == [str(tmp_path / f"{name}-TP-0.trace.json.gz")]
    assert (tmp_path / f"{name}.infertrace.json").exists()


def test_bench_profile_sends_the_api_key(sglang_server_with_key):
    started, (status, _) = window(sglang_server_with_key.url, None, headers={"Authorization": "Bearer sk-test"})
    assert started["flavour"] == "sglang" and status == 200  # the stand-in answers 401 without the key
    assert [r.path for r in sglang_server_with_key.profile_calls()] == ["/start_profile", "/stop_profile"]
