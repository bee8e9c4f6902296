// A probe, not an engine kernel: y[M, N] = x[M, K] @ W[N, K]^T in bf16 (float32 sums) for the
// decode step's few rows, written in CUDA to measure what the Triton GEMVs leave at kernel
// boundaries (scripts/probe_cuda_gemv.py builds it with nvcc and times it beside them).
//
// One CTA of 16 warps per SM, persistent: x sits whole in shared memory (M x K bf16: 48 KB at
// K = 4096, 168 KB at 14336); each warp takes 4 weight rows at a time (tasks spread over the
// CTAs first), each lane streaming 2 x 16 B of each row a step, so a warp has 8 loads of
// 16 B in flight. With `pdl` (a programmatic dependent launch) the kernel lets the next one
// launch at its start, issues its first weight loads (weights do not depend on the kernel
// before), and only then waits for the previous kernel before it reads x.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 16;
constexpr int THREADS = WARPS * 32;
constexpr int ROWS = 4;  // weight rows a warp takes at a time
constexpr int VEC = 2;   // 16-byte loads a lane issues per row per step (at 4, M = 6 spills registers)

template <int M>
struct Acc {
  float v[ROWS][M];
};

__device__ __forceinline__ void load_step(uint4 (&wr)[ROWS][VEC], const uint4* __restrict__ w4, int row0, int kv,
                                          int s, int lane) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int v = 0; v < VEC; ++v)
      wr[r][v] = __ldcs(w4 + (size_t)(row0 + r) * kv + s + v * 32 + lane);
}

__device__ __forceinline__ void to_float8(const uint4& u, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <int M>
__global__ void __launch_bounds__(THREADS, 1)
    gemv_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                __nv_bfloat16* __restrict__ y, int N, int K, int pdl) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* xs = reinterpret_cast<uint4*>(smem);  // [M][K / 8]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kv = K / 8, tasks = N / ROWS, stride = gridDim.x * WARPS;
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  int t = warp * gridDim.x + blockIdx.x;
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  uint4 wr[ROWS][VEC];
  if (t < tasks) load_step(wr, w4, t * ROWS, kv, 0, lane);  // before the wait: the weights are ours
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  for (int i = threadIdx.x; i < M * kv; i += THREADS) xs[i] = x4[i];
  __syncthreads();
  bool loaded = true;
  for (; t < tasks; t += stride) {
    Acc<M> acc;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) acc.v[r][m] = 0.f;
    for (int s = 0; s < kv; s += 32 * VEC) {
      if (!loaded) load_step(wr, w4, t * ROWS, kv, s, lane);
      loaded = false;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float wf[ROWS][8];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) to_float8(wr[r][v], wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const uint4 xv = xs[m * kv + s + v * 32 + lane];  // one 16-byte shared load
          float xf[8];
          to_float8(xv, xf);
#pragma unroll
          for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc.v[r][m] = fmaf(wf[r][i], xf[i], acc.v[r][m]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float a = acc.v[r][m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (lane == (r * M + m) % 32) y[(size_t)m * N + t * ROWS + r] = __float2bfloat16(a);
      }
  }
}

template <int M>
int launch(const void* x, const void* w, void* y, int N, int K, int pdl, void* stream) {
  static int sms = 0;
  static size_t smem_set = 0;
  size_t smem = (size_t)M * K * 2;
  if (sms == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  }
  if (smem > smem_set) {
    cudaError_t e = cudaFuncSetAttribute(gemv_kernel<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
    smem_set = smem;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(sms);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, gemv_kernel<M>, (const __nv_bfloat16*)x, (const __nv_bfloat16*)w,
                                     (__nv_bfloat16*)y, N, K, pdl);
  return (int)e;
}

}  // namespace

// -> a cudaError_t (0: launched). Needs N % 4 == 0 and K % 512 == 0; M in {1, 6}.
extern "C" int se_gemv(const void* x, const void* w, void* y, int M, int N, int K, int pdl, void* stream) {
  if (N % ROWS != 0 || K % (32 * 8 * VEC) != 0) return -1;
  switch (M) {
    case 1: return launch<1>(x, w, y, N, K, pdl, stream);
    case 6: return launch<6>(x, w, y, N, K, pdl, stream);
    default: return -2;
  }
}
