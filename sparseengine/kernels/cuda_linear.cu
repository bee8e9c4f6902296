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
// Layout: one persistent CTA of 16 warps an SM (the engine's build; SE_GRID_CTAS below). A CTA
// takes 16 weight rows (a block) at a time, blocks spread over the CTAs; its 16 warps split K.
// Each lane loads 16 B of two of the block's rows (n = g and g + 8, g = lane / 4) at k = kb + 8t
// (t = lane % 4) and 16 B of x's row g (zero for g >= M), which make two mma.sync m16n8k16
// fragments: the sum over k does not care which k a fragment slot holds, as long as A and B
// agree. A warp loads its next step's weights (and x) before it multiplies the current one's,
// across blocks too. At a block's end the warps' partial sums meet in shared memory and 128
// threads (64 gated) finish it.
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
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch_pdl.cuh"
#include "mma_bf16.cuh"

// The build's variant (cuda_linear.py passes them as -D flags; these defaults are the engine's):
// warps a CTA, 32-channel steps a warp's loads cover at a time, and the CTAs an SM the
// registers must leave room for (__launch_bounds__'s minimum: 2 holds a thread to 64).
#ifndef SE_WARPS
#define SE_WARPS 16
#endif
#ifndef SE_STEPS
#define SE_STEPS 4
#endif
#ifndef SE_MIN_CTAS
#define SE_MIN_CTAS 1
#endif
// CTAs an SM in the grid (at most SE_MIN_CTAS, so the grid is resident at once): with more
// than one, an SM holds several smaller CTAs, and the next kernel's programmatic dependent
// launch can start in the slot of the first to finish while the others run on.
#ifndef SE_GRID_CTAS
#define SE_GRID_CTAS 1
#endif
#if SE_GRID_CTAS < 1 || SE_GRID_CTAS > SE_MIN_CTAS
#error "SE_GRID_CTAS must lie in 1 .. SE_MIN_CTAS"
#endif

namespace {

constexpr int WARPS = SE_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int STEPS = SE_STEPS;             // 32-channel steps a warp's loads cover at a time
constexpr int MAX_ROWS = 8;                 // the MMA's n: rows of x
constexpr int K_MULTIPLE = WARPS * 32 * STEPS;  // K must be a multiple of this (2048 by default)
constexpr int RED_FLOATS = WARPS * 32 * 4;  // the warps' partial sums
constexpr int NORM_FLOATS = MAX_ROWS + WARPS * MAX_ROWS;  // each row's 1 / rms, each warp's sums of squares

constexpr int ROPE_D = 128;  // the rope epilogue's head dim (rotate-half pairs j and j + 64)
// The ROPE kernel's shared memory past x: the rows' slots, then their cos and sin rows
// ([2][MAX_ROWS][ROPE_D] bf16), staged once a launch so no block's epilogue waits on a load.
constexpr int ROPE_BYTES = MAX_ROWS * 8 + 2 * MAX_ROWS * ROPE_D * 2;

struct Params {
  const __nv_bfloat16* x;         // [M, K]
  const __nv_bfloat16* w;         // [N, K]
  const __nv_bfloat16* residual;  // [M, N], or null
  __nv_bfloat16* y;               // [M, N]; gated: [M, N / 2]; rope: q rotated, [M, hq * ROPE_D]
  int M, N, K;
  float eps;
  int norm, gated, pdl;
};

// The ROPE kernel's own arguments: W is qkv's [(hq + 2 hkv) * ROPE_D, K]; the q and k rows'
// blocks pair dims j .. j + 7 of a head with j + 64 .. j + 71, the epilogue rotates them and
// writes q to y, k and v to the paged caches at `slots` (none for slot -1).
struct Rope {
  const __nv_bfloat16* cos;       // [M, ROPE_D] at row stride cs_stride (sin likewise)
  const __nv_bfloat16* sin;
  __nv_bfloat16* k_cache;         // token row (page, off) at page * k_page + off * k_tok, heads contiguous
  __nv_bfloat16* v_cache;
  const long long* slots;         // [M]: page * page_size + offset, or -1
  long long cs_stride, k_page, k_tok, v_page, v_tok;
  int page_size, hq, hkv;
};

// The ROPE kernel's weight row of block `b`'s tile row r (0-15): in the q and k heads' blocks
// dims j .. j + 7 (r < 8) and j + 64 .. j + 71 (r >= 8) of head b / 8, j = 8 (b % 8); v's
// blocks take consecutive rows.
__device__ __forceinline__ int block_row(const Rope& p, int b, int r) {
  if (b < (p.hq + p.hkv) * (ROPE_D / 16))
    return (b >> 3) * ROPE_D + (r >= 8 ? ROPE_D / 2 : 0) + (b & 7) * 8 + (r & 7);
  return b * 16 + r;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// 16-byte x loads a thread has in flight at once in the prologue (x's copy into shared
// memory and its rows' sums of squares): one L2 round trip for x, not one per load.
constexpr int PRO_LOADS = 8;

__device__ __forceinline__ float sumsq8(const uint4& u) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    ss += f.x * f.x;
    ss += f.y * f.y;
  }
  return ss;
}

