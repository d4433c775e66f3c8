"""The decode GEMM that copies its first weights before its programmatic-dependent-launch wait
(kernels/skinny_gemm.py, Gluon), compiled for an H100/H200 (sm_90) on the CPU: the copies ahead of the wait are
exactly the first STAGES - 1 tiles of weights, 16 bytes a copy, and x is copied only after it. Its products are
checked on the GPU (test_decode_kernels_gpu.py)."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
if not triton.__version__.startswith("3.6."):  # skinny_gemm.GLUON_TRITON: the engine takes the kernel there only
    pytest.skip(f"the early kernel is written for Triton 3.6's Gluon, not {triton.__version__}", allow_module_level=True)


def _compiled(block_n: int, block_k: int, split_k: int, stages: int, silu: bool = False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from infertrace.engine.kernels.skinny_gemm import _skinny_gemm_early_kernel

    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16" if silu else "*fp32", "M": "i32", "N": "i32",
                 "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "stride_ys": "i32",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr",
                 "STAGES": "constexpr", "PDL": "constexpr", "SILU": "constexpr"}
    constants = {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "STAGES": stages,
                 "PDL": True, "SILU": silu}
    # as Triton's launcher specializes them: pointers, N, K and the strides divisible by 16 (M, 8 rows, is not)
    divisible = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4, 5, 6, 7, 8, 9)}
    source = GluonASTSource(_skinny_gemm_early_kernel, signature, constants, divisible)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def _ptx(block_n: int, block_k: int, split_k: int, stages: int, silu: bool = False) -> str:
    return _compiled(block_n, block_k, split_k, stages, silu).asm["ptx"]


@pytest.mark.parametrize(("block_n", "block_k", "split_k", "stages"), [(64, 128, 4, 6), (32, 128, 1, 5),
                                                                        (32, 128, 2, 4)])
def test_the_first_tiles_of_weights_are_copied_before_the_wait(block_n, block_k, split_k, stages):
    lines = _ptx(block_n, block_k, split_k, stages).splitlines()
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    assert len(wait) == 1
    copies = [i for i, line in enumerate(lines) if re.search(r"cp\.async\.\w+\.shared\.global .*, 0x10", line)]
    threads = 4 * 32
    weights_ahead = (stages - 1) * block_n * block_k * 2 // 16 // threads  # 16-byte copies a thread
    x_first = (stages - 1) * 16 * block_k * 2 // 16 // threads
    before = [i for i in copies if i < wait[0]]
    assert len(before) == weights_ahead
    after = [i for i in copies if i > wait[0]]
    # after the wait: the first tiles' x, then the loop's copies of a tile of weights and its x
    assert len(after) >= x_first + (block_n + 16) * block_k * 2 // 16 // threads
    assert any("mma.sync" in line for line in lines[wait[0]:])


@pytest.mark.parametrize(("block_n", "stages"), [(32, 5), (64, 3)])
def test_the_silu_epilogue_lets_the_next_kernel_launch_after_its_last_multiply(block_n, stages):
    """With SiLU-and-multiply in the epilogue the kernel after it is the down projection's GEMM, whose programs, let
    in at the wait, took the SMs from this one's later programs (3 us a layer slower on an H200): the launch of
    dependents comes after the last mma.sync and before the stores; the first weights still come before the wait,
    the tile's halves go through shared memory (the pipeline's: no more than it, as `early_max_stages` counts), and
    SiLU's exponential is there."""
    plain = _ptx(block_n, 128, 1, stages).splitlines()
    kernel = _compiled(block_n, 128, 1, stages, silu=True)
    lines = kernel.asm["ptx"].splitlines()
    assert kernel.metadata.shared == stages * (16 + block_n) * 128 * 2

    def where(text, in_lines):
        return [i for i, line in enumerate(in_lines) if text in line]

    wait, launch, mma, stores = (where(t, lines) for t in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                                           "mma.sync", "st.global"))
    assert len(wait) == 1 and len(launch) == 1 and stores
    assert max(mma) < launch[0] < min(stores)
    # the plain kernel lets the kernel after it in at the wait, before any multiply
    assert where("griddepcontrol.launch_dependents", plain)[0] < min(where("mma.sync", plain))
    copies = [i for i, line in enumerate(lines) if re.search(r"cp\.async\.\w+\.shared\.global .*, 0x10", line)]
    assert len([i for i in copies if i < wait[0]]) == (stages - 1) * block_n * 128 * 2 // 16 // 128
    assert where("stmatrix", lines) and where("ex2.approx", lines)
