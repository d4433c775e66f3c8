"""Engine test fixtures: greedy references from Hugging Face transformers, computed once per prompt set."""

from __future__ import annotations

import random

import pytest

NEW_TOKENS = 64
VOCAB = 151936


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def spy_logits(engine) -> list:
    """Wraps the engine's sampler so that every step's sampled rows' logits are kept (float32, on the CPU, copied
    before sampling sees them); returns the list they are appended to."""
    seen = []
    sampler = engine.runner.sampler

    def spy(rows, sampling, generators):
        seen.append(rows.float().cpu().clone())
        return sampler(rows, sampling, generators)

    engine.runner.sampler = spy
    return seen


def run_in_waves(path, waves, params, **overrides):
    """Requests added in waves (each after a few steps, so prefills join running decodes), run to completion on an
    engine of `overrides`. Returns (tokens per request, kinds of the steps, the logits of every sampled row per step,
    the engine)."""
    from infertrace.engine import Engine, EngineConfig

    engine = Engine(path, EngineConfig.from_overrides(overrides))
    logits_seen = spy_logits(engine)
    tokens: dict[str, list[int]] = {}
    kinds = []
    for w, wave in enumerate(waves):
        for i, prompt in enumerate(wave):
            tokens[f"w{w}r{i}"] = []
            engine.add_request(f"w{w}r{i}", prompt, params)
        for _ in range(3 if w + 1 < len(waves) else 10**6):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            last = engine.last_step  # with async scheduling a call may finish no step, or finish the one before
            if last is not None and len(kinds) <= last.index:
                kinds.append(last.kind)
    if engine.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return list(tokens.values()), kinds, logits_seen, engine


def free_engine(engine) -> None:
    """Drop `engine` and give its GPU memory back before the next one starts."""
    import gc

    import torch

    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompt_waves(seed: int, sizes: list[list[int]], shared: int = 0) -> list[list[list[int]]]:
    """Random prompts of `sizes` (one list per wave), each behind the same `shared`-token prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared)]
    return [[prefix + [rng.randrange(VOCAB) for _ in range(n)] for n in wave] for wave in sizes]


# (engine overrides, prompt waves) of the mixed-batch scenarios the graph and attention-backend tests share
MIXED_SCENARIOS = {
    # decodes running while new prompts arrive, half of them behind a 160-token prefix already cached
    "mixed with prefix hits": (dict(), prompt_waves(1, [[40, 300, 7], [90, 16, 200], [1, 130, 64, 33]], shared=160)),
    # prompts longer than the step budget: chunks beside other requests' decodes, some ending off a bucket size
    "chunked prefill": (dict(max_num_batched_tokens=384), prompt_waves(2, [[900, 50], [1300, 5, 700], [384, 385]])),
    # a KV cache too small for every request at once: the newest is preempted and computed again later
    "preemption": (dict(kv_cache_tokens=1024, max_num_batched_tokens=512),
                   prompt_waves(3, [[200, 230, 150], [180, 90]])),
}


def skip_without_flash_attn() -> None:
    """Skip unless FlashAttention-4 runs here (CUDA, Hopper or later, flash-attn-4 importable)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FlashAttention-4 needs a Hopper or later GPU")
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means the backend is absent here
        pytest.skip(f"flash-attn-4 does not import: {exc}")


class HFReference:
    """Greedy continuations of Hugging Face's own Qwen3 on the same checkpoint, in float32."""

    def __init__(self, model_dir):
        import torch
        from transformers import Qwen3ForCausalLM

        self.torch = torch
        self.model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(self, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
        """`generate(do_sample=False)` for every prompt (one left-padded batch for the ones not seen before)."""
        torch = self.torch
        todo = [p for p in dict.fromkeys(map(tuple, prompts)) if (p, new_tokens) not in self._cache]
        if todo:
            width = max(map(len, todo))
            ids = torch.zeros(len(todo), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(todo):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            with torch.no_grad():
                out = self.model.generate(
                    ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                    eos_token_id=None, pad_token_id=0,
                )
            assert out.shape[1] == width + new_tokens, "the reference stopped early"
            for i, p in enumerate(todo):
                self._cache[(p, new_tokens)] = out[i, width:].tolist()
        return [self._cache[(tuple(p), new_tokens)] for p in prompts]

    def assert_matches(self, prompts: list[list[int]], got: list[list[int]], new_tokens: int = NEW_TOKENS) -> None:
        """Token-for-token equality with the reference; a mismatch reports the reference's logit gap there."""
        want = self.greedy(prompts, new_tokens)
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                j = next((k for k in range(min(len(g), len(w))) if g[k] != w[k]), min(len(g), len(w)))
                gap = self.top2_gap(list(prompts[i]) + w[:j]) if j < len(w) else float("nan")
                raise AssertionError(
                    f"prompt {i} (len {len(prompts[i])}): {len(g)} tokens, differs at output {j} "
                    f"({g[j:j + 1]} vs reference {w[j:j + 1]}); reference top-2 logit gap there {gap:.3g}"
                )

    def top2_gap(self, tokens: list[int]) -> float:
        """Logit gap between the best and second-best next token after `tokens` (to tell ties from bugs)."""
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([tokens])).logits[0, -1]
        top = self.torch.topk(logits, 2).values
        return float(top[0] - top[1])


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared 2-core machine, spinning OpenMP workers make runs several times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dir) -> HFReference:
    return HFReference(tiny_model_dir)


@pytest.fixture(scope="session")
def mixed_prompts() -> list[list[int]]:
    """16 prompts of 1 to 300 tokens."""
    return random_prompts([1, 300, 17, 64, 5, 129, 250, 33, 2, 90, 16, 15, 200, 48, 77, 160], seed=0)


@pytest.fixture(scope="session")
def make_prompts():
    """`make_prompts(lengths, seed)`: random token-id prompts."""
    return random_prompts


class DigitTokenizer:
    """Decodes token id t to the digit t % 10 (a stand-in with visible text for every id)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(t % 10) for t in ids)


@pytest.fixture
def digit_tokenizer() -> DigitTokenizer:
    return DigitTokenizer()


def run_to_completion(engine, prompts, params) -> tuple[list[list[int]], list]:
    """Add every prompt, step until done; returns each prompt's output tokens and every step's StepStats."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    steps = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps.append(engine.last_step)
    return [tokens[i] for i in ids], steps


@pytest.fixture(scope="session")
def run_engine():
    """`run_engine(engine, prompts, params)` -> (tokens per prompt, StepStats per step)."""
    return run_to_completion


@pytest.fixture
def make_engine(tiny_model_dir):
    """`make_engine(**config_overrides)`: an Engine on the tiny model."""
    from infertrace.engine import Engine, EngineConfig

    def make(**overrides):
        return Engine(tiny_model_dir, EngineConfig.from_overrides(overrides))

    return make
