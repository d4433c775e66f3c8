"""The decode path's weight-streaming GEMM and fused kernels against plain torch (GPU only)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _linear_ref(x, w):
    return (x.double() @ w.double().T)


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("n, k", [(2560, 4096), (6144, 2560), (1000, 1200), (151936, 256)])
@pytest.mark.parametrize("split_k", [1, 2, 3, 4])
@pytest.mark.parametrize("early", [False, True])  # the Gluon kernel copying its first weights before its wait
def test_skinny_gemm_matches_matmul(rows, n, k, split_k, early):
    from infertrace.engine.kernels.skinny_gemm import early_available, skinny_gemm

    if early and not early_available():
        pytest.skip("no Gluon in this Triton, or a GPU before compute capability 8.0")
    torch.manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    ref = _linear_ref(x, w)
    if split_k == 1:
        got = skinny_gemm(x, w, block_n=64, block_k=256, early=early)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    else:  # float32 partial sums, a plane a slice of K (K need not divide evenly)
        workspace = torch.full((split_k + 1, rows, n), float("nan"), device="cuda")
        got = skinny_gemm(x, w, workspace, block_n=64, block_k=128, split_k=split_k, early=early)
        assert got.shape == (split_k, rows, n) and got.data_ptr() == workspace.data_ptr()
        assert not got.isnan().any() and workspace[split_k].isnan().all()
        got = got.sum(0)
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-2, float(err)


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_sums_are_deterministic(split_k):
    from infertrace.engine.kernels.norm import add_rmsnorm
    from infertrace.engine.kernels.skinny_gemm import skinny_gemm

    torch.manual_seed(2)
    x = torch.randn(8, 9728, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2560, 9728, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(2560, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(5):
        residual = torch.zeros(8, 2560, device="cuda", dtype=torch.bfloat16)
        add_rmsnorm(skinny_gemm(x, w, block_n=64, block_k=128, split_k=split_k), residual, norm_w, 1e-6)
        runs.append(residual)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("planes", [1, 2, 4])
def test_add_rmsnorm_adds_split_k_planes_in_order(planes):
    from infertrace.engine.kernels.norm import add_rmsnorm

    torch.manual_seed(3)
    parts = torch.randn(planes, 8, 2560, device="cuda", dtype=torch.float32) * 1e3
    parts[0, :, :5] = 1e8  # large terms first: a different order of the sum rounds differently
    parts[-1, :, :5] = -1e8
    residual = torch.randn(8, 2560, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2560, device="cuda", dtype=torch.bfloat16)
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    want_residual = residual.clone()
    want = add_rmsnorm(total.to(torch.bfloat16), want_residual, weight, 1e-6)
    got = add_rmsnorm(parts, residual, weight, 1e-6)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(residual, want_residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, hq, hkv, d", [(256, 16, 8, 128), (5, 32, 8, 128), (3, 10, 2, 64)])
def test_qk_norm_rope_matches_the_unfused_model(dtype, t, hq, hkv, d):
    """The fused kernel (several heads a program, head counts that do not fill its last tile) against the model's
    own RMSNorm and rotary modules: in float32 up to the order of the sum of squares; in bfloat16 within a rounding
    step of the largest value (on the H100 about 18% of the values are one bf16 step from what torch's CUDA ops give,
    with this kernel and the one-head-a-program kernel before it alike, 2026-11-25)."""
    from infertrace.engine.kernels.fused import qk_norm_rope
    from infertrace.engine.models.qwen3 import RMSNorm, RotaryEmbedding

    torch.manual_seed(t + hq)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=dtype)
    q_norm, k_norm = RMSNorm(d, 1e-6, dtype).cuda(), RMSNorm(d, 1e-6, dtype).cuda()
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(d) * 0.5 + 1)
        k_norm.weight.copy_(torch.randn(d) * 0.5 + 1)
    rope = RotaryEmbedding(d, 1e6, 4096, torch.device("cuda"))
    positions = torch.randint(0, 4096, (t,), device="cuda")
    q, k = qk_norm_rope(qkv, hq, hkv, d, q_norm.weight, k_norm.weight, 1e-6, rope.cos, rope.sin, positions)
    with torch.no_grad():
        q_in, k_in, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q_ref, k_ref = rope(positions, q_norm(q_in.reshape(t, hq, d)), k_norm(k_in.reshape(t, hkv, d)))
    for got, want in ((q, q_ref), (k, k_ref)):
        assert got.shape == want.shape and not got.isnan().any()
        if dtype == torch.float32:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), float((got - want).abs().max())
        else:
            diff = (got.float() - want.float()).abs()
            assert diff.max() <= 2**-6 * want.float().abs().max(), float(diff.max())


def test_qk_norm_rope_writes_the_cache_like_the_store_kernel():
    from infertrace.engine.kernels.fused import qk_norm_rope
    from infertrace.engine.kernels.paged_attention import store_kvcache

    torch.manual_seed(4)
    t, hq, hkv, d = 8, 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    qw = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    kw = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(100, 100 + t, device="cuda")
    cos = torch.randn(4096, d, device="cuda")
    sin = torch.randn(4096, d, device="cuda")
    slots = torch.tensor([5, 17, 40, -1, 3, 64, 65, -1], device="cuda")
    k_cache = torch.zeros(128, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q, k = qk_norm_rope(qkv, hq, hkv, d, qw, kw, 1e-6, cos, sin, positions, kv_cache=(k_cache, v_cache, slots))
    q_ref, k_ref = qk_norm_rope(qkv, hq, hkv, d, qw, kw, 1e-6, cos, sin, positions)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    k_want = torch.zeros(8, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_want = torch.zeros_like(k_want)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    store_kvcache(k_ref, v, k_want, v_want, slots)
    assert torch.equal(k_cache, k_want.view_as(k_cache)) and torch.equal(v_cache, v_want.view_as(v_cache))


@pytest.mark.parametrize("planes", [2, 4])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_qk_norm_rope_adds_split_k_planes_in_order(planes, cache_dtype):
    """Partial sums of a split-K qkv projection give what their in-order sum, rounded to bf16, gives: q, k, and the
    K/V written to the cache."""
    from infertrace.engine.kernels.fused import qk_norm_rope

    torch.manual_seed(planes)
    t, hq, hkv, d = 8, 32, 8, 128
    parts = torch.randn(planes, t, (hq + 2 * hkv) * d, device="cuda") * 3
    parts[0, :, ::7] += 1e4  # large terms: a different order of the sum rounds differently
    parts[-1, :, ::7] -= 1e4
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    qw = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    kw = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(50, 50 + t, device="cuda")
    cos, sin = torch.randn(128, d, device="cuda"), torch.randn(128, d, device="cuda")
    slots = torch.tensor([5, 17, 40, -1, 3, 64, 65, 100], device="cuda")
    caches = {}
    for name, qkv in (("planes", parts), ("summed", total.to(torch.bfloat16))):
        k_cache = torch.zeros(128, hkv, d, device="cuda", dtype=cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        q, k = qk_norm_rope(qkv, hq, hkv, d, qw, kw, 1e-6, cos, sin, positions, kv_cache=(k_cache, v_cache, slots))
        assert q.dtype == k.dtype == torch.bfloat16
        caches[name] = (q, k, k_cache.view(torch.uint8), v_cache.view(torch.uint8))
    assert caches["summed"][3].any()
    for got, want in zip(caches["planes"], caches["summed"], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows, hidden, hq, hkv, block_k", [(8, 2560, 32, 8, 128), (3, 1024, 16, 8, 64),
                                                            (16, 1000, 4, 2, 128)])
def test_qkv_norm_rope_is_the_skinny_gemm_then_the_qk_norm(cache_dtype, rows, hidden, hq, hkv, block_k):
    """One kernel a head against the unsplit skinny GEMM then qk_norm_rope: V (no norm) bit for bit; q and K through
    the same roundings, their norms' sums perhaps added in another order (within a bf16 rounding step)."""
    from infertrace.engine.kernels.fused import qk_norm_rope, qkv_norm_rope
    from infertrace.engine.kernels.skinny_gemm import skinny_gemm

    torch.manual_seed(rows + hidden)
    d = 128
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn((hq + 2 * hkv) * d, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    q_w, k_w = [(torch.rand(d, device="cuda") + 0.5).to(torch.bfloat16) for _ in range(2)]
    cos, sin = torch.randn(4096, d, device="cuda"), torch.randn(4096, d, device="cuda")
    positions = torch.arange(rows, device="cuda") * 37 + 5
    slots = torch.randperm(64, device="cuda")[:rows]
    slots[-1] = -1  # a padding row: writes nothing
    caches = [[torch.full((64, hkv, d), 0.25, device="cuda").to(cache_dtype) for _ in range(2)] for _ in range(2)]
    qkv = skinny_gemm(x, w, block_n=64, block_k=block_k)
    q_ref, _ = qk_norm_rope(qkv, hq, hkv, d, q_w, k_w, 1e-6, cos, sin, positions, kv_cache=(*caches[0], slots))
    q = qkv_norm_rope(x, w, hq, hkv, d, q_w, k_w, 1e-6, cos, sin, positions, (*caches[1], slots), block_k=block_k)
    assert q.shape == q_ref.shape and q.dtype == torch.bfloat16
    assert torch.equal(caches[1][1].float(), caches[0][1].float())  # V
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=2**-7, atol=1e-5)
    # a K one bf16 step apart can round to neighbouring float8 values (2**-3 apart)
    torch.testing.assert_close(caches[1][0].float(), caches[0][0].float(), atol=1e-5,
                               rtol=2**-7 if cache_dtype == torch.bfloat16 else 2**-3)
    untouched = torch.ones(64, dtype=torch.bool, device="cuda")
    untouched[slots[:-1]] = False
    assert (caches[1][0][untouched].float() == 0.25).all() and (caches[1][1][untouched].float() == 0.25).all()


