import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
from engine_bench import bench_decode, bench_nano, copy_bandwidth, model_dir

from infertrace.engine import attention as attn_mod
from infertrace.engine.kernels import paged_attention as pa

root = Path("/tmp/models")
t0 = time.time()
bw = copy_bandwidth()
print(f"copy bw {bw/1e12:.3f} TB/s", flush=True)
model_dir(root, "qwen3-0.6b")
model_dir(root, "qwen3-4b")
print(f"models ready {time.time()-t0:.0f}s", flush=True)
orig_splits = attn_mod.TritonAttention.decode_splits
orig_pa = pa.paged_attention


def set_att4(on):
    # 4 KV splits and (128, 4, 3) tiles for bf16 decode steps only (split decode launches)
    if on:
        attn_mod.TritonAttention.decode_splits = lambda self, b, h: 4

        def wrapped(*a, **kw):
            if kw.get("num_splits", 1) > 1 and kw.get("tiles") is None and kw.get("tiling") is None:
                kw["tiling"] = (128, 4, 3)
            return orig_pa(*a, **kw)
        return wrapped
    attn_mod.TritonAttention.decode_splits = orig_splits
    return orig_pa


def decode(on):
    import infertrace.engine.model_runner as mr  # noqa
    fn = set_att4(on)
    # the attention backend calls kernels through its _kernels namespace
    import infertrace.engine.attention as A
    old = A.TritonAttention.__init__

    def init(self, *a, **k):
        old(self, *a, **k)
        import types
        ns = types.SimpleNamespace(**{n: getattr(self._kernels, n) for n in dir(self._kernels) if not n.startswith("__")})
        ns.paged_attention = fn
        self._kernels = ns
    A.TritonAttention.__init__ = init
    try:
        bench_decode(root, bw, repeats=3, note=f" att4={on}")
    finally:
        A.TritonAttention.__init__ = old
        set_att4(False)


decode(False)
bench_nano(root, hf=False, kv_cache_dtype="fp8")
decode(True)
bench_nano(root, hf=False, kv_cache_dtype="fp8")
decode(False)
decode(True)
bench_nano(root, hf=False, kv_cache_dtype="fp8")
print(f"total {time.time()-t0:.0f}s")
