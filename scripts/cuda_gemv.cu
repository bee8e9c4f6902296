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

#include "launch_pdl.cuh"  // from sparseengine/kernels (probe_cuda_gemv.py passes -I)
#include "mma_bf16.cuh"

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

// The same product on the tensor cores (mma.sync m16n8k16, bf16 in, float32 sums): a CTA
// takes 16 weight rows at a time and its 16 warps split their K; each lane loads 16 B of two
// of the rows (n = g and g + 8, g = lane / 4) at k = kb + 8t (t = lane % 4) and 16 B of x's
// row g (zero for g >= M), which make two MMAs' fragments: the sum over k does not care
// which k each fragment slot holds, as long as A and B agree. The warps' partial sums meet
// in shared memory. x is read from L2 (L1) as the weights go, not staged in shared memory
// (at 326e2a6 every CTA copied all of x, 168 KB for `down`, before its first MMA). A warp
// loads its next step's weights and x before it multiplies the current one's.
constexpr int MMA_STEPS = 4;  // 32-k steps a warp's loads cover at a time (8 loads of 16 B a lane)

template <int M>
__global__ void __launch_bounds__(THREADS, 1)
    gemv_mma_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                    __nv_bfloat16* __restrict__ y, int N, int K, int pdl) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* red = reinterpret_cast<float*>(smem);  // [WARPS][32][4]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int blocks = N / 16, kw = K / WARPS;  // k per warp (a multiple of 32 * MMA_STEPS)
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  const size_t kv = K / 8;
  int blk = blockIdx.x;
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // The warp's steps, in order: (block, chunk of its k). The next step's loads are in
  // flight while this one multiplies, across a block's reduction too.
  const int chunks = kw / (32 * MMA_STEPS);
  uint4 cur[MMA_STEPS][2], nxt[MMA_STEPS][2], xc[MMA_STEPS], xn[MMA_STEPS];
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  auto load_x = [&](uint4 (&dst)[MMA_STEPS], int chunk) {  // x's row g (zero for g >= M), from L2 / L1
#pragma unroll
    for (int s = 0; s < MMA_STEPS; ++s)
      dst[s] = g < M ? __ldg(x4 + (size_t)g * kv + (warp * kw + (chunk * MMA_STEPS + s) * 32) / 8 + t)
                     : make_uint4(0u, 0u, 0u, 0u);
  };
  auto load = [&](uint4 (&dst)[MMA_STEPS][2], int b, int chunk) {
#pragma unroll
    for (int s = 0; s < MMA_STEPS; ++s) {
      const size_t col = (size_t)(warp * kw + (chunk * MMA_STEPS + s) * 32) / 8 + t;
      dst[s][0] = __ldcs(w4 + (size_t)(b * 16 + g) * kv + col);
      dst[s][1] = __ldcs(w4 + (size_t)(b * 16 + g + 8) * kv + col);
    }
  };
  if (blk < blocks) load(cur, blk, 0);  // before the wait: the weights are ours
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (blk < blocks) load_x(xc, 0);
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  for (int ch = 0; blk < blocks;) {
    int nblk = blk, nch = ch + 1;
    if (nch == chunks) nch = 0, nblk += gridDim.x;
    if (nblk < blocks) load(nxt, nblk, nch), load_x(xn, nch);
#pragma unroll
    for (int s = 0; s < MMA_STEPS; ++s) {
      const uint4 xv = xc[s];
      const uint4 lo = cur[s][0], hi = cur[s][1];
      mma_bf16(c, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
      mma_bf16(c, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
    }
    if (nch == 0) {  // the block's k is done: sum the 16 warps' c (y^T[g][2t..2t+1], y^T[g+8][2t..2t+1])
      float* mine = red + (warp * 32 + lane) * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) mine[i] = c[i], c[i] = 0.f;
      __syncthreads();
      if (threadIdx.x < 128) {  // one output (n, m) of the 16 x 8 tile each
        const int l = threadIdx.x >> 2, i = threadIdx.x & 3;
        float sum = 0.f;
#pragma unroll
        for (int q = 0; q < WARPS; ++q) sum += red[(q * 32 + l) * 4 + i];
        const int n = (l >> 2) + (i >= 2 ? 8 : 0), m = 2 * (l & 3) + (i & 1);
        if (m < M) y[(size_t)m * N + blk * 16 + n] = __float2bfloat16(sum);
      }
      __syncthreads();
    }
#pragma unroll
    for (int s = 0; s < MMA_STEPS; ++s) cur[s][0] = nxt[s][0], cur[s][1] = nxt[s][1], xc[s] = xn[s];
    blk = nblk, ch = nch;
  }
}

// One CTA a SM on `stream`, as a programmatic dependent launch with `pdl`, `smem` bytes of dynamic shared memory.
template <auto Kernel>
int launch(size_t smem, const void* x, const void* w, void* y, int N, int K, int pdl, void* stream) {
  const int dev = current_device();
  if (const int e = allow_dynamic_smem<Kernel>(smem, dev)) return e;
  return launch_maybe_pdl(Kernel, dim3(sm_count(dev)), dim3(THREADS), smem, stream, pdl, (const __nv_bfloat16*)x,
                          (const __nv_bfloat16*)w, (__nv_bfloat16*)y, N, K, pdl);
}

template <int M>
int launch_cores(const void* x, const void* w, void* y, int N, int K, int pdl, void* stream) {
  return launch<gemv_kernel<M>>((size_t)M * K * 2, x, w, y, N, K, pdl, stream);  // x sits whole in shared memory
}

template <int M>
int launch_mma(const void* x, const void* w, void* y, int N, int K, int pdl, void* stream) {
  return launch<gemv_mma_kernel<M>>(WARPS * 32 * 4 * sizeof(float), x, w, y, N, K, pdl, stream);  // partial sums
}

}  // namespace

// -> a cudaError_t (0: launched). CUDA cores: N % 4 == 0 and K % 512 == 0; tensor cores
// (`mma`): N % 16 == 0 and K % (16 warps x 256) == 0. M in {1, 6}.
extern "C" int se_gemv(const void* x, const void* w, void* y, int M, int N, int K, int pdl, void* stream, int mma) {
  if (mma) {
    if (N % 16 != 0 || K % (WARPS * 32 * MMA_STEPS) != 0) return -1;
    if (M == 1) return launch_mma<1>(x, w, y, N, K, pdl, stream);
    if (M == 6) return launch_mma<6>(x, w, y, N, K, pdl, stream);
    return -2;
  }
  if (N % ROWS != 0 || K % (32 * 8 * VEC) != 0) return -1;
  switch (M) {
    case 1: return launch_cores<1>(x, w, y, N, K, pdl, stream);
    case 6: return launch_cores<6>(x, w, y, N, K, pdl, stream);
    default: return -2;
  }
}