@pytest.mark.parametrize("rows, hidden, inter, block_n, block_k", [(8, 2560, 9728, 64, 128), (3, 1024, 3072, 32, 128),
                                                                    (16, 1000, 700, 64, 256)])
def test_gate_up_silu_is_the_skinny_gemm_then_silu_mul(rows, hidden, inter, block_n, block_k):
    """The same tiles in the same order, then silu_mul's roundings: bit for bit (with a partial column band and,
    at hidden 1000, a partial last K tile)."""
    from infertrace.engine.kernels.fused import gate_up_silu, silu_mul
    from infertrace.engine.kernels.skinny_gemm import skinny_gemm

    torch.manual_seed(rows + inter)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    ref = silu_mul(skinny_gemm(x, w, block_n=32, block_k=block_k))
    got = gate_up_silu(x, w, block_n=block_n, block_k=block_k)
    assert got.shape == (rows, inter) and torch.equal(got, ref)


@pytest.mark.parametrize("rows, hidden, inter, block_n, block_k, stages", [
    (8, 5120, 4352, 32, 128, 5),  # qwen3-14b's TP=4 shard, its tiling
    (8, 5120, 8704, 32, 128, 3),  # TP=2
    (3, 704, 1000, 64, 128, 4),  # a partial last band of gate/up rows and a partial last K tile
    (16, 2560, 2432, 32, 256, 4),
])
def test_gate_up_silu_early_is_the_early_gemm_then_silu_mul(rows, hidden, inter, block_n, block_k, stages):
    """The early kernel with SiLU-and-multiply in its epilogue (each program half gate rows, half the same up rows):
    the early GEMM's product at the same block_k, then silu_mul's roundings, bit for bit."""
    from infertrace.engine.kernels import skinny_gemm as sg
    from infertrace.engine.kernels.fused import silu_mul

    if not sg.early_available():
        pytest.skip("no Gluon in this Triton, or a GPU before compute capability 8.0")
    torch.manual_seed(rows + inter)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    ref = silu_mul(sg.skinny_gemm(x, w, block_n=64, block_k=block_k, early=True))
    was = sg._early
    try:
        assert sg.gate_up_silu_early(x, w, block_n=block_n, block_k=block_k, num_stages=stages) is None or was
        sg.set_early(True)
        got = sg.gate_up_silu_early(x, w, block_n=block_n, block_k=block_k, num_stages=stages)
    finally:
        sg.set_early(was)
    assert got.shape == (rows, inter) and torch.equal(got, ref)
    assert got.abs().max() > 0.1  # values, not zeros on both sides


