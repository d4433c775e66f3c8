"""The Target protocol: both targets define every member of it, and a run asks them rather than their kind."""

from __future__ import annotations

import inspect

import pytest

from infertrace.load.client.embedded_target import EmbeddedTarget
from infertrace.load.client.http_target import HttpTarget
from infertrace.load.client.target import Target
from infertrace.load.client.timing import TargetError, measure
from infertrace.load.clock import ScriptedClock
from infertrace.load.records import RequestResult, RequestSpec, StreamEvent

MEMBERS = sorted({*Target.__annotations__, *(name for name, value in vars(Target).items()
                                              if not name.startswith("_") and callable(value))})


class Transport:
    """Answers the request log's routes from a script; opens no socket."""

    def __init__(self, answers: dict[str, tuple[int, object]]) -> None:
        self.answers, self.asked = answers, []

    async def request_json(self, method, path, body=None, timeout_s=10.0, max_bytes=1 << 20):
        self.asked.append(path)
        return self.answers[path]

    async def request_json_sized(self, method, path, timeout_s, max_bytes):
        status, body = await self.request_json(method, path)
        return status, body, 100


def http(answers=None, **kw) -> HttpTarget:
    return HttpTarget("http://h", "completions", "m", Transport(answers or {}), **kw)


@pytest.mark.parametrize("make", [lambda tmp: http(), lambda tmp: EmbeddedTarget(tmp)], ids=["http", "embedded"])
def test_both_targets_define_every_member_of_the_protocol(make, tmp_path):
    target = make(tmp_path)
    assert isinstance(target, Target)
    assert "stream" in MEMBERS and "fetch_request_log" in MEMBERS and "kind" in MEMBERS
    assert Target not in type(target).__mro__  # so every member is its own, never a default taken from Target
    for name in MEMBERS:
        assert hasattr(target, name), name
        if inspect.iscoroutinefunction(getattr(Target, name, None)):
            assert inspect.iscoroutinefunction(getattr(target, name)), name


def test_a_server_s_capabilities():
    target = http()
    assert (target.counts_with_own_tokenizer, target.starts_with_empty_cache, target.open_message) == (True, False,
                                                                                                         None)
    assert target.cache_block_tokens() is None  # before preflight, or a server that does not say
    target.server_info = {"endpoint": "/server_info", "body": {"engine_config": {"block_size": 32}}}
    assert target.cache_block_tokens() == (32, "server_info")
    for junk in (True, 0, -16, "16", None):
        target.server_info = {"endpoint": "/server_info", "body": {"engine_config": {"block_size": junk}}}
        assert target.cache_block_tokens() is None, junk


async def test_a_server_s_request_log_is_read_through_its_target():
    log = {"/v1/request_log?limit=0": (200, {"next": 7, "requests": [], "steps": []}),
           "/v1/request_log?since=7&limit=5000": (200, {"next": 8, "requests": [
               {"request_id": "a", "seq": 7}], "steps": []}),
           "/v1/request_log?since=8&limit=5000": (200, {"next": 8, "requests": [], "steps": []})}
    target = http(log)
    assert await target.request_log_cursor() == 7
    read = await target.fetch_request_log(7)
    assert [r["request_id"] for r in read["requests"]] == ["a"] and read["fetch_warnings"] == []
    assert await http({"/v1/request_log?limit=0": (404, "no such route")}).request_log_cursor() is None


async def test_a_server_s_metrics_are_its_text_or_none():
    assert http().engine_counters() is None
    assert await http({"/metrics": (200, "vllm:num_requests_running 2\n")}).read_metrics() == \
        "vllm:num_requests_running 2\n"
    assert await http({"/metrics": (404, "not found")}).read_metrics() is None
    assert await http({"/metrics": (200, {"json": "is no exposition"})}).read_metrics() is None

    class Gone(Transport):
        async def request_json(self, method, path, body=None, timeout_s=10.0, max_bytes=1 << 20):
            raise TargetError("cannot reach http://h: connection refused")

    assert await HttpTarget("http://h", "completions", "m", Gone({})).read_metrics() is None


async def test_the_bundled_engine_s_capabilities_before_it_is_open(tmp_path):
    target = EmbeddedTarget(tmp_path)
    assert (target.counts_with_own_tokenizer, target.starts_with_empty_cache, target.salt_tokens) == (False, True, 0)
    assert target.open_message == f"loading {tmp_path} into the bundled engine"
    assert target.cache_block_tokens() is None and target.engine_counters() is None
    assert await target.read_metrics() is None
    assert await target.request_log_cursor() is None and await target.fetch_request_log(0) is None
    with pytest.raises(TargetError, match="infertrace profile"):
        await target.start_profile(5)
    assert (await target.stop_profile())[0] is None


async def test_the_bundled_engine_answers_from_its_own_config_and_log(tiny_model_dir):
    target = EmbeddedTarget(tiny_model_dir)
    await target.open()
    try:
        assert target.cache_block_tokens() == (target.engine.config.block_size, "engine config")
        cursor = await target.request_log_cursor()
        assert cursor == 0
        r = await measure(RequestResult(0, 0.0, 0.0, 0.0), target, RequestSpec(0, "hello there", 3), ScriptedClock())
        assert r.success and r.request_id is not None
        log = await target.fetch_request_log(cursor)
        assert [rec["request_id"] for rec in log["requests"]] == [r.request_id]
        assert await target.request_log_cursor() == 1
        counters = target.engine_counters()
        assert counters == target.engine.counters and counters is not target.engine.counters  # a copy, of now
        assert counters["generation_tokens"] == r.output_tokens > 0
    finally:
        await target.close()


async def test_a_scripted_target_takes_the_defaults_of_a_target_that_offers_nothing():
    class Scripted(Target):
        kind = "scripted"

        async def stream(self, spec):
            yield [StreamEvent(text="x", output=True, completion_tokens=1, finish_reason="stop")]

    target = Scripted()
    assert (target.tokenizer, target.max_model_len, target.salt_tokens, target.new_request_id()) == (None, None, 0,
                                                                                                     None)
    assert target.cache_block_tokens() is None and target.describe() == {"kind": "scripted"}
    assert await target.request_log_cursor() is None and await target.fetch_request_log(0) is None
    r = await measure(RequestResult(0, 0.0, 0.0, 0.0), target, RequestSpec(0, "p", 1), ScriptedClock())
    assert r.success and r.request_id is None and r.expected_prompt_tokens is None
