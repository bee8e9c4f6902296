// Decode attention over a selection of the paged cache in CUDA: one launch that gathers the
// selected keys and values, attends and merges its splits (sparse_attention_cuda.py builds it
// with nvcc, launches it and holds its contract, which is sparse_decode.py's page and rows
// variants: the same outputs, and the lse in natural log).
//
// Why CUDA: the Triton split-K launch chains, tile by tile, the selection's load, the page
// table's, then the tile's keys; and its splits are merged by a second launch. Here each warp
// looks up all of its chunks' rows first, then keeps STAGES chunks of K and V in flight with
// cp.async, and a row's splits (a cluster of CTAs) merge through distributed shared memory.
//
// Work: a (request b, KV head h) row's selection is cut into chunks of 16 tokens (PAGES: a
// chosen page, which must hold 16 tokens; rows: 16 consecutive entries, each a pool row
// `page * page_size + offset`). The row's `splits` CTAs (one cluster) have 4 warps each; warp
// w of CTA s takes chunks s * 4 + w, + 4 * splits, ... A chunk is two mma tiles: S = Q K^T
// with the group's query heads as the rows of A (padded to 16 with zeros; at most 8), then
// O += P V with V read through ldmatrix.trans. An online softmax in the log2 domain per warp;
// the warps merge in shared memory, the CTAs through the cluster's shared memory, CTA r
// writing the group's heads r, r + splits, ...
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch_pdl.cuh"
#include "mma_bf16.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int D = 128;                // head dim
constexpr int CHUNK = 16;             // tokens a chunk
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
#ifndef SE_STAGES
#define SE_STAGES 2
#endif
constexpr int STAGES = SE_STAGES;     // chunks a warp keeps in flight (the build's -DSE_STAGES)
constexpr int MAX_CHUNKS = 16;        // chunks a warp may take (the host sizes `splits` so none takes more)
constexpr int MAX_SPLITS = 8;         // CTAs a row: a portable cluster
constexpr int MAX_GROUP = 8;          // query heads a KV head
constexpr int ROW_BYTES = D * 2 + 16;  // a token's K (or V) in shared memory, padded: ldmatrix rows on distinct banks
constexpr int STAGE_BYTES = 2 * CHUNK * ROW_BYTES;  // K then V
constexpr int PIPE_BYTES = WARPS * STAGES * STAGE_BYTES;
constexpr int ROWS_BYTES = WARPS * MAX_CHUNKS * CHUNK * 4;  // the rows variant's pool rows, a warp's chunks
constexpr float NEG_INF = -__builtin_huge_valf();

struct Args {
  const __nv_bfloat16* q;  // [B, Hq, D]: row b at b * sqb, head at hq * sqh (elements), channels contiguous
  long long sqb, sqh;
  const __nv_bfloat16* k;  // [pages, page_size, Hkv, D] contiguous
  const __nv_bfloat16* v;
  const void* sel;         // [B, Hkv, K] (entries contiguous), int32 or int64 (sel64)
  long long ssb, ssh;
  const void* nsel;        // [B, Hkv] int32 or int64 (nsel64), row b's count of head h at b * snb + h * snh
  long long snb, snh;
  const int* page_table;   // PAGES: [B, *] int32, row b at b * spt
  long long spt;
  const void* kv_lens;     // PAGES: [B], int32 or int64 (lens64)
  __nv_bfloat16* out;      // [B, Hq, D]: row b at b * sob, head at hq * soh
  long long sob, soh;
  float* lse;              // [B * Hq] natural log, or null
  int Hkv, group, K, splits, sel64, nsel64, lens64;
  float scale_log2;        // softmax scale * log2(e)
  int trigger;             // let a kernel launched after this one with PDL start at once (the o projection)
};

// What a CTA keeps for the merges: each warp's (m, l, O) and then the CTA's, which the
// cluster's other CTAs read. Placed over the pipeline's buffers once they are drained.
struct Merge {
  float warp_o[WARPS][MAX_GROUP][D];
  float warp_m[WARPS][MAX_GROUP], warp_l[WARPS][MAX_GROUP];
  float o[MAX_GROUP][D];
  float m[MAX_GROUP], l[MAX_GROUP];
};
static_assert(sizeof(Merge) <= PIPE_BYTES, "the merge area lies over the pipeline's buffers");

__device__ __forceinline__ long long load_index(const void* p, long long i, int wide) {
  return wide ? ((const long long*)p)[i] : (long long)((const int*)p)[i];
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, bypassing L1; zeros where `valid` is false (no bytes read).
__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  return *(const uint32_t*)&p;
}

