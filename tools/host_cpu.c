/* The host CPU as the cpu bench sees it: its model name and two ceilings measured in the same run,
 * the arithmetic peak of the SIMD path the cpu backend picked and a STREAM-like read rate, so that
 * a CPU is judged against itself and not against a GPU's datasheet. */
#include "cpu/cpu.h"
#include "tool.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* Independent accumulator chains per thread: more than any core's FMA latency x issue width. */
#define PEAK_CHAINS 12
/* The peak is each thread's best of many short rounds (well under a millisecond each on an idle
 * core), summed over the threads: on a shared machine the rounds that ran undisturbed set it. */
#define PEAK_ROUNDS 200
#define PEAK_ITERATIONS 50000L
/* The read rate likewise: each thread's best read of one chunk of its own slice (the chunks
 * rotate through the slice, so none is still cached), summed over the threads. */
#define READ_ROUNDS 40
#define READ_CHUNK_BYTES ((size_t)8 << 20)
/* Far beyond any last-level cache, small enough for a development machine. */
#define READ_BYTES ((size_t)256 << 20)

void tool_cpu_model(char *text, size_t size) {
    snprintf(text, size, "unknown CPU");
    FILE *file = fopen("/proc/cpuinfo", "r");
    if (!file) return;
    char line[512];
    while (fgets(line, sizeof line, file)) {
        /* x86 names it "model name"; some ARM kernels "Model" or "Processor". */
        if (strncmp(line, "model name", 10) && strncmp(line, "Model", 5) &&
            strncmp(line, "Processor", 9))
            continue;
        const char *value = strchr(line, ':');
        if (!value) continue;
        value += strspn(value + 1, " \t") + 1;
        const size_t length = strcspn(value, "\n");
        if (!length) continue;
        snprintf(text, size, "%.*s", (int)length, value);
        break;
    }
    fclose(file);
}

/* Each kernel runs `iterations` rounds of one vector instruction on every chain and returns a value
 * that depends on all of them (so nothing is optimised away); the FLOP it did is returned in *flop.
 */
typedef float (*peak_kernel)(long iterations, double *flop);

/* The portable path's shape: 16-byte GNU vectors, separate multiply and add (no contraction in
 * ISO C mode). */
typedef float vec4 __attribute__((vector_size(16)));
static float peak_portable(long iterations, double *flop) {
    vec4 chain[PEAK_CHAINS];
    const vec4 scale = {0.9999f, 0.9999f, 0.9999f, 0.9999f}, step = {1e-4f, 1e-4f, 1e-4f, 1e-4f};
    for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = step * (float)c;
    for (long i = 0; i < iterations; ++i)
        for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = chain[c] * scale + step;
    float sum = 0.0f;
    for (int c = 0; c < PEAK_CHAINS; ++c) sum += chain[c][0] + chain[c][3];
    *flop = 2.0 * 4 * PEAK_CHAINS * (double)iterations;
    return sum;
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma"))) static float peak_avx2(long iterations, double *flop) {
    __m256 chain[PEAK_CHAINS];
    const __m256 scale = _mm256_set1_ps(0.9999f), step = _mm256_set1_ps(1e-4f);
    for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm256_set1_ps((float)c);
    for (long i = 0; i < iterations; ++i)
        for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm256_fmadd_ps(chain[c], scale, step);
    __m256 sum = chain[0];
    for (int c = 1; c < PEAK_CHAINS; ++c) sum = _mm256_add_ps(sum, chain[c]);
    *flop = 2.0 * 8 * PEAK_CHAINS * (double)iterations;
    return _mm256_cvtss_f32(sum);
}

__attribute__((target("avx512f"))) static float peak_avx512(long iterations, double *flop) {
    __m512 chain[PEAK_CHAINS];
    const __m512 scale = _mm512_set1_ps(0.9999f), step = _mm512_set1_ps(1e-4f);
    for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm512_set1_ps((float)c);
    for (long i = 0; i < iterations; ++i)
        for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm512_fmadd_ps(chain[c], scale, step);
    __m512 sum = chain[0];
    for (int c = 1; c < PEAK_CHAINS; ++c) sum = _mm512_add_ps(sum, chain[c]);
    *flop = 2.0 * 16 * PEAK_CHAINS * (double)iterations;
    return _mm512_reduce_add_ps(sum);
}

