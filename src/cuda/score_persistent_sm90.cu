/* The `persistent` backend's scorer (sm_90a): one CTA per SM walks a device-built task list (row
 * tile x page chunk, persistent_schedule.h), warp-specialized into one producer warp
 * (persistent_producer_sm90.cuh) and two consumer warpgroups (persistent_consumer_sm90.cuh) that
 * meet at a ring of key pages in shared memory. This translation unit holds the kernel and its
 * launch; the backend's host side (tensor maps, admission, plan) is persistent_backend_sm90.cu.
 *
 * E4M3 at the default precision runs E4M3 wgmma on the pages as TMA wrote them: Hopper's FP8
 * tensor cores keep 13 bits below each sum's largest term (MSAIDX_FP8_ACCUMULATION_DOT_BOUND).
 * Exact precision widens the pages to FP16 for FP16 wgmma, exact products summed in FP32 (SPEC
 * section 3): two more warps of the producer warpgroup widen each page into a second ring that the
 * consumers read (persistent_widener_sm90.cuh). BF16 is always exact: BF16 wgmma with FP32
 * accumulation on the pages as TMA wrote them. */
#include "persistent_consumer_sm90.cuh"
#include "persistent_producer_sm90.cuh"

namespace {

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* Device code for another architecture: wgmma and setmaxnreg exist on sm_90a only, and
 * supports() keeps this backend off builds without it. The stubs take one thread: a launch of the
 * scorer would fail, and cudaFuncGetAttributes tells them from the scorer without a copy or a
 * stream (msaidx_persistent_check_sm90a_code). */
template <bool kFastAccumulation, bool kMaxima>
__global__ void __launch_bounds__(1)
    persistent_score_kernel(const __grid_constant__ CUtensorMap,
                            const __grid_constant__ CUtensorMap, const ScoreArgs) {}
template <bool kMaxima>
__global__ void __launch_bounds__(1)
    persistent_bf16_score_kernel(const __grid_constant__ CUtensorMap,
                                 const __grid_constant__ CUtensorMap, const ScoreArgs) {}
#else
/* The kernel's body on one key path (kMaxima: a fused call's, which keeps each task's row maxima);
 * q_map and k_map point at the kernel's __grid_constant__ parameters, where TMA reads them. */
template <KeyPath kPath, bool kMaxima>
__device__ __forceinline__ void score_tasks(const CUtensorMap *q_map, const CUtensorMap *k_map,
                                            const ScoreArgs &args) {
    using L = Layout<kPath>;
    extern __shared__ uint8_t smem_raw[];
    constexpr int kStages = L::kStages;
    SharedState smem;
    smem.q_tiles = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    smem.wide_pages = smem.q_tiles + kQSlots * L::kQSlotBytes;
    smem.pages = smem.wide_pages + L::kWideBytes;
    smem.page_full = (uint64_t *)(smem.pages + kStages * L::kStageBytes);
    smem.page_empty = smem.page_full + kStages;
    smem.q_full = smem.page_empty + kStages;
    smem.q_empty = smem.q_full + kQSlots;
    smem.wide_full = smem.q_empty + kQSlots;
    smem.wide_empty = smem.wide_full + L::kWideStages;
    smem.q_tasks = (Task *)(smem.wide_empty + L::kWideStages);

    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(&smem.page_full[s], 1);
            mbarrier_init(&smem.page_empty[s], L::kKeyStageReaders);
        }
        /* The wideners read each task's page range from its Q slot, so they release it too. */
        constexpr int kQSlotReaders = kConsumerThreads + (L::kWideStages > 0 ? kWidenerThreads : 0);
        for (int s = 0; s < kQSlots; ++s) {
            mbarrier_init(&smem.q_full[s], 1);
            mbarrier_init(&smem.q_empty[s], kQSlotReaders);
        }
        for (int s = 0; s < L::kWideStages; ++s) {
            mbarrier_init(&smem.wide_full[s], kWidenerThreads);
            mbarrier_init(&smem.wide_empty[s], kConsumerThreads);
        }
        mbarrier_init_fence();
    }
    __syncthreads();
    msaidx_wait_for_prior_grids();

    const int32_t num_tasks = args.counts->num_tasks;
    const int lane = threadIdx.x & 31;
    if (threadIdx.x < 128) {
        run_producer<kPath>(smem, q_map, k_map, args, lane);
        return;
    }
    run_consumers<kPath, kMaxima>(smem, args, num_tasks, lane);
}

template <bool kFastAccumulation, bool kMaxima>
__global__ void __launch_bounds__(kThreads, 1)
    persistent_score_kernel(const __grid_constant__ CUtensorMap q_map,
                            const __grid_constant__ CUtensorMap k_map, const ScoreArgs args) {
    score_tasks<kFastAccumulation ? KeyPath::kE4m3Fast : KeyPath::kE4m3Exact, kMaxima>(
        &q_map, &k_map, args);
}