@pytest.mark.parametrize("rows, n, k, block_n, stages", [
    (8, 5120, 1280, 64, 6),  # qwen3-14b's TP=4 output projection, its tiling
    (8, 5120, 4352, 64, 5),  # its down projection, unsplit (the rules' tiling)
    (3, 1000, 704, 32, 4),  # a partial last band and a partial last K tile
    (16, 2560, 2432, 64, 5),
])
def test_the_pushing_gemm_puts_its_product_where_the_all_reduce_kernel_reads_it(rows, n, k, block_n, stages):
    """`skinny_gemm(..., push=)`: the product (the unpushed kernel's bits, rounded to bf16, -0.0 as +0.0) in slot
    k mod 3 of every rank's buffer at this rank's place, and nothing else written."""
    from infertrace.engine.kernels.allreduce_norm import EMPTY_HALF_BITS
    from infertrace.engine.kernels.skinny_gemm import skinny_gemm

    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    want = skinny_gemm(x, w, block_n=block_n, block_k=128, num_stages=stages, early=False).view(torch.int16)
    want = torch.where(want == EMPTY_HALF_BITS, torch.zeros_like(want), want)
    assert want.abs().max() > 0
    world, rank, max_rows = 4, 2, 16
    epoch, call, calls = torch.tensor([7], device="cuda"), 2, 3  # call 7 * 3 + 2 = 23: slot 2
    buffers = [torch.full((3, world, max_rows, n), EMPTY_HALF_BITS, dtype=torch.int16, device="cuda")
               for _ in range(world)]
    addresses = torch.tensor([b.data_ptr() for b in buffers], device="cuda")
    assert skinny_gemm(x, w, block_n=block_n, block_k=128, num_stages=stages,
                       push=(addresses, epoch, call, calls, rank, world, max_rows, True)) is None
    torch.cuda.synchronize()
    for b in buffers:
        assert torch.equal(b[2, rank, :rows], want)
        b[2, rank, :rows] = EMPTY_HALF_BITS
        assert (b == EMPTY_HALF_BITS).all()  # nothing else written


