// What a tiny kernel costs under the bench's timing (CUDA events around the launch, the L2 flushed
// before), against other flushes: empty kernels (one, two, two with an event between), dependent
// loads, a top-k-shaped kernel, and a 134 MB read. Measured on an H200 in
// `git show 17c914b:bench/results/2026-11-30_h200_v5_exp12_fixed_costs.log`. Not part of the build:
//   nvcc -O3 -arch=sm_90a -std=c++17 -o launch_and_flush_costs bench/probes/launch_and_flush_costs.cu
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void k_empty() {}
__global__ void k_load1(const int *a, int *out) { if (threadIdx.x == 0) out[0] = a[0]; }
__global__ void k_chain3(const int *a, const int *b, int *c) { if (threadIdx.x == 0) { int i = a[0]; int v = b[i]; c[v & 1023] = 1; } }
// top-k-like: warp per row, nvp then 64 floats then 16 ints out
__global__ void k_rows(const int *nvp, const float *s, int *out, int pitch, bool spec) {
  int row = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  const float *r = s + (size_t)row * pitch;
  float x0, x1; int n;
  if (spec) { x0 = r[lane]; x1 = r[lane + 32]; n = nvp[row]; }
  else { n = nvp[row]; x0 = lane < n ? r[lane] : 0.f; x1 = lane + 32 < n ? r[lane + 32] : 0.f; }
  float m = fmaxf(x0, x1);
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  if (lane < 16) out[row * 16 + lane] = (int)m + n;
}
__global__ void k_stream(const int4 *p, size_t n, int *out) {
  int4 acc = {0, 0, 0, 0};
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    int4 v = __ldcs(p + i); acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w; }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678) out[0] = 1;
}

int main() {
  int dev = 0; cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, dev));
  size_t l2 = prop.l2CacheSize, fb = 2 * l2;
  printf("%s L2 %zu MB SMs %d\n", prop.name, l2 >> 20, prop.multiProcessorCount);
  cudaStream_t st; CK(cudaStreamCreate(&st));
  void *flush, *flush2, *small; CK(cudaMalloc(&flush, fb)); CK(cudaMalloc(&flush2, fb)); CK(cudaMalloc(&small, 1 << 20));
  int *a, *b, *c, *out; float *s; int *nvp;
  CK(cudaMalloc(&a, 4096)); CK(cudaMalloc(&b, 4096)); CK(cudaMalloc(&c, 4096)); CK(cudaMalloc(&out, 1 << 20));
  CK(cudaMemset(a, 0, 4096)); CK(cudaMemset(b, 0, 4096));
  CK(cudaMalloc(&s, 128 * 64 * 4)); CK(cudaMalloc(&nvp, 128 * 4)); CK(cudaMemset(s, 0, 128 * 64 * 4));
  std::vector<int> h(128, 64); CK(cudaMemcpy(nvp, h.data(), 512, cudaMemcpyHostToDevice));
  size_t big = 134217728; void *kbuf; CK(cudaMalloc(&kbuf, big)); CK(cudaMemset(kbuf, 1, big));
  cudaEvent_t e0, e1, e2; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1)); CK(cudaEventCreate(&e2));
  int fv = 0;
  auto do_flush = [&](int mode) {
    fv = (fv + 1) & 0xff;
    if (mode == 1 || mode == 2) CK(cudaMemsetAsync(flush, fv, fb, st));
    if (mode == 2) k_stream<<<528, 512, 0, st>>>((const int4 *)flush2, fb / 16, out);
    if (mode == 3) CK(cudaMemsetAsync(small, fv, 1 << 20, st));
    if (mode == 4) k_stream<<<528, 512, 0, st>>>((const int4 *)flush2, fb / 16, out);
  };
  const char *fname[] = {"none", "memset2xL2(dirty)", "memset+read2xL2(clean)", "memset1MB", "read2xL2"};
  auto time = [&](const char *what, int mode, auto launch) {
    std::vector<float> t;
    for (int i = 0; i < 25; ++i) {
      do_flush(mode);
      CK(cudaEventRecord(e0, st)); launch(); CK(cudaEventRecord(e1, st));
      CK(cudaStreamSynchronize(st)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (i >= 5) t.push_back(ms * 1e3f);
    }
    std::sort(t.begin(), t.end());
    printf("%-28s flush %-24s median %8.2f us  min %8.2f\n", what, fname[mode], t[t.size() / 2], t[0]);
  };
  for (int mode = 0; mode < 5; ++mode) {
    time("empty", mode, [&] { k_empty<<<1, 32, 0, st>>>(); });
    time("empty x2", mode, [&] { k_empty<<<1, 32, 0, st>>>(); k_empty<<<1, 32, 0, st>>>(); });
    time("empty x2 + event between", mode, [&] { k_empty<<<1, 32, 0, st>>>(); CK(cudaEventRecord(e2, st)); k_empty<<<1, 32, 0, st>>>(); });
    time("empty 132 CTAs", mode, [&] { k_empty<<<132, 384, 0, st>>>(); });
    time("load1", mode, [&] { k_load1<<<1, 32, 0, st>>>(a, out); });
    time("chain3", mode, [&] { k_chain3<<<1, 32, 0, st>>>(a, b, c); });
    time("rows128 dependent", mode, [&] { k_rows<<<16, 256, 0, st>>>(nvp, s, out, 64, false); });
    time("rows128 speculative", mode, [&] { k_rows<<<16, 256, 0, st>>>(nvp, s, out, 64, true); });
    time("stream 134MB", mode, [&] { k_stream<<<528, 512, 0, st>>>((const int4 *)kbuf, big / 16, out); });
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