/* The E4M3 path's instruction: two bf16 products and their sum into each of 16 FP32 lanes. */
__attribute__((target("avx512f,avx512bf16"))) static float peak_avx512_bf16(long iterations,
                                                                            double *flop) {
    __m512 chain[PEAK_CHAINS];
    const __m512bh half = (__m512bh)_mm512_set1_epi32(0x3F003F00); /* bf16 pairs (0.5, 0.5) */
    const __m512bh tiny = (__m512bh)_mm512_set1_epi32(0x38D138D1); /* bf16 pairs near 1e-4 */
    for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm512_set1_ps((float)c);
    for (long i = 0; i < iterations; ++i)
        for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm512_dpbf16_ps(chain[c], half, tiny);
    __m512 sum = chain[0];
    for (int c = 1; c < PEAK_CHAINS; ++c) sum = _mm512_add_ps(sum, chain[c]);
    *flop = 4.0 * 16 * PEAK_CHAINS * (double)iterations;
    return _mm512_reduce_add_ps(sum);
}
#endif

static peak_kernel kernel_of(const char *simd) {
#if defined(__x86_64__) || defined(__i386__)
    if (!strcmp(simd, "avx512_bf16")) return peak_avx512_bf16;
    if (!strcmp(simd, "avx512")) return peak_avx512;
    if (!strcmp(simd, "avx2")) return peak_avx2;
#endif
    return peak_portable;
}

/* OpenMP is a required part of the build (CMakeLists.txt). */
/* The threads the cpu backend runs: 0 means every online core, as in the library. */
static int thread_count(int threads) { return threads > 0 ? threads : omp_get_num_procs(); }

static double measure_peak_gflops(peak_kernel kernel, int threads) {
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        double best = 0.0;
        volatile float sink = 0.0f;
        for (int round = 0; round < PEAK_ROUNDS; ++round) {
            double flop = 0.0;
            const double start = tool_now_ms();
            sink = kernel(PEAK_ITERATIONS, &flop);
            const double seconds = (tool_now_ms() - start) * 1e-3;
            if (seconds > 0 && flop / seconds > best) best = flop / seconds;
        }
        (void)sink;
        total += best * 1e-9;
    }
    return total;
}

static double measure_read_gbps(int threads) {
    const size_t words = READ_BYTES / sizeof(uint64_t);
    uint64_t *buffer = malloc(READ_BYTES);
    if (!buffer) return 0.0;
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const size_t slice = words / (size_t)omp_get_num_threads(),
                     chunk = READ_CHUNK_BYTES / sizeof(uint64_t);
        const size_t chunks = slice / chunk > 0 ? slice / chunk : 1,
                     length = slice < chunk ? slice : chunk;
        uint64_t *mine = buffer + slice * (size_t)omp_get_thread_num();
        /* Written by the thread that reads it, so its pages sit where they are read. */
        for (size_t i = 0; i < slice; ++i) mine[i] = i;
        double best = 0.0;
        volatile uint64_t sink = 0;
        for (int round = 0; round < READ_ROUNDS; ++round) {
            const uint64_t *at = mine + (size_t)round % chunks * length;
            uint64_t sum = 0;
            const double start = tool_now_ms();
            for (size_t i = 0; i < length; ++i) sum += at[i];
            const double seconds = (tool_now_ms() - start) * 1e-3;
            sink = sum;
            if (seconds > 0 && length * sizeof(uint64_t) / seconds > best)
                best = length * sizeof(uint64_t) / seconds;
        }
        (void)sink;
        total += best * 1e-9;
    }
    free(buffer);
    return total;
}

void tool_cpu_measure_ceilings(int threads, tool_cpu_ceilings *ceilings) {
    const char *simd = msaidx_cpu_simd_name();
    const int n = thread_count(threads);
    /* Each thread's best round is summed; threads beyond the cores would each find a round that
     * ran alone and count the same core twice. More threads than cores add no peak anyway. */
    const int measured = n < omp_get_num_procs() ? n : omp_get_num_procs();
    ceilings->simd = simd;
    ceilings->threads = n;
    ceilings->peak_gflops = measure_peak_gflops(kernel_of(simd), measured);
    ceilings->read_gbps = measure_read_gbps(measured);
}