def test_qk_norm_rope_rounds_k_and_v_into_a_float8_cache():
    from infertrace.engine.kernels.fused import qk_norm_rope

    torch.manual_seed(6)
    t, hq, hkv, d = 8, 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16) * 100
    qw = torch.randn(d, device="cuda", dtype=torch.bfloat16) * 100
    kw = torch.randn(d, device="cuda", dtype=torch.bfloat16) * 100
    positions = torch.arange(3, 3 + t, device="cuda")
    cos, sin = torch.randn(64, d, device="cuda"), torch.randn(64, d, device="cuda")
    slots = torch.tensor([5, 17, 40, -1, 3, 64, 65, 100], device="cuda")
    k_cache = torch.zeros(128, hkv, d, device="cuda", dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    _, k = qk_norm_rope(qkv, hq, hkv, d, qw, kw, 1e-6, cos, sin, positions, kv_cache=(k_cache, v_cache, slots))
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    used = slots >= 0
    want_k = torch.zeros_like(k_cache)
    want_v = torch.zeros_like(v_cache)
    # rounded to nearest even, saturated at +-448
    want_k.view(torch.uint8)[slots[used]] = k[used].clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    want_v.view(torch.uint8)[slots[used]] = v[used].clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert k.abs().max() > 448  # saturation is exercised
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))


