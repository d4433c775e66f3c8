"""LoRA adapters, structured output and images over load workers (local processes, Ray actors): each worker sends
the bodies one process would, and the merged run gives the same per-adapter, valid-output and image-token figures as
one process of the same seed."""

import json
from collections import Counter

import pytest
from click.testing import CliRunner
from PIL import Image

from infertrace.load.command import bench
from infertrace.load.records import RequestSpec
from tests.load.test_load_images import VisionServer, qwen_image_tokens
from tests.load.test_load_lora import TOKENS, LoraServer
from tests.load.test_load_structured import ChatServer


def run(url, tmp_path, name, *args):
    out, reqs = tmp_path / f"{name}.json", tmp_path / f"{name}.jsonl"
    res = CliRunner().invoke(bench, [str(a) for a in ("--base-url", url, "--warmup", 0, "--scrape-interval", 0,
                                                      "--result-json", out, "--requests-jsonl", reqs, *args)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), [json.loads(x) for x in reqs.read_text().splitlines()]


def lora_run(server, tmp_path, name, *workers):
    data, lines = run(server.url, tmp_path, name, "--model", "base", "--lora-modules", "a=3,b=1", "--input-len", 8,
                      "--output-len", 8, "--num-prompts", 24, "--seed", 5, *workers)
    sent = {rid: model for rid, model, _ in server.seen}
    assert all(x["adapter"] == sent[x["request_id"]] for x in lines)  # each record names what its body named
    return data


def test_lora_adapters_over_two_workers_split_as_one_process_does(tmp_path):
    with LoraServer() as server:
        one = lora_run(server, tmp_path, "one")
        two = lora_run(server, tmp_path, "two", "--workers", 2)
    assert two["workers"] == 2
    for name in ("a", "b"):
        counts = [(d["per_adapter"][name]["requests"], d["per_adapter"][name]["completed"],
                   d["per_adapter"][name]["total_output_tokens"]) for d in (one, two)]
        assert counts[0] == counts[1] and counts[0][2] == TOKENS[name] * counts[0][0] > 0, name


@pytest.mark.parametrize("mode", ["json-schema", "tools"])
def test_structured_output_over_two_workers_is_judged_as_one_process_does(tmp_path, mode):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(8)))
    runs = []
    for workers in (1, 2):
        with ChatServer() as server:
            data, lines = run(server.url, tmp_path, f"w{workers}", "--endpoint", "chat", "--dataset", "jsonl",
                              "--dataset-path", prompts, "--num-prompts", 24, "--structured", mode,
                              "--structured-share", 0.5, "--workers", workers)
        made = Counter(server.made[x["request_id"]] for x in lines)
        s = data["structured"]
        assert (s["valid"], s["invalid"], s["unconstrained"]["requests"]) == \
            (made["valid"], made["invalid"], made["free"])
        runs.append((s["valid"], s["invalid"], s["total"], s["constrained"]["requests"]))
    one, two = runs
    assert one == two and one[0] > 0 and one[1] > 0


def test_image_tokens_over_two_workers_are_those_of_one_process(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (56, 56), "red").save(folder / "a.png")  # two sizes: each request's count shows which it got
    Image.new("RGB", (112, 56), "blue").save(folder / "b.jpg")
    tokens = {}
    with VisionServer(AutoTokenizer.from_pretrained(tiny_model_dir)) as server:
        for workers in (1, 2):
            data, lines = run(server.url, tmp_path, f"w{workers}", "--endpoint", "chat", "--tokenizer",
                              tiny_model_dir, "--input-len", 16, "--output-len", 3, "--num-prompts", 6, "--images", 1,
                              "--image-dir", folder, "--workers", workers)
            tokens[workers] = ({x["index"]: x["image_tokens"] for x in lines}, data["images"]["mean_image_tokens"])
    expected = {i: qwen_image_tokens(*((56, 56) if i % 2 == 0 else (112, 56))) for i in range(6)}
    assert tokens[1] == tokens[2] == (expected, sum(expected.values()) / 6)
    assert sorted(map(tuple, server.images_seen)) == sorted([((56, 56),), ((112, 56),)] * 6)


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="Ray is the optional [distributed] extra")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_lora_adapters_over_ray_actors_split_as_one_process_does(cluster, tmp_path):
    with LoraServer() as server:
        one = lora_run(server, tmp_path, "one")
        two = lora_run(server, tmp_path, "ray", "--workers", 2, "--ray", "auto")
    assert two["workers"] == 2 and two["ray_nodes"] == 1
    assert {n: f["requests"] for n, f in one["per_adapter"].items()} == \
        {n: f["requests"] for n, f in two["per_adapter"].items()}
    assert [two["per_adapter"][n]["total_output_tokens"] for n in ("a", "b")] == \
        [TOKENS[n] * two["per_adapter"][n]["requests"] for n in ("a", "b")]