// Where a warp's chunks read their tokens: PAGES, the page lane i looked up for chunk i (phys,
// and how many of its 16 tokens are below kv_len); rows, the pool rows staged in shared memory.
template <bool PAGES>
struct Chunks {
  int phys, ntok;   // PAGES: lane i's chunk
  const int* rows;  // rows: this warp's [MAX_CHUNKS][CHUNK] pool rows, -1 where none

  // chunk i's page and token count (PAGES; every lane of the warp calls it)
  __device__ __forceinline__ int2 page(int i) const {
    return make_int2(__shfl_sync(0xffffffffu, phys, i), __shfl_sync(0xffffffffu, ntok, i));
  }
  __device__ __forceinline__ unsigned valid_mask(int i, int lane) const {  // bit t: token t attended
    if constexpr (PAGES) {
      const int n = page(i).y;
      return n >= CHUNK ? 0xffffu : (1u << n) - 1u;
    } else {
      return __ballot_sync(0xffffffffu, lane < CHUNK && rows[i * CHUNK + lane] >= 0) & 0xffffu;
    }
  }
};

// Chunk i's K and V into `stage`: lane l copies part l % 16 (16 bytes) of tokens l / 16 + 2j;
// a missing token's copies write zeros.
template <bool PAGES>
__device__ __forceinline__ void issue(const Args& a, const Chunks<PAGES>& c, int i, int h, char* stage, int lane) {
  const int part = lane & 15;
  int2 pg = make_int2(0, 0);
  if constexpr (PAGES) pg = c.page(i);
#pragma unroll
  for (int j = 0; j < CHUNK / 2; ++j) {
    const int t = (lane >> 4) + 2 * j;
    const int r = PAGES ? (t < pg.y ? pg.x * CHUNK + t : -1) : c.rows[i * CHUNK + t];
    const long long off = ((long long)(r < 0 ? 0 : r) * a.Hkv + h) * D + part * 8;
    const uint32_t dst = smem_addr(stage + t * ROW_BYTES + part * 16);
    copy16(dst, a.k + off, r >= 0);
    copy16(dst + CHUNK * ROW_BYTES, a.v + off, r >= 0);
  }
}