def test_embed_rmsnorm_is_the_lookup_then_the_norm():
    from infertrace.engine.kernels.norm import add_rmsnorm, embed_rmsnorm

    torch.manual_seed(4)
    table = torch.randn(1000, 2560, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2560, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([5, 0, 999, 5, 17, 0, 0, 640], device="cuda")  # repeats, and graph padding's id 0
    h, residual = embed_rmsnorm(ids, table, weight, 1e-6)
    want_residual = torch.nn.functional.embedding(ids, table)
    assert torch.equal(residual, want_residual)
    assert torch.equal(h, add_rmsnorm(want_residual.clone(), None, weight, 1e-6))


@pytest.mark.parametrize("ranks", [2, 4])
def test_embed_shard_planes_add_up_to_the_lookup(ranks):
    """A vocabulary-parallel embedding's shards (the last one padded with zero rows): each rank's float32 plane holds
    its own tokens' rows and zeros elsewhere, the planes summed over the ranks are the lookup exactly, the residual
    starts as zeros, and the norm of (the summed planes + that residual) is `embed_rmsnorm`'s bit for bit, as the
    all-reduce + norm kernel computes it on every rank."""
    from infertrace.engine.kernels.norm import add_rmsnorm, embed_rmsnorm, embed_shard

    torch.manual_seed(5)
    vocab, hidden = 1001, 2560
    table = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([5, 0, 1000, 5, 17, 0, 500, 640, 251], device="cuda")
    shard = -(-vocab // ranks)
    padded = torch.cat([table, table.new_zeros(shard * ranks - vocab, hidden)])
    total = torch.zeros(ids.shape[0], hidden, device="cuda")
    for rank in range(ranks):
        plane, residual = embed_shard(ids, padded[rank * shard:(rank + 1) * shard].contiguous(), rank * shard)
        assert plane.shape == (1, ids.shape[0], hidden) and plane.dtype == torch.float32
        assert torch.equal(residual, torch.zeros_like(residual)) and residual.dtype == table.dtype
        mine = (ids >= rank * shard) & (ids < (rank + 1) * shard)
        assert torch.equal(plane[0][~mine], torch.zeros_like(plane[0][~mine]))
        total += plane[0]
    lookup = torch.nn.functional.embedding(ids, table)
    assert torch.equal(total.to(table.dtype), lookup)
    residual = torch.zeros_like(lookup)
    h = add_rmsnorm(total[None].contiguous(), residual, weight, 1e-6)
    assert torch.equal(residual, lookup)
    assert torch.equal(h, embed_rmsnorm(ids, table, weight, 1e-6)[0])


@pytest.mark.parametrize("rows, vocab, dtype", [(8, 151936, torch.bfloat16), (3, 1000, torch.bfloat16),
                                                (5, 9000, torch.float32), (1, 4096, torch.float16)])
def test_argmax_rows_is_torch_argmax_with_ties_to_the_first(rows, vocab, dtype):
    from infertrace.engine.kernels.argmax import CHUNK, argmax_rows

    torch.manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, device="cuda").to(dtype)
    top = logits.max() + 1
    # ties at the maximum: within a chunk, across a chunk boundary, and the last column alone
    logits[0, [vocab - 1, 7, 3]] = top
    if rows > 1:
        logits[1, [min(CHUNK, vocab - 1), CHUNK - 1 if vocab > CHUNK else 1]] = top
    if rows > 2:
        logits[2, vocab - 1] = top
    if rows > 3:
        logits[3] = float("-inf")  # nothing above -inf: index 0, as torch gives
    got = argmax_rows(logits)
    assert got.dtype == torch.long
    assert torch.equal(got, torch.argmax(logits, dim=-1))
    assert int(got[0]) == 3
    view = torch.randn(rows, vocab + 64, device="cuda").to(dtype)[:, :vocab]  # rows apart by more than the vocab
    assert torch.equal(argmax_rows(view), torch.argmax(view, dim=-1))
