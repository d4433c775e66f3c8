"""The Triton paged-attention kernels against a plain torch reference (GPU only)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _reference(q, k_cache, v_cache, q_lens, ctx_lens, block_tables, scale):
    out = torch.empty_like(q, dtype=torch.float64)
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    start = 0
    for i, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
        pos = torch.arange(cl, device=q.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [cl, H, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        qi = q[start:start + ql].double()
        s = torch.einsum("thd,nhd->htn", qi, k) * scale
        q_pos = torch.arange(cl - ql, cl, device=q.device)
        s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:start + ql] = torch.einsum("htn,nhd->thd", s.softmax(-1), v)
        start += ql
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 64), (32, 8, 128), (16, 8, 128)])
def test_paged_attention_matches_reference(dtype, num_splits, heads, kv_heads, dim):
    from infertrace.engine.kernels.paged_attention import paged_attention, store_kvcache

    torch.manual_seed(0)
    dev = "cuda"
    block_size, num_blocks = 16, 256
    if num_splits == 1:  # decode rows, a fresh prefill, a prefill after a cached prefix, a chunk in the middle
        q_lens = [1, 1, 37, 20, 1, 64]
        ctx_lens = [1, 300, 37, 100, 17, 200]
    else:  # KV splits are for decode steps: contexts one split covers, some it does not, and empty splits
        q_lens = [1] * 7
        ctx_lens = [1, 300, 37, 100, 17, 500, 256]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    max_blocks = max((c + block_size - 1) // block_size for c in ctx_lens)
    perm = torch.randperm(num_blocks, device=dev).int()
    block_tables = perm[: len(q_lens) * max_blocks].view(len(q_lens), max_blocks).contiguous()
    total = sum(q_lens)
    q = torch.randn(total, heads, dim, device=dev, dtype=dtype)
    # write the new tokens' K/V through the store kernel
    k_new = torch.randn(total, kv_heads, dim, device=dev, dtype=dtype)
    v_new = torch.randn_like(k_new)
    slots = []
    for i, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
        for p in range(cl - ql, cl):
            slots.append(block_tables[i, p // block_size].item() * block_size + p % block_size)
    slot_mapping = torch.tensor(slots, device=dev, dtype=torch.int64)
    store_kvcache(k_new, v_new, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.flatten(0, 1)[slot_mapping], k_new)

    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), device=dev, dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, device=dev, dtype=torch.int32)
    scale = dim ** -0.5
    out = torch.full_like(q, float("nan"))
    # a split past a context writes nothing and the merge must not read it: NaN wherever a split did not write
    workspace = (torch.full((num_splits, total, heads, dim), float("nan"), device=dev),
                 torch.full((num_splits, total, heads), float("nan"), device=dev)) if num_splits > 1 else None
    paged_attention(q, k_cache, v_cache, cu, ctx, block_tables, max(q_lens), scale, out=out, num_splits=num_splits,
                    workspace=workspace)
    ref = _reference(q, k_cache, v_cache, q_lens, ctx_lens, block_tables, scale)
    err = (out.double() - ref).norm() / ref.norm()
    assert not out.isnan().any()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (32, 8), (64, 2)])
def test_decode_launched_longest_first_gives_the_same_values(kv_dtype, num_splits, heads, kv_heads):
    """A decode step's programs launched in `decode_order` (longest context first, padding rows last) compute
    exactly what the grid in row order does, in eager calls and replayed from a CUDA graph after the contexts
    changed (a group of 32 heads puts two row tiles in each sequence)."""
    from infertrace.engine.kernels.paged_attention import paged_attention
    from infertrace.engine.kernels.tiles import decode_order

    torch.manual_seed(2)
    dev, dim, block_size, rows = "cuda", 128, 16, 12
    num_blocks = rows * 2048 // block_size
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=dev).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=dev).to(kv_dtype)
    block_tables = torch.randperm(num_blocks, device=dev).view(rows, -1)
    q = torch.randn(rows, heads, dim, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(rows + 1, device=dev)
    ctx = torch.ones(rows, dtype=torch.long, device=dev)
    order = torch.arange(rows, device=dev)
    out = torch.full_like(q, float("nan"))

    def run():
        paged_attention(q, k_cache, v_cache, cu, ctx, block_tables, 1, dim ** -0.5, out=out, num_splits=num_splits,
                        seq_order=order)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ([5, 2048, 17, 640, 1, 1300, 64, 900], [1, 1, 2000, 3, 33, 128, 1024, 700, 1999, 12]):
        n = len(lens)  # rows past n are the padding of a graph's bucket: context 1
        ctx.copy_(torch.tensor(lens + [1] * (rows - n)))
        order.copy_(torch.from_numpy(decode_order(lens, rows)))
        want = paged_attention(q, k_cache, v_cache, cu, ctx, block_tables, 1, dim ** -0.5, num_splits=num_splits)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, want)
        out.fill_(float("nan"))
        run()
        assert torch.equal(out, want)
        ref = _reference(q[:n], k_cache.float(), v_cache.float(), [1] * n, lens, block_tables, dim ** -0.5)
        assert (out[:n].double() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("q_len", [64, 8192])
def test_paged_attention_over_a_64k_context(q_len):
    """A prefill chunk at the end of a 65,536-token context (bf16, 16 heads over 8 KV heads): the last query rows
    against a float64 reference over all keys."""
    from infertrace.engine.kernels.paged_attention import paged_attention

    torch.manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    ctx_len, block_size, heads, kv_heads, dim = 65536, 16, 16, 8, 128
    num_blocks = ctx_len // block_size + 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=dev)[: ctx_len // block_size][None].contiguous()
    q = torch.randn(q_len, heads, dim, device=dev, dtype=dtype)
    cu = torch.tensor([0, q_len], device=dev, dtype=torch.int64)
    ctx = torch.tensor([ctx_len], device=dev, dtype=torch.int64)
    out = paged_attention(q, k_cache, v_cache, cu, ctx, block_tables, q_len, dim**-0.5)
    rows = 4  # the last query rows see (nearly) every key
    ref = _reference(q[-rows:], k_cache, v_cache, [rows], [ctx_len], block_tables, dim**-0.5)
    err = (out[-rows:].double() - ref).norm() / ref.norm()
    assert err < 1e-2, float(err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (32, 8)])
def test_tile_list_grid_matches_the_per_sequence_grid(dtype, heads, kv_heads):
    """The grid of a token-count graph: a tile list padded with empty entries (sequence -1), replayed from a CUDA
    graph after the list and the lengths changed, gives the per-sequence grid's values (same BLOCK_M) and writes
    no row of a padding token."""
    from infertrace.engine.kernels.paged_attention import paged_attention
    from infertrace.engine.kernels.tiles import attention_tiles, max_attention_tiles, prefill_block_m

    torch.manual_seed(1)
    dev, dim, block_size, bucket, max_seqs = "cuda", 128, 16, 512, 32
    blocks_per_seq = bucket // block_size
    num_blocks = max_seqs * blocks_per_seq
    group = heads // kv_heads
    block_m = prefill_block_m(bucket, group)
    n_tiles = max_attention_tiles(bucket, max_seqs, group, block_m)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=dev).view(max_seqs, blocks_per_seq)
    q = torch.randn(bucket, heads, dim, device=dev, dtype=dtype)
    cu = torch.zeros(max_seqs + 1, dtype=torch.long, device=dev)
    ctx = torch.ones(max_seqs, dtype=torch.long, device=dev)
    tile_seq = torch.full((n_tiles,), -1, dtype=torch.long, device=dev)
    tile_index = torch.zeros_like(tile_seq)
    out = torch.full_like(q, float("nan"))

    def run():
        paged_attention(q, k_cache, v_cache, cu, ctx, block_tables, bucket, dim ** -0.5, out=out,
                        tiles=(tile_seq, tile_index, block_m))

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    # decode rows and prefill chunks; then one sequence of a whole bucket
    for q_lens, ctx_lens in (([1, 1, 37, 20, 1, 64, 3], [9, 120, 37, 100, 17, 120, 50]), ([bucket - 2], [bucket])):
        total = sum(q_lens)
        cu[: len(q_lens) + 1] = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)))
        ctx[: len(q_lens)] = torch.tensor(ctx_lens)
        seqs, index = attention_tiles(q_lens, group, block_m, n_tiles)
        tile_seq.copy_(torch.tensor(seqs))
        tile_index.copy_(torch.tensor(index))
        out.fill_(float("nan"))
        graph.replay()
        want = torch.full_like(q, float("nan"))
        paged_attention(q, k_cache, v_cache, cu[: len(q_lens) + 1], ctx[: len(q_lens)], block_tables[: len(q_lens)],
                        max(q_lens), dim ** -0.5, out=want)
        assert torch.equal(out[:total], want[:total])
        assert out[total:].isnan().all()
        ref = _reference(q[:total], k_cache, v_cache, q_lens, ctx_lens, block_tables, dim ** -0.5)
        assert (out[:total].double() - ref).norm() / ref.norm() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_cache_reads_as_its_widened_values(dtype):
    """An 8-bit cache: the store kernel rounds to nearest even and saturates; attention over it (decode rows with split
    KV, decode rows with the 8-bit decode tiling, and a prefill) gives in float32 what it gives over the same values
    widened, bit for bit, and under a bf16 q (float16 dots) the float64 reference's within bf16 rounding."""
    from infertrace.engine.kernels.paged_attention import paged_attention, store_kvcache

    torch.manual_seed(5)
    dev, heads, kv_heads, dim, block_size, num_blocks = "cuda", 32, 8, 128, 16, 64
    k8 = torch.zeros(num_blocks, block_size, kv_heads, dim, device=dev, dtype=torch.float8_e4m3fn)
    v8 = torch.zeros_like(k8)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:600]
    k_new = (torch.randn(600, kv_heads, dim, device=dev) * 200).to(dtype)  # some past +-448
    v_new = torch.randn_like(k_new)
    store_kvcache(k_new, v_new, k8, v8, slots)
    for cache, new in ((k8, k_new), (v8, v_new)):  # rounded to nearest even, saturated at +-448
        want = new.clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(cache.flatten(0, 1)[slots].view(torch.uint8), want.view(torch.uint8))
    k_wide, v_wide = k8.to(dtype), v8.to(dtype)
    block_tables = torch.randperm(num_blocks, device=dev).int().view(4, 16).contiguous()
    cases = (([1, 1, 1, 1], [200, 17, 256, 90], 4), ([1, 1, 1, 1], [200, 17, 256, 90], 1),
             ([30, 1, 64, 5], [30, 100, 256, 5], 1))
    for q_lens, ctx_lens, splits in cases:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        ctx = torch.tensor(ctx_lens, device=dev, dtype=torch.int32)
        q = torch.randn(sum(q_lens), heads, dim, device=dev, dtype=dtype)
        args = (cu, ctx, block_tables, max(q_lens), dim ** -0.5)
        out8 = paged_attention(q, k8, v8, *args, num_splits=splits)
        assert not out8.isnan().any()
        if dtype == torch.float32:
            tiling = (128, 4, 4) if max(q_lens) == 1 else None  # the 8-bit cache's decode tiling
            assert torch.equal(out8, paged_attention(q, k_wide, v_wide, *args, num_splits=splits, tiling=tiling))
        else:
            ref = _reference(q, k_wide, v_wide, q_lens, ctx_lens, block_tables, dim ** -0.5)
            err = (out8.double() - ref).norm() / ref.norm()
            assert err < 1e-2, err
            # the widening by the conversion instruction (the default here) gives the cast's float16 values
            other = paged_attention(q, k8, v8, *args, num_splits=splits, widen="cast")
            assert (other.float() - out8.float()).abs().max() <= 1e-3 * out8.float().abs().max()