// After the wait: x into shared memory (`STAGED`, rows padded by 16 B) and, with `norm`,
// each row's 1 / sqrt(mean(x^2) + eps) into `scale` (float32 sums: each warp's into
// `wsum[warp][row]`, then the warps' summed in warp order, so a launch's bits never depend
// on which warp finished first). All threads load, PRO_LOADS at a time.
template <bool STAGED>
__device__ __forceinline__ void prologue(const Params& p, const uint4* __restrict__ x4, uint4* xs, float* wsum,
                                         float* scale) {
  const int kv = p.K / 8, total = p.M * kv, xrow = kv + 1;
  float part[MAX_ROWS];
#pragma unroll
  for (int r = 0; r < MAX_ROWS; ++r) part[r] = 0.f;
  for (int base = threadIdx.x; base < total; base += THREADS * PRO_LOADS) {
    uint4 v[PRO_LOADS];
#pragma unroll
    for (int j = 0; j < PRO_LOADS; ++j) {
      const int i = base + j * THREADS;
      v[j] = i < total ? __ldg(x4 + i) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < PRO_LOADS; ++j) {
      const int i = base + j * THREADS;
      if (i >= total) break;
      const int row = i / kv;
      if (STAGED) xs[row * xrow + i - row * kv] = v[j];
      if (p.norm) {
        const float s = sumsq8(v[j]);
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) part[r] += row == r ? s : 0.f;
      }
    }
  }
  if (p.norm) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
      float s = part[r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) wsum[(threadIdx.x >> 5) * MAX_ROWS + r] = s;
    }
  }
  if (STAGED || p.norm) __syncthreads();
  if (p.norm && threadIdx.x < p.M) {
    float ss = 0.f;
#pragma unroll
    for (int q = 0; q < WARPS; ++q) ss += wsum[q * MAX_ROWS + threadIdx.x];
    scale[threadIdx.x] = 1.0f / __fsqrt_rn(ss / p.K + p.eps);
  }
  // `scale` is read at the first block's end, after that block's __syncthreads
}

// Feature f's tile rows f and f + 8 for row m, summed over the warps, scaled by the row's norm
// and rounded to bf16 (the model's projection output): the gated and rope epilogues' pair.
__device__ __forceinline__ void pair_sums(const float* red, const float* scale, int norm, int f, int m, float& lo,
                                          float& hi) {
  const int l = f * 4 + (m >> 1), i = m & 1;
  lo = 0.f, hi = 0.f;
#pragma unroll
  for (int q = 0; q < WARPS; ++q) lo += red[(q * 32 + l) * 4 + i], hi += red[(q * 32 + l) * 4 + 2 + i];
  if (norm) lo *= scale[m], hi *= scale[m];
  lo = round_bf16(lo), hi = round_bf16(hi);
}

