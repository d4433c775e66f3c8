"""`--endpoint embeddings`: the prompt datasets' prompts grouped into requests of --random-batch-size inputs, sent
as any prompt load is (closed loop, rate, ramp). vLLM 0.32's `vllm bench serve` groups its random prompts the same
way (benchmarks/datasets/datasets.py, RandomDataset.sample with batchsize); here --num-prompts counts requests."""

from __future__ import annotations

from infertrace.load.config import BenchConfig
from infertrace.load.records import RequestSpec
from infertrace.load.workloads.prompts import PromptLoad, build_specs


def batched(specs: list[RequestSpec], size: int) -> list[RequestSpec]:
    """Consecutive prompts `size` to a request; each input as its text, or its token ids where no text was made.
    The request's built length is the sum of its inputs' (unknown when one is unknown)."""
    out = []
    for i in range(0, len(specs), size):
        group = specs[i:i + size]
        lengths = [s.prompt_len for s in group]
        out.append(RequestSpec(index=len(out), prompt=group[0].prompt, output_len=0,
                               prompt_len=None if None in lengths else sum(lengths),
                               inputs=[s.prompt if s.prompt or s.prompt_ids is None else s.prompt_ids
                                       for s in group]))
    return out


class EmbeddingLoad(PromptLoad):
    """--num-prompts requests of --random-batch-size inputs each."""

    def __init__(self, cfg: BenchConfig, tokenizer, point: int = 0, max_model_len: int | None = None) -> None:
        self.cfg, self.tokenizer, self.point, self.max_model_len = cfg, tokenizer, point, max_model_len
        self.specs = self._requests(cfg.num_prompts, "measure")

    def warmup_specs(self, n: int) -> list[RequestSpec]:
        return self._requests(n, "warmup")

    def _requests(self, n: int, stream: str) -> list[RequestSpec]:
        size = self.cfg.embed_batch_size
        return batched(build_specs(self.cfg, self.tokenizer, n * size, stream, self.point, self.max_model_len), size)
