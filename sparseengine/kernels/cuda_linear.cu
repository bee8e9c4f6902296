// The decode step's linear layers for a few rows, in CUDA: y = x @ W^T in bf16 with float32
// sums, on the tensor cores, with the model's folds (cuda_linear.py builds it with nvcc,
// launches it and holds its contract; skinny_linear.py is the Triton kernel it replaces
// where it can run).
//
// Why CUDA: the Triton linears lose ~3 us a launch to ramp and tail, and their
// programmatic dependent launches were slower (results/README.md, pdl_chain_h200.jsonl);
// the probe scripts/cuda_gemv.cu measured this design, launched that way, 2.2% under the
// Triton chain (cuda_gemv_h200.jsonl).
//
// Layout: one persistent CTA of 16 warps an SM (the engine's build; SE_GRID_CTAS in
// cuda_linear.cuh). A CTA takes 16 weight rows (a block) at a time, blocks spread over the
// CTAs; its 16 warps split K. Each lane loads 16 B of two of
// the block's rows (n = g and g + 8, g = lane / 4) at k = kb + 8t (t = lane % 4) and 16 B
// of x's row g (zero for g >= M), which make two mma.sync m16n8k16 fragments: the sum over
// k does not care which k a fragment slot holds, as long as A and B agree. A warp loads its
// next step's weights (and x) before it multiplies the current one's, across blocks too.
// At a block's end the warps' partial sums meet in shared memory and 128 threads (64 gated)
// finish it.
//
// x: read from L2 as the warps go, or (`staged`) copied once into shared memory, which pays
// when a CTA takes many blocks (gate_up: 13-14 at the Llama-3.1-8B shape).
// Folds: `norm` scales each row by 1 / sqrt(mean(x^2) + eps) (the RMSNorm whose weight the
// model folded into W); `residual` adds it after rounding the product to bf16; `gated`:
// W's rows come in groups of 8 gate rows then their 8 up rows (cuda_linear.interleave_gate_up)
// and y [M, N / 2] = silu(gate) * up, each rounded to bf16 as the model's SiLU-and-multiply
// rounds (fused_ops.silu_mul).
// `pdl`: launched as a programmatic dependent launch: the kernel lets the next one launch at
// its start, issues its first weight loads (weights depend on no kernel), and only then waits
// for the kernel before it (griddepcontrol.wait) to read x and the residual.
// The chain (`se_linear_chain`): a decode layer's o projection (+ residual), gate_up (norm,
// gated) and down (+ o's output) in one launch, each linear the one-linear kernel's blocks,
// a grid barrier between them instead of a kernel boundary; each CTA loads the next linear's
// first weights as soon as its last block of the one before is done, so they are in flight
// through the barrier. Not run on a GPU yet (session 57 wrote it with no
// device lent); cuda_linear_chain.py wraps it. The device parts: cuda_linear.cuh.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch_pdl.cuh"
#include "mma_bf16.cuh"
#include "cuda_linear.cuh"