// ROPE: block `blk`'s 8 features x M rows, each thread one feature f and row m: tile rows f
// and f + 8, rounded to bf16 as the model's qkv output is (`slots`, `cs`: the launch's
// staged copies of p.slots and the cos, sin rows). A q or k block's pair (dims j and
// j + 64 of its head) is rotated as fused_ops.rotary_kv_write rounds it (each product, then
// the sum); a v block's rows are two consecutive dims 8 apart. q goes to y, k and v to the
// token's cache row.
__device__ __forceinline__ void finish_rope(const Params& a, const Rope& p, const float* red, const float* scale,
                                            const long long* slots, const __nv_bfloat16* cs, int blk) {
  if (threadIdx.x >= 64) return;
  const int f = threadIdx.x >> 3, m = threadIdx.x & 7;
  if (m >= a.M) return;
  float lo, hi;
  pair_sums(red, scale, a.norm, f, m, lo, hi);
  const int qk_blocks = (p.hq + p.hkv) * (ROPE_D / 16);
  const long long slot = slots[m];
  if (blk < qk_blocks) {
    const int head = blk >> 3, j = (blk & 7) * 8 + f;
    const __nv_bfloat16* cr = cs + m * ROPE_D;
    const __nv_bfloat16* sr = cs + (MAX_ROWS + m) * ROPE_D;
    const float c1 = __bfloat162float(cr[j]), c2 = __bfloat162float(cr[j + ROPE_D / 2]);
    const float s1 = __bfloat162float(sr[j]), s2 = __bfloat162float(sr[j + ROPE_D / 2]);
    const float o1 = round_bf16(round_bf16(lo * c1) + round_bf16(-hi * s1));
    const float o2 = round_bf16(round_bf16(hi * c2) + round_bf16(lo * s2));
    __nv_bfloat16* dst;
    if (head < p.hq) {
      dst = a.y + (size_t)m * p.hq * ROPE_D + head * ROPE_D;
    } else {
      if (slot < 0) return;
      dst = p.k_cache + (slot / p.page_size) * p.k_page + (slot % p.page_size) * p.k_tok + (head - p.hq) * ROPE_D;
    }
    dst[j] = __float2bfloat16(o1);
    dst[j + ROPE_D / 2] = __float2bfloat16(o2);
  } else {
    if (slot < 0) return;
    const int r = (blk - qk_blocks) * 16 + f;  // v's feature of tile row f; f + 8 is r + 8
    __nv_bfloat16* dst = p.v_cache + (slot / p.page_size) * p.v_page + (slot % p.page_size) * p.v_tok;
    dst[r] = __float2bfloat16(lo);
    dst[r + 8] = __float2bfloat16(hi);
  }
}

// Block `blk`'s outputs from the warps' partial sums in `red` (lane l's c[i] of warp q at
// red[(q * 32 + l) * 4 + i] holds y^T[n][m], n = l / 4 + 8 (i >= 2), m = 2 (l % 4) + i % 2).
__device__ __forceinline__ void finish_block(const Params& p, const float* red, const float* scale, int blk) {
  if (!p.gated) {
    if (threadIdx.x >= 128) return;
    const int l = threadIdx.x >> 2, i = threadIdx.x & 3;
    const int n = blk * 16 + (l >> 2) + (i >= 2 ? 8 : 0), m = 2 * (l & 3) + (i & 1);
    if (m >= p.M) return;
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < WARPS; ++q) sum += red[(q * 32 + l) * 4 + i];
    if (p.norm) sum *= scale[m];
    __nv_bfloat16 out = __float2bfloat16(sum);
    if (p.residual) out = __float2bfloat16(__bfloat162float(out) + __bfloat162float(p.residual[(size_t)m * p.N + n]));
    p.y[(size_t)m * p.N + n] = out;
  } else {  // feature f of the block's 8: its gate at tile row f, its up at f + 8
    if (threadIdx.x >= 64) return;
    const int f = threadIdx.x >> 3, m = threadIdx.x & 7;
    if (m >= p.M) return;
    float gate, up;
    pair_sums(red, scale, p.norm, f, m, gate, up);  // the model's gate_up output
    const float silu = round_bf16(gate / (1.0f + expf(-gate)));  // torch's silu: x / (1 + expf(-x))
    p.y[(size_t)m * (p.N / 2) + blk * 8 + f] = __float2bfloat16(silu * up);
  }
}

