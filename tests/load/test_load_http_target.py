"""HttpTarget's calls besides the stream: the preflight's model and context checks, the prefix-cache reset, the
prompt salt in the body, and the base URL check. A scripted transport answers; no socket is opened."""

import pytest
from click.testing import CliRunner

from infertrace.auth import check_url
from infertrace.cli import main
from infertrace.load.client.http_target import HttpTarget
from infertrace.load.client.targets import check_context, make_target
from infertrace.load.client.timing import TargetError
from infertrace.load.config import BenchConfig
from infertrace.load.records import RequestSpec


class JsonTransport:
    """Answers request_json from a table of (method, path) -> (status, body); records every call."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    async def request_json(self, method, path, body=None, timeout_s=10.0):
        self.calls.append((method, path))
        return self.answers.get((method, path), (404, {"detail": "Not Found"}))


VLLM_MODELS = {"object": "list", "data": [{"id": "Qwen/Qwen3-0.6B", "object": "model", "max_model_len": 4096}]}


async def test_a_model_the_server_does_not_list_is_refused_before_any_request():
    target = HttpTarget("http://h:8000", "completions", "qwen", JsonTransport({("GET", "/v1/models"): (200, VLLM_MODELS)}))
    with pytest.raises(TargetError, match="model 'qwen' is not served at http://h:8000: /v1/models lists "
                                          "'Qwen/Qwen3-0.6B'"):
        await target.preflight()


async def test_the_listed_model_is_taken_with_its_context_length():
    target = HttpTarget("http://h:8000", "completions", "Qwen/Qwen3-0.6B",
                        JsonTransport({("GET", "/v1/models"): (200, VLLM_MODELS)}))
    await target.preflight()
    assert target.max_model_len == 4096 and target.describe()["max_model_len"] == 4096


async def test_no_context_length_when_the_model_card_has_none():
    models = {"data": [{"id": "m", "max_model_len": True}]}  # a bool is not a length
    target = HttpTarget("http://h", "completions", None, JsonTransport({("GET", "/v1/models"): (200, models)}))
    await target.preflight()
    assert target.model == "m" and target.max_model_len is None


def test_a_prompt_longer_than_the_context_is_refused_before_sending():
    cfg = BenchConfig(base_url="http://h", input_len=4000, output_len=128)
    with pytest.raises(TargetError, match=r"4000 prompt \+ 128 output tokens, above the target's context of 4096"):
        check_context(cfg, 4096)
    check_context(BenchConfig(base_url="http://h", input_len=3968, output_len=128), 4096)  # exactly fits
    shared = BenchConfig(base_url="http://h", dataset="shared-prefix", prefix_len=256, input_len=3800, output_len=64)
    with pytest.raises(TargetError, match="--prefix-len \\+ --input-len"):
        check_context(shared, 4096)
    ranged = BenchConfig(base_url="http://h", input_len=2000, output_len=100, range_ratio=0.5)
    with pytest.raises(TargetError, match="3000 prompt \\+ 150 output"):
        check_context(ranged, 3100)
    check_context(cfg, None)  # unknown context: nothing to check


async def test_reset_prefix_cache_takes_vllms_route_then_sglangs():
    vllm = JsonTransport({("POST", "/reset_prefix_cache"): (200, {"success": True})})
    assert await HttpTarget("http://h", "completions", "m", vllm).reset_prefix_cache() == "/reset_prefix_cache"
    sglang = JsonTransport({("POST", "/flush_cache"): (200, "Cache flushed.\nPlease check backend logs")})
    assert await HttpTarget("http://h", "completions", "m", sglang).reset_prefix_cache() == "/flush_cache"
    assert sglang.calls == [("POST", "/reset_prefix_cache"), ("POST", "/flush_cache")]


async def test_a_reset_the_server_refuses_is_one_line_naming_each_answer():
    busy = JsonTransport({("POST", "/reset_prefix_cache"): (200, {"success": False}),
                          ("POST", "/flush_cache"): (400, "Flush cache failed.\n")})
    with pytest.raises(TargetError) as e:
        await HttpTarget("http://h", "completions", "m", busy).reset_prefix_cache()
    assert "/reset_prefix_cache answered 200 (success false: blocks are still held)" in str(e.value)
    assert "/flush_cache answered 400 (Flush cache failed.)" in str(e.value)
    assert "VLLM_SERVER_DEV_MODE=1" in str(e.value) and "\n" not in str(e.value)


class WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return text.split()


def test_the_salt_goes_before_every_prompt_and_every_sessions_first_message():
    target = HttpTarget("http://h", "completions", "m", None, prompt_salt="run 1a2b", tokenizer=WordTokenizer())
    assert target.body(RequestSpec(0, "hello world", 8))["prompt"] == "run 1a2b\nhello world"
    assert target.salt_tokens == 2
    chat = HttpTarget("http://h", "chat", "m", None, prompt_salt="s")
    turns = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "a"},
             {"role": "user", "content": "two"}]
    body = chat.body(RequestSpec(0, "two", 8, messages=turns))
    assert [m["content"] for m in body["messages"]] == ["s\none", "a", "two"]
    assert turns[0]["content"] == "one"  # the session's own history is left as it was
    plain = HttpTarget("http://h", "completions", "m", None)
    assert plain.body(RequestSpec(0, "hello", 8))["prompt"] == "hello" and plain.salt_tokens == 0


@pytest.mark.parametrize("url, message", [
    ("localhost:8000", "needs http:// or https://; did you mean http://localhost:8000?"),
    ("127.0.0.1:8000", "needs http:// or https://; did you mean http://127.0.0.1:8000?"),
    ("ftp://h:1", "needs http:// or https://"),
    ("http://", "names no host"),
    ("http://h:port", "is not a URL"),
])
def test_a_base_url_without_a_scheme_or_host_is_one_clear_line(url, message):
    with pytest.raises(ValueError, match=message.replace("?", r"\?").replace(".", r"\.")):
        check_url(url)
    with pytest.raises(TargetError, match="--base-url"):
        make_target(BenchConfig(base_url=url), print)


def test_good_urls_pass():
    for url in ("http://127.0.0.1:8000", "https://api.example.com/v1", "http://[::1]:8000"):
        assert check_url(url) == url


async def test_a_load_worker_counts_the_salt_in_the_tokenizer_directory(tiny_model_dir):
    """Load workers load no tokenizer: the salt's tokens are counted from tokenizer.json at open, the same count
    the parent's tokenizer gives, so the server's prompt counts still agree with the built lengths."""
    from infertrace.load.client.targets import load_tokenizer

    class Quiet:
        async def open(self):
            pass

    worker = HttpTarget("http://h", "completions", "m", Quiet(), prompt_salt="run 0123456789ab",
                        tokenizer_dir=tiny_model_dir)
    await worker.open()
    parent = HttpTarget("http://h", "completions", "m", None, prompt_salt="run 0123456789ab",
                        tokenizer=load_tokenizer(tiny_model_dir))
    assert worker.salt_tokens == parent.salt_tokens > 0


def test_connections_are_pooled_and_reused(standin, tmp_path):
    res = bench("--base-url", standin.url, "--num-prompts", 60, "--concurrency", 3, "--warmup", 0,
                "--output-len", 2, "--result-json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    assert 0 < len(standin.peers) <= 3 + 1  # the requests' connections (and the preflight's, at most one more)


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])