template <bool PAGES>
__global__ void __launch_bounds__(THREADS) attend_kernel(const Args a) {
  if (a.trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  extern __shared__ __align__(16) char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int split = (int)cluster.block_rank(), row = blockIdx.y;
  const int b = row / a.Hkv, h = row % a.Hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;  // the mma fragments' row and column pair

  // This warp's share of the row's chunks: chunks first, + stride, ... below the count. Its
  // entries within the row's capacity K are loaded before the count arrives (the loads overlap).
  const int stride = a.splits * WARPS, first = split * WARPS + warp;
  const int cap_chunks = PAGES ? a.K : (a.K + CHUNK - 1) / CHUNK;
  const int cap_mine = first < cap_chunks ? (cap_chunks - first + stride - 1) / stride : 0;
  const long long sel_row = b * a.ssb + h * a.ssh;
  constexpr int PER_LANE = MAX_CHUNKS * CHUNK / 32;  // the rows variant's entries a lane loads
  long long ent[PAGES ? 1 : PER_LANE];
  long long len = 0;
  if constexpr (PAGES) {
    ent[0] = lane < cap_mine ? load_index(a.sel, sel_row + first + lane * stride, a.sel64) : -1;
    len = load_index(a.kv_lens, b, a.lens64);
  } else {
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      const int e = lane + 32 * j;
      const long long entry = (long long)(first + (e / CHUNK) * stride) * CHUNK + e % CHUNK;
      ent[j] = e < cap_mine * CHUNK && entry < a.K ? load_index(a.sel, sel_row + entry, a.sel64) : -1;
    }
  }
  long long n = load_index(a.nsel, b * a.snb + h * a.snh, a.nsel64);
  n = n < 0 ? 0 : (n > a.K ? a.K : n);
  const int nchunks = PAGES ? (int)n : (int)((n + CHUNK - 1) / CHUNK);
  const int mine = first < nchunks ? (nchunks - first + stride - 1) / stride : 0;

  Chunks<PAGES> chunks{0, 0, (const int*)(smem + PIPE_BYTES) + warp * MAX_CHUNKS * CHUNK};
  if constexpr (PAGES) {
    const long long page = ent[0];
    if (lane < mine && page >= 0 && page * CHUNK < len) {
      chunks.phys = a.page_table[b * a.spt + page];
      chunks.ntok = (int)min((long long)CHUNK, len - page * CHUNK);
    }
  } else {
    int* rows = (int*)chunks.rows;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      const int e = lane + 32 * j;
      const long long entry = (long long)(first + (e / CHUNK) * stride) * CHUNK + e % CHUNK;
      if (e < mine * CHUNK) rows[e] = entry < n && ent[j] >= 0 ? (int)ent[j] : -1;
    }
    __syncwarp();
  }

  // the group's query heads as A fragments (rows g < group; rows g + 8 are zero)
  uint32_t qa[D / 16][2];
  {
    const __nv_bfloat16* qh = a.q + b * a.sqb + (long long)(h * a.group + g) * a.sqh;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      qa[ks][0] = g < a.group ? *(const uint32_t*)(qh + ks * 16 + t4 * 2) : 0u;
      qa[ks][1] = g < a.group ? *(const uint32_t*)(qh + ks * 16 + t4 * 2 + 8) : 0u;
    }
  }

  char* pipe = smem + warp * STAGES * STAGE_BYTES;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < mine) issue<PAGES>(a, chunks, s, h, pipe + s * STAGE_BYTES, lane);
    commit();
  }

  float o[D / 8][2] = {};   // O's rows g: channels dt * 8 + 2 * t4, + 1
  float m = NEG_INF, l = 0.f;
  // ldmatrix addresses: K (B of S = Q K^T): tokens (lane / 16) * 8 + lane % 8, channels + ((lane / 8) % 2) * 8;
  // V (B of O = P V, transposed): tokens lane % 8 + ((lane / 8) % 2) * 8, channels + (lane / 16) * 8
  const int k_off = (((lane >> 4) << 3) + (lane & 7)) * ROW_BYTES + ((lane >> 3) & 1) * 16;
  const int v_off = CHUNK * ROW_BYTES + ((lane & 7) + (((lane >> 3) & 1) << 3)) * ROW_BYTES + (lane >> 4) * 16;
  for (int i = 0; i < mine; ++i) {
    const int next = i + STAGES - 1;
    if (next < mine) issue<PAGES>(a, chunks, next, h, pipe + (next % STAGES) * STAGE_BYTES, lane);
    commit();
    const unsigned valid = chunks.valid_mask(i, lane);
    wait_groups<STAGES - 1>();
    __syncwarp();
    const uint32_t stage = smem_addr(pipe + (i % STAGES) * STAGE_BYTES);

    float s[2][4] = {};  // S's n-tiles of 8 tokens
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t kb[4];
      ldmatrix_x4(kb, stage + k_off + ks * 32);
      mma_bf16(s[0], qa[ks][0], 0u, qa[ks][1], 0u, kb[0], kb[1]);
      mma_bf16(s[1], qa[ks][0], 0u, qa[ks][1], 0u, kb[2], kb[3]);
    }
    float x[4];  // tokens 2 * t4, + 1, 8 + 2 * t4, + 1 of head g
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = (e >> 1) * 8 + t4 * 2 + (e & 1);
      x[e] = (valid >> tok) & 1u ? s[e >> 1][e & 1] * a.scale_log2 : NEG_INF;
    }
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx), base = m_new == NEG_INF ? 0.f : m_new;
    const float alpha = exp2f(m - base);
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = exp2f(x[e] - base);
    l = l * alpha + (x[0] + x[1]) + (x[2] + x[3]);
    m = m_new;
    const uint32_t pa0 = pack_bf16(x[0], x[1]), pa2 = pack_bf16(x[2], x[3]);
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, stage + v_off + dt * 32);
      float c0[4] = {o[2 * dt][0] * alpha, o[2 * dt][1] * alpha, 0.f, 0.f};
      float c1[4] = {o[2 * dt + 1][0] * alpha, o[2 * dt + 1][1] * alpha, 0.f, 0.f};
      mma_bf16(c0, pa0, 0u, pa2, 0u, vb[0], vb[1]);
      mma_bf16(c1, pa0, 0u, pa2, 0u, vb[2], vb[3]);
      o[2 * dt][0] = c0[0], o[2 * dt][1] = c0[1], o[2 * dt + 1][0] = c1[0], o[2 * dt + 1][1] = c1[1];
    }
    __syncwarp();  // the stage is refilled by the next iteration's copies
  }
  asm volatile("cp.async.wait_all;\n" ::);
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // every warp is done with the pipeline's buffers

  Merge& mg = *(Merge*)smem;
  if (g < a.group) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      mg.warp_o[warp][g][dt * 8 + 2 * t4] = o[dt][0];
      mg.warp_o[warp][g][dt * 8 + 2 * t4 + 1] = o[dt][1];
    }
    if (t4 == 0) mg.warp_m[warp][g] = m, mg.warp_l[warp][g] = l;
  }
  __syncthreads();
  const int d = threadIdx.x;  // THREADS == D: a thread a channel
  for (int hh = 0; hh < a.group; ++hh) {
    float mm = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, mg.warp_m[w][hh]);
    const float base = mm == NEG_INF ? 0.f : mm;
    float acc = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = exp2f(mg.warp_m[w][hh] - base);
      acc += wt * mg.warp_o[w][hh][d];
      sum += wt * mg.warp_l[w][hh];
    }
    mg.o[hh][d] = acc;
    if (d == 0) mg.m[hh] = mm, mg.l[hh] = sum;
  }
  cluster.sync();  // every CTA of the row holds its (m, l, O)

  for (int hh = split; hh < a.group; hh += a.splits) {
    float mm = NEG_INF;
    for (int r = 0; r < a.splits; ++r) mm = fmaxf(mm, *cluster.map_shared_rank(&mg.m[hh], r));
    const float base = mm == NEG_INF ? 0.f : mm;
    float acc = 0.f, sum = 0.f;
    for (int r = 0; r < a.splits; ++r) {
      const float wt = exp2f(*cluster.map_shared_rank(&mg.m[hh], r) - base);
      acc += wt * *cluster.map_shared_rank(&mg.o[hh][d], r);
      sum += wt * *cluster.map_shared_rank(&mg.l[hh], r);
    }
    const int hq = h * a.group + hh;
    a.out[b * a.sob + (long long)hq * a.soh + d] = __float2bfloat16_rn(sum > 0.f ? acc / sum : 0.f);
    if (a.lse != nullptr && d == 0)
      a.lse[(long long)b * a.Hkv * a.group + hq] = sum > 0.f ? (mm + log2f(sum)) * 0.6931471805599453f : NEG_INF;
  }
  cluster.sync();  // no CTA leaves while another reads its shared memory
}