template <bool kMaxima>
__global__ void __launch_bounds__(kThreads, 1)
    persistent_bf16_score_kernel(const __grid_constant__ CUtensorMap q_map,
                                 const __grid_constant__ CUtensorMap k_map, const ScoreArgs args) {
    score_tasks<KeyPath::kBf16, kMaxima>(&q_map, &k_map, args);
}
#endif

} // namespace

/* A query of the kernel's attributes, not a copy from the device: it touches no stream, so a
 * context created while the thread captures a graph neither breaks the capture nor reads its
 * failure as "no sm_90a code". */
msaidx_status msaidx_persistent_check_sm90a_code(void) {
    cudaFuncAttributes attributes;
    const cudaError_t error =
        cudaFuncGetAttributes(&attributes, persistent_score_kernel<true, false>);
    const bool no_code =
        error == cudaErrorInvalidDeviceFunction || error == cudaErrorNoKernelImageForDevice;
    if (!no_code) MSAIDX_CUDA_TRY(error, "cudaFuncGetAttributes(persistent scorer)");
    if (no_code || attributes.maxThreadsPerBlock < kThreads) {
        cudaGetLastError();
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend persistent: this build of msaidx has no sm_90a code "
                           "(CMAKE_CUDA_ARCHITECTURES must include 90a)");
    }
    return MSAIDX_SUCCESS;
}

namespace {

/* The shared memory limit of a scorer with or without the fused call's maxima. */
template <bool kMaxima>
msaidx_status set_scorer_attributes(void) {
    MSAIDX_CUDA_TRY(cudaFuncSetAttribute(persistent_score_kernel<false, kMaxima>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)Layout<KeyPath::kE4m3Exact>::kSmemBytes),
                    "cudaFuncSetAttribute(persistent scorer shared memory)");
    MSAIDX_CUDA_TRY(cudaFuncSetAttribute(persistent_score_kernel<true, kMaxima>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)Layout<KeyPath::kE4m3Fast>::kSmemBytes),
                    "cudaFuncSetAttribute(persistent fast-accumulation scorer shared memory)");
    MSAIDX_CUDA_TRY(cudaFuncSetAttribute(persistent_bf16_score_kernel<kMaxima>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)Layout<KeyPath::kBf16>::kSmemBytes),
                    "cudaFuncSetAttribute(persistent BF16 scorer shared memory)");
    return MSAIDX_SUCCESS;
}

template <bool kMaxima>
msaidx_status launch_scorer(const msaidx_plan *plan, const CUtensorMap *q_map,
                            const CUtensorMap *k_map, const ScoreArgs &args, cudaStream_t stream) {
    const dim3 grid(plan->context->num_sms), block(kThreads);
    if (plan->context->config.dtype == MSAIDX_DTYPE_BF16)
        MSAIDX_CUDA_TRY(msaidx_launch_dependent(persistent_bf16_score_kernel<kMaxima>, grid, block,
                                                Layout<KeyPath::kBf16>::kSmemBytes, stream, *q_map,
                                                *k_map, args),
                        "persistent_bf16_score_kernel launch");
    else if (msaidx_fp8_accumulation(&plan->context->config))
        MSAIDX_CUDA_TRY(msaidx_launch_dependent(persistent_score_kernel<true, kMaxima>, grid, block,
                                                Layout<KeyPath::kE4m3Fast>::kSmemBytes, stream,
                                                *q_map, *k_map, args),
                        "persistent_score_kernel launch");
    else
        MSAIDX_CUDA_TRY(msaidx_launch_dependent(persistent_score_kernel<false, kMaxima>, grid,
                                                block, Layout<KeyPath::kE4m3Exact>::kSmemBytes,
                                                stream, *q_map, *k_map, args),
                        "persistent_score_kernel launch");
    return MSAIDX_SUCCESS;
}

} // namespace

msaidx_status msaidx_persistent_set_attributes(void) {
    MSAIDX_CHECK(set_scorer_attributes<false>());
    return set_scorer_attributes<true>();
}

msaidx_status msaidx_persistent_launch_scores(const msaidx_plan *plan, const CUtensorMap *q_map,
                                              const CUtensorMap *k_map, float *scores,
                                              float *chunk_maxima, cudaStream_t stream) {
    ScoreArgs args;
    const msaidx_persistent_views views = msaidx_persistent_views_of(plan);
    args.tiles = views.sorted_tiles;
    args.counts = views.counts;
    args.segments = views.segments;
    args.resolved_tasks = views.resolved_tasks;
    args.block_table = plan->block_table;
    args.scores = scores;
    args.chunk_maxima = chunk_maxima;
    args.maxima_pitch = msaidx_persistent_maxima_pitch(plan);
    args.bt_stride = plan->desc.bt_stride;
    args.num_heads = plan->context->config.num_heads;
    args.pitch = plan->desc.pitch;
    return chunk_maxima ? launch_scorer<true>(plan, q_map, k_map, args, stream)
                        : launch_scorer<false>(plan, q_map, k_map, args, stream);
}