namespace {

template <bool STAGED, bool ROPE>
__global__ void __launch_bounds__(THREADS, SE_MIN_CTAS) linear_kernel(const Params p, const Rope r) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4 cur[STEPS][2];
  const auto trigger = [&] {
    if (p.pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  };
  const auto wait = [&] {
    if (p.pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  };
  linear_blocks<STAGED, ROPE, false, false, true>(p, r, smem, cur, trigger, wait, NoTail{});
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* a) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
  return v;
}

// The chain's grid barrier: every CTA's stores before it are seen by every CTA after it.
// bar[0] counts the arrivals (back to 0 as the last arrives), bar[1] is a generation the last
// arrival advances: the workspace needs no reset between launches or graph replays. Every
// CTA of the grid must be resident at once (the launch checks the occupancy).
__device__ __forceinline__ void grid_barrier(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = load_acquire(bar + 1);  // cannot move on before this CTA arrives
    __threadfence();                             // this CTA's stores, ordered by the sync above
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(bar + 1, 1u);
    } else {
      while (load_acquire(bar + 1) == gen) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// o (a: residual), gate_up (b: norm, gated; x staged when `STAGED_B`), down (c: residual) in
// one launch. The next kernel may launch only once every CTA has passed the last barrier:
// before that, a CTA of its could take an SM a CTA of this grid still needs.
template <bool STAGED_B>
__global__ void __launch_bounds__(THREADS, SE_MIN_CTAS)
    chain_kernel(const Params a, const Params b, const Params c, unsigned* bar) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Rope r = {};
  uint4 cur[STEPS][2];
  const auto first_of = [&r](const Params& q) {  // q read when called: nothing held through the loop
    return [&q, &r](uint4 (&dst)[STEPS][2]) {
      if ((int)blockIdx.x < q.N / 16) load_weights<false>(dst, q.w, q.K, r, blockIdx.x, 0);
    };
  };
  const auto wait = [&] {
    if (a.pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  };
  const auto none = [] {};
  linear_blocks<false, false, false, false, false>(a, r, smem, cur, none, wait, first_of(b));
  grid_barrier(bar);
  linear_blocks<STAGED_B, false, true, true, false>(b, r, smem, cur, none, none, first_of(c));
  grid_barrier(bar);
  if (a.pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  linear_blocks<false, false, true, true, false>(c, r, smem, cur, none, none, NoTail{});
}

size_t linear_smem(int M, int K, bool staged, bool rope) {
  return (RED_FLOATS + NORM_FLOATS) * sizeof(float) + (staged ? (size_t)M * (K / 8 + 1) * 16 : 0)
         + (rope ? ROPE_BYTES : 0);
}

template <bool STAGED, bool ROPE>
int launch(const Params& p, const Rope& r, void* stream) {
  const int dev = current_device();  // the attribute belongs to the device current at the call
  const size_t smem = linear_smem(p.M, p.K, STAGED, ROPE);
  if (const int e = allow_dynamic_smem<linear_kernel<STAGED, ROPE>>(smem, dev)) return e;
  const int blocks = p.N / 16, ctas = sm_count(dev) * SE_GRID_CTAS;
  return launch_maybe_pdl(linear_kernel<STAGED, ROPE>, dim3(blocks < ctas ? blocks : ctas), dim3(THREADS), smem,
                          stream, p.pdl, p, r);
}

// The chain's grid: every CTA resident at once (-4 when the occupancy does not allow it).
template <bool STAGED_B>
int launch_chain(const Params& a, const Params& b, const Params& c, unsigned* bar, void* stream) {
  const int dev = current_device();
  const size_t smem = linear_smem(b.M, b.K, STAGED_B, false);  // the largest of the three: b's staged x
  if (const int e = allow_dynamic_smem<chain_kernel<STAGED_B>>(smem, dev)) return e;
  int per_sm = 0;
  if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chain_kernel<STAGED_B>, THREADS,
                                                                          smem))
    return (int)e;
  if (per_sm < SE_GRID_CTAS) return -4;
  return launch_maybe_pdl(chain_kernel<STAGED_B>, dim3(sm_count(dev) * SE_GRID_CTAS), dim3(THREADS), smem, stream,
                          a.pdl, a, b, c, bar);
}

}  // namespace

// -> 0 when launched, a cudaError_t, or -1 (N % 16 or K % K_MULTIPLE not 0; gated with N % 16),
// -2 (M outside 1..8). Every pointer 16-byte aligned, every tensor contiguous.
extern "C" int se_linear(const void* x, const void* w, const void* residual, void* y, int M, int N, int K, float eps,
                         int norm, int gated, int staged, int pdl, void* stream) {
  if (N <= 0 || N % 16 != 0 || K <= 0 || K % K_MULTIPLE != 0) return -1;
  if (M < 1 || M > MAX_ROWS) return -2;
  const Params p = {(const __nv_bfloat16*)x, (const __nv_bfloat16*)w, (const __nv_bfloat16*)residual,
                    (__nv_bfloat16*)y, M, N, K, eps, norm, gated, pdl};
  const Rope r = {};
  return staged ? launch<true, false>(p, r, stream) : launch<false, false>(p, r, stream);
}