template <bool PAGES>
int launch(const Args& a, int rows, void* stream) {
  const size_t smem = PIPE_BYTES + (PAGES ? 0 : ROWS_BYTES);
  const int dev = current_device();
  if (const int e = allow_dynamic_smem<attend_kernel<PAGES>>(smem, dev)) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(a.splits, rows);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = a.splits;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, attend_kernel<PAGES>, a);
}

}  // namespace

// -> 0 when launched, a cudaError_t, -1 (an argument out of range: group 1..8, splits 1..8, a
// warp's chunks over the most it takes, rows over the grid's 65535). `pages`: the page variant
// (sel = logical pages of 16 tokens, page_table and kv_lens read); else the rows variant (sel =
// pool rows). Tensors as `Args` above; strides in elements. `trigger`: griddepcontrol.launch_dependents
// first (a kernel launched after it with PDL may start; it still waits for this one's writes).
extern "C" int se_sparse_attention(const void* q, long long sqb, long long sqh, const void* k, const void* v,
                                   const void* sel, long long ssb, long long ssh, int sel64, const void* nsel,
                                   long long snb, long long snh, int nsel64, const void* page_table, long long spt,
                                   const void* kv_lens, int lens64, void* out, long long sob, long long soh, void* lse,
                                   int B, int Hkv, int group, int K, int pages, int splits, float scale_log2,
                                   int trigger, void* stream) {
  if (B < 0 || Hkv < 1 || group < 1 || group > MAX_GROUP || K < 1 || splits < 1 || splits > MAX_SPLITS) return -1;
  const long long chunks = pages ? K : (K + CHUNK - 1) / CHUNK;
  if ((chunks + splits * WARPS - 1) / (splits * WARPS) > MAX_CHUNKS || (long long)B * Hkv > 65535) return -1;
  if (B == 0) return 0;
  const Args a = {(const __nv_bfloat16*)q, sqb, sqh, (const __nv_bfloat16*)k, (const __nv_bfloat16*)v, sel, ssb,
                  ssh, nsel, snb, snh, (const int*)page_table, spt, kv_lens, (__nv_bfloat16*)out, sob, soh,
                  (float*)lse, Hkv, group, K, splits, sel64, nsel64, lens64, scale_log2, trigger};
  return pages ? launch<true>(a, B * Hkv, stream) : launch<false>(a, B * Hkv, stream);
}

// The most chunks of 16 a row may have at `splits` CTAs a row.
extern "C" int se_sparse_attention_max_chunks(int splits) { return splits * WARPS * MAX_CHUNKS; }