template <bool STAGED, bool ROPE>
__global__ void __launch_bounds__(THREADS, SE_MIN_CTAS) linear_kernel(const Params p, const Rope r) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* red = reinterpret_cast<float*>(smem);                // [WARPS][32][4]
  float* scale = red + RED_FLOATS;                            // [MAX_ROWS]: each row's 1 / rms
  float* wsum = scale + MAX_ROWS;                             // [WARPS][MAX_ROWS]: the warps' sums of squares
  uint4* xs = reinterpret_cast<uint4*>(red + RED_FLOATS + NORM_FLOATS);  // STAGED: x, rows padded by 16 B
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int M = p.M, blocks = p.N / 16, kw = p.K / WARPS, chunks = kw / (32 * STEPS);
  const size_t kv = p.K / 8;
  const int xrow = p.K / 8 + 1;
  const uint4* w4 = reinterpret_cast<const uint4*>(p.w);
  const uint4* x4 = reinterpret_cast<const uint4*>(p.x);
  int blk = blockIdx.x;
  if (p.pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  uint4 cur[STEPS][2], nxt[STEPS][2], xc[STEPS], xn[STEPS];
  auto load_w = [&](uint4 (&dst)[STEPS][2], int b, int chunk) {
    if constexpr (ROPE) {
      const size_t lo = (size_t)block_row(r, b, g) * kv, hi = (size_t)block_row(r, b, g + 8) * kv;
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {
        const size_t col = (size_t)(warp * kw + (chunk * STEPS + s) * 32) / 8 + t;
        dst[s][0] = __ldcs(w4 + lo + col);
        dst[s][1] = __ldcs(w4 + hi + col);
      }
    } else {
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {
        const size_t col = (size_t)(warp * kw + (chunk * STEPS + s) * 32) / 8 + t;
        dst[s][0] = __ldcs(w4 + (size_t)(b * 16 + g) * kv + col);
        dst[s][1] = __ldcs(w4 + (size_t)(b * 16 + g + 8) * kv + col);
      }
    }
  };
  auto load_x = [&](uint4 (&dst)[STEPS], int chunk) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const int col = (warp * kw + (chunk * STEPS + s) * 32) / 8 + t;
      if (g >= M)
        dst[s] = make_uint4(0u, 0u, 0u, 0u);
      else if (STAGED)
        dst[s] = xs[g * xrow + col];
      else
        dst[s] = __ldg(x4 + g * kv + col);
    }
  };
  if (blk < blocks) load_w(cur, blk, 0);  // before the wait: the weights are ours
  if (p.pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (!STAGED && blk < blocks) load_x(xc, 0);  // from L2: in flight through the prologue
  // ROPE: the rows' slots and their cos, sin rows (16 B a load: part, row, cos or sin), the
  // first THREADS loads in flight through the prologue too
  long long* rslot = reinterpret_cast<long long*>(xs + (STAGED ? (size_t)M * xrow : 0));
  uint4* rcs4 = reinterpret_cast<uint4*>(rslot + MAX_ROWS);
  auto rope_load = [&](int i, int& at) -> uint4 {
    const int part = i & 15, row = (i >> 4) % M, is_sin = i >= 16 * M;
    at = ((is_sin ? MAX_ROWS : 0) + row) * (ROPE_D / 8) + part;
    return __ldg(reinterpret_cast<const uint4*>((is_sin ? r.sin : r.cos) + row * r.cs_stride) + part);
  };
  long long slot = 0;
  uint4 rope_cs = make_uint4(0u, 0u, 0u, 0u);
  int rope_at = 0;
  if constexpr (ROPE) {
    if (threadIdx.x < M) slot = r.slots[threadIdx.x];
    if (threadIdx.x < 32 * M) rope_cs = rope_load(threadIdx.x, rope_at);
  }
  prologue<STAGED>(p, x4, xs, wsum, scale);
  if (STAGED && blk < blocks) load_x(xc, 0);
  if constexpr (ROPE) {  // loaded before the prologue; the first block's __syncthreads orders these stores
    if (threadIdx.x < M) rslot[threadIdx.x] = slot;
    if (threadIdx.x < 32 * M) rcs4[rope_at] = rope_cs;
    for (int i = threadIdx.x + THREADS; i < 32 * M; i += THREADS) {  // builds of under 256 threads
      int at;
      const uint4 v = rope_load(i, at);
      rcs4[at] = v;
    }
  }
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  for (int ch = 0; blk < blocks;) {
    int nblk = blk, nch = ch + 1;
    if (nch == chunks) nch = 0, nblk += gridDim.x;
    if (nblk < blocks) load_w(nxt, nblk, nch), load_x(xn, nch);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const uint4 xv = xc[s], lo = cur[s][0], hi = cur[s][1];
      mma_bf16(c, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
      mma_bf16(c, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
    }
    if (nch == 0) {  // the block's k is done
      float* mine = red + (warp * 32 + lane) * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) mine[i] = c[i], c[i] = 0.f;
      __syncthreads();
      if constexpr (ROPE)
        finish_rope(p, r, red, scale, rslot, reinterpret_cast<const __nv_bfloat16*>(rcs4), blk);
      else
        finish_block(p, red, scale, blk);
      __syncthreads();
    }
#pragma unroll
    for (int s = 0; s < STEPS; ++s) cur[s][0] = nxt[s][0], cur[s][1] = nxt[s][1], xc[s] = xn[s];
    blk = nblk, ch = nch;
  }
}