// qkv with the rope epilogue (`Rope`): y receives q rotated [M, hq * 128]; k and v
// go to the caches. -> as se_linear, or -3 (N is not (hq + 2 hkv) * 128, or page_size < 1).
extern "C" int se_linear_rope(const void* x, const void* w, void* y, int M, int N, int K, float eps, int norm,
                              int staged, int pdl, const void* cos, const void* sin, long long cs_stride,
                              void* k_cache, void* v_cache, long long k_page, long long k_tok, long long v_page,
                              long long v_tok, int page_size, const void* slots, int hq, int hkv, void* stream) {
  if (N <= 0 || N % 16 != 0 || K <= 0 || K % K_MULTIPLE != 0) return -1;
  if (M < 1 || M > MAX_ROWS) return -2;
  if (hq < 1 || hkv < 1 || N != (hq + 2 * hkv) * ROPE_D || page_size < 1) return -3;
  const Params p = {(const __nv_bfloat16*)x, (const __nv_bfloat16*)w, nullptr, (__nv_bfloat16*)y, M, N, K, eps,
                    norm, 0, pdl};
  const Rope r = {(const __nv_bfloat16*)cos, (const __nv_bfloat16*)sin, (__nv_bfloat16*)k_cache,
                  (__nv_bfloat16*)v_cache, (const long long*)slots, cs_stride, k_page, k_tok, v_page, v_tok,
                  page_size, hq, hkv};
  return staged ? launch<true, true>(p, r, stream) : launch<false, true>(p, r, stream);
}

// The chain: h = x @ w_o^T + residual; act = silu(gate) * up of RMSNorm(h) @ w_up^T (w_up
// interleaved, `eps`); out = act @ w_down^T + h. x [M, K], w_o [N, K], residual, h, out
// [M, N], w_up [2 I, N], act [M, I], w_down [N, I]; `bar`: 2 zeroed uint32, left as found.
// -> as se_linear, or -4 (the grid cannot be resident at once).
extern "C" int se_linear_chain(const void* x, const void* w_o, const void* residual, void* h, const void* w_up,
                               void* act, const void* w_down, void* out, int M, int N, int K, int I, float eps,
                               int staged, int pdl, void* bar, void* stream) {
  if (N <= 0 || N % K_MULTIPLE != 0 || K <= 0 || K % K_MULTIPLE != 0 || I <= 0 || I % K_MULTIPLE != 0) return -1;
  if (M < 1 || M > MAX_ROWS) return -2;
  using B = const __nv_bfloat16*;
  using Y = __nv_bfloat16*;
  const Params a = {(B)x, (B)w_o, (B)residual, (Y)h, M, N, K, 0.f, 0, 0, pdl};
  const Params b = {(B)h, (B)w_up, nullptr, (Y)act, M, 2 * I, N, eps, 1, 1, pdl};
  const Params c = {(B)act, (B)w_down, (B)h, (Y)out, M, N, I, 0.f, 0, 0, pdl};
  return staged ? launch_chain<true>(a, b, c, (unsigned*)bar, stream)
                : launch_chain<false>(a, b, c, (unsigned*)bar, stream);
}

// K must be a multiple of this: the wrapper checks it against the build it loaded.
extern "C" int se_linear_k_multiple() { return K_MULTIPLE; }

// CTAs an SM in the grid (the wrapper checks it against the build it loaded).
extern "C" int se_linear_grid_ctas() { return SE_GRID_CTAS; }

// The shared memory a launch needs (bytes): the wrapper checks it against the device's.
extern "C" long long se_linear_smem(int M, int K, int staged, int rope) {
  return (long long)linear_smem(M, K, staged, rope);
}