def test_ray_actors_encode_their_images_before_the_start(cluster, tiny_model_dir, tmp_path):
    """Each actor encodes the run's images (about a second here) before it says it is ready: the start waits for
    every actor, so none starts late."""
    from transformers import AutoTokenizer

    with VisionServer(AutoTokenizer.from_pretrained(tiny_model_dir)) as server:
        data, lines = run(server.url, tmp_path, "ray", "--endpoint", "chat", "--tokenizer", tiny_model_dir,
                          "--input-len", 8, "--output-len", 2, "--num-prompts", 50, "--request-rate", 200,
                          "--images", 4, "--image-size", "512x512", "--workers", 2, "--ray", "auto")
    assert data["workers"] == 2 and data["worker_start_skew_max_ms"] < 250
    assert sorted(x["index"] for x in lines) == list(range(50))
    assert {x["image_tokens"] for x in lines} == {4 * qwen_image_tokens(512, 512)}
    assert data["images"]["distinct_images"] == 200 and len(server.images_seen) == 50


def test_a_ray_run_stopped_before_its_start_keeps_what_its_actors_sent(cluster, standin):
    """Ctrl-C while the actors still encode their images: each is told to stop, begins at once, and what it sent
    comes back on the parent's clock."""
    import asyncio

    from infertrace.load.clock import MonotonicClock
    from infertrace.load.config import BenchConfig
    from infertrace.load.run.fleet import Fleet

    cfg = BenchConfig(base_url=standin.url, endpoint="chat", num_prompts=200, images=1, image_size=(512, 512),
                      workers=2, ray_address="auto", warmup=0)
    fleet = Fleet(cfg, MonotonicClock(), ray_address="auto")

    async def scenario() -> None:
        task = asyncio.ensure_future(fleet.closed_loop([RequestSpec(i, "q", 2) for i in range(8)], 4))
        while not fleet.clock_offsets_s:  # the actors are up and now build their targets (about a second)
            assert not task.done(), task
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert len(fleet.start_skew_s) == 2  # both actors ended with their final batch
    assert len(fleet.results) <= 4  # at most the requests in flight (2 users an actor), each cut short
    assert all(r.error == "interrupted" and r.end >= r.t0 >= r.scheduled >= 0 for r in fleet.results)


def test_a_worker_elsewhere_builds_the_same_plans_from_relative_paths(tmp_path, monkeypatch):
    """A Ray actor's working directory is not the driver's: the files the run names relative to the driver's reach
    every worker by absolute path, and its target carries the same schemas and images."""
    from infertrace.load.client.targets import make_target
    from infertrace.load.clock import MonotonicClock
    from infertrace.load.config import BenchConfig
    from infertrace.load.run.fleet import Fleet

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (28, 28), "red").save(tmp_path / "imgs" / "a.png")
    (tmp_path / "s.jsonl").write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}) + "\n")
    monkeypatch.chdir(tmp_path)
    cfg = BenchConfig(base_url="http://127.0.0.1:9", endpoint="chat", structured="json-schema",
                      schemas_path="s.jsonl", images=1, image_dir="imgs", tokenizer="tok", workers=2,
                      headers={"Authorization": "Bearer k"})
    here = make_target(cfg, print)
    sent = Fleet(cfg, MonotonicClock()).worker_json()
    assert (sent["schemas_path"], sent["image_dir"], sent["tokenizer"]) == \
        (str(tmp_path / "s.jsonl"), str(tmp_path / "imgs"), str(tmp_path / "tok"))
    assert sent["headers"] == {"Authorization": "Bearer k"}
    monkeypatch.chdir("/")
    there = make_target(BenchConfig.from_json(sent), print)
    assert there.structured == here.structured and there.images.urls == here.images.urls
    assert there.body(RequestSpec(3, "q", 2)) == here.body(RequestSpec(3, "q", 2))