template <bool STAGED, bool ROPE>
int launch(const Params& p, const Rope& r, void* stream) {
  const int dev = current_device();  // the attribute belongs to the device current at the call
  const size_t smem = (RED_FLOATS + NORM_FLOATS) * sizeof(float) + (STAGED ? (size_t)p.M * (p.K / 8 + 1) * 16 : 0)
                      + (ROPE ? ROPE_BYTES : 0);
  if (const int e = allow_dynamic_smem<linear_kernel<STAGED, ROPE>>(smem, dev)) return e;
  const int blocks = p.N / 16, ctas = sm_count(dev) * SE_GRID_CTAS;
  return launch_maybe_pdl(linear_kernel<STAGED, ROPE>, dim3(blocks < ctas ? blocks : ctas), dim3(THREADS), smem,
                          stream, p.pdl, p, r);
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

// K must be a multiple of this: the wrapper checks it against the build it loaded.
extern "C" int se_linear_k_multiple() { return K_MULTIPLE; }

// CTAs an SM in the grid (the wrapper checks it against the build it loaded).
extern "C" int se_linear_grid_ctas() { return SE_GRID_CTAS; }

// The shared memory a launch needs (bytes): the wrapper checks it against the device's.
extern "C" long long se_linear_smem(int M, int K, int staged, int rope) {
  return (long long)(RED_FLOATS + NORM_FLOATS) * sizeof(float) + (staged ? (long long)M * (K / 8 + 1) * 16 : 0)
         + (rope ? ROPE_BYTES : 0);
}
