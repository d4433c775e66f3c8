"""Kernel names: HTA's type with non-nccl collectives as communication, inference categories, short names."""

from __future__ import annotations

import pytest

from infertrace.analyze.kernels import category, hta_kernel_type, short_name


@pytest.mark.parametrize("name, kernel_type", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "COMMUNICATION"),
    ("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)", "COMMUNICATION"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals)", "COMMUNICATION"),
    ("void tensorrt_llm::kernels::oneShotAllReduceKernel<__nv_bfloat16, 8>(AllReduceParams)", "COMMUNICATION"),
    ("Memcpy DtoD (Device -> Device)", "MEMORY"),
    # traceinsight 0.6.1 tests `^hip` (communication) before its own memory pattern, which names these
    ("hipMemcpyAsync", "MEMORY"),
    ("hipMemsetD32Async", "MEMORY"),
    # and counts any `nccl...` name as communication, where 0.5.0 needed `nccl...Kernel`
    ("ncclDevFunc_AllReduce_RING_LL_Sum_bf16", "COMMUNICATION"),
    ("void at::native::reduce_kernel<512, 1>(at::native::ReduceOp<float>)", "COMPUTATION"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "COMPUTATION"),
])
def test_kernel_type(name, kernel_type):
    assert hta_kernel_type(name) == kernel_type


@pytest.mark.parametrize("name, expected", [
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128> >(Flash_fwd_params)", "attention"),
    ("fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentContext", "attention"),
    ("_ZN7ck_tile6kentryILi2ENS_38FmhaBatchPrefillWithPagedKVCacheKernelINS_40BlockFmh", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>(__nv_bfloat16 const*)", "attention"),
    ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT128x256x32_MI16x16x1", "GEMM"),
    ("nvjet_tst_64x64_64x16_2x1_2cta_v_bz_bias_TNT", "GEMM"),
    ("bmm_MxE4m3_MxE2m1MxE4m3_Fp32_t128x16x256u2_s3_clmp_swiGlu_dynBatch_sm100f", "GEMM"),  # fused SwiGLU
    ("_ZN5aiter24add_rmsnorm_quant_kernelIDF16bDF16bLi64ELi8ELb0ELb0ELb1ELi1EEEvPT0_PT", "norm"),
    ("std::enable_if<true, void>::type vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*)", "norm"),
    (("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)"
      "::{lambda()#1}>(int)"), "activation"),
    ("_ZN7sgl_hip10activation18act_and_mul_kernelI14__hip_bfloat16", "activation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)", "elementwise"),
    ("triton_poi_fused_add_mul_0", "elementwise"),
    ("void vllm::cross_device_reduce_2stage<float, 8>(vllm::RankData*)", "communication"),
    # argument types say nothing about the kernel
    ("void tensorrt_llm::kernels::quantize_with_block_size<2, __nv_bfloat16>(int, flashinfer::QuantizationSFLayout)",
     "other"),
    ("void bounds_check_indices_kernel<long, false>(at::Accessor<long>, fbgemm_gpu::FixedDivisor)", "other"),
])
def test_category(name, expected):
    assert category(name) == expected


@pytest.mark.parametrize("name, expected", [
    # the Triton kernels of infertrace's engine
    ("_paged_attention_kernel", "attention"),
    ("_merge_splits_kernel", "attention"),  # combines the split-KV partial results of paged attention
    ("_store_kvcache_kernel", "attention"),  # KV-cache writes count as attention, as vLLM's reshape_and_cache
    ("_add_rmsnorm_kernel", "norm"),
    ("_qk_norm_rope_kernel", "norm"),  # QK RMSNorm fused with RoPE
    ("_silu_mul_kernel", "activation"),
    ("_qkv_norm_rope_kernel", "GEMM"),  # the qkv projection with the q/k norm, RoPE and K/V write after it
    ("_gate_up_silu_kernel", "GEMM"),  # the gate/up projection with SiLU-and-multiply after it
    # their counterparts elsewhere
    ("void flashinfer::MergeStatesKernel<8u, 16u, 8u, 4u, __nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, float*)",
     "attention"),
    ("void flashinfer::MergeStateInPlaceKernel<8u, 16u, __nv_bfloat16>(__nv_bfloat16*, float*)", "attention"),
    ("_fwd_kernel_stage1", "attention"),  # SGLang's and vLLM's Triton decode attention
    ("_fwd_grouped_kernel_stage1", "attention"),
    ("_fwd_kernel_stage2", "attention"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*)", "attention"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(cublasLt::cublasSplitKParams<float>)",
     "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)", "GEMM"),
])
def test_category_of_engine_kernels(name, expected):
    assert category(name) == expected


def test_copies_are_memcpy_whatever_their_name():
    assert category("anything", kind="memcpy") == category("x", kind="memset") == "memcpy/memset"


@pytest.mark.parametrize("name, short", [
    (("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, "
      "std::array<char*, 1ul> >(int, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)"),
     "vectorized_elementwise_kernel<FillFunctor>"),
    ("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsigned long)",
     "multimem_all_reduce_kernel"),
    (("std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type "
      "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long)"), "vllm::fused_add_rms_norm_kernel"),
    ("_ZN7ck_tile6kentryILi2ENS_38FmhaBatchPrefillWithPagedKVCacheKernelINS_40BlockFmh",
     "ck_tile::kentry<FmhaBatchPrefillWithPagedKVCacheKernel>"),
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4>(Params)",
     "cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4>"),
    ("Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD (Pinned -> Device)"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "ncclDevKernel_AllGather_RING_LL"),
    ("gemv_kernel", "gemv_kernel"),
])
def test_short_name(name, short):
    assert short_name(name) == short


def test_short_names_have_a_width():
    assert len(short_name("x" * 200, width=40)) == 40
