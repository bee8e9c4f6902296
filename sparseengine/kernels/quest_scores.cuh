// Quest's page scores by a CTA of 8 warps over a run of work items: the device code of
// quest_scores.cu's kernel, in a header of its own so that another launch can score with it (tag
// quest-pick-experiment: the scores and the choice in one launch, measured slower). Everything is in namespace qscore.
//
// Layout: CTAs of 8 warps, 2 an SM, each taking a contiguous run of work items; an item is
// (request b, 16 * 8 / Hkv pages), and warp w scores head w % Hkv of its 16-page tile
// w / Hkv, so a CTA reads whole page rows of the bounds. A tile is one mma.sync m16n8k16
// product a 32-channel step: A = the bounds of 16 pages (lane l holds 16 B of pages g and
// g + 8 at channels 32 s + 8 t, g = l / 4, t = l % 4), B = the group's query rows in
// bf16, max(q, 0) against M and min(q, 0) against m (the same sum: M >= m). Which channel
// an MMA slot holds does not matter to the sum as long as A and B agree (as in
// cuda_linear.cu). C's columns are the query heads; lanes 4 apart reduce the max over the
// group's heads.
// The fold (a decode step's key, the request's newest token at `slots[b]`, in its last
// page): the lanes holding that page fold the key into the bounds in their registers
// (offset 0 starts the page afresh), score with them and write them back. Maxima propagate
// NaN, as the torch reference's do. q and the key, which the kernel before writes, are read
// through L2 (ld.global.cg), never a non-coherent path.
// `pdl`: launched as a programmatic dependent launch, only with the fold: the CTA loads its
// first tile's page ids and bounds, then waits (griddepcontrol.wait) for the kernel before
// (the qkv linear, which writes q and the key) before it reads q, the key or writes
// anything. Those early loads may run while kernels before the qkv linear still run (it
// lets its dependents launch at its start); they are safe because in the fold path no
// kernel of the step writes this layer's bounds (only this kernel's fold, a step earlier,
// and the minmax update, which runs instead of the fold, and then this kernel is launched
// without PDL), and the page table and lengths are copied in before the step's kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mma_bf16.cuh"

namespace qscore {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int D = 128;        // head dim: 4 steps of 32 channels, 16 B a lane a step
constexpr int STEPS = D / 32;
constexpr int TILE = 16;      // pages a warp's tile: the MMA's m
constexpr int MAX_GROUP = 8;  // query heads a KV head: the MMA's n
constexpr unsigned FULL = 0xffffffffu;

// SE_L2_PREFETCH (the build's): 0 plain streaming loads of the bounds (ld.global.cs); 64, 128 or 256 the same
// loads asking L2 to fetch that many bytes around each (a lane's 4 x 16 B steps of a page row are 64 B apart,
// so 256 brings the row's 256 B from DRAM at its first touch).
#ifndef SE_L2_PREFETCH
#define SE_L2_PREFETCH 0
#endif
#define SE_STR2(x) #x
#define SE_STR(x) SE_STR2(x)

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
#if SE_L2_PREFETCH
  uint4 v;
  asm volatile("ld.global.cs.L2::" SE_STR(SE_L2_PREFETCH) "B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  return __ldcs(p);
#endif
}

struct Args {
  const __nv_bfloat16* q;        // row (b, head) at b * qb + head * qh, D contiguous
  __nv_bfloat16* kmax;           // [num_pages, hkv, D] contiguous
  __nv_bfloat16* kmin;
  const int* table;              // row b at b * tb
  const void* kv_lens;           // [B] int32 or int64 (lens64)
  float* scores;                 // [B, hkv, sp] contiguous
  const __nv_bfloat16* k_cache;  // the fold's key: (page, off, head) at page * kp + off * ko + head * kh
  const void* slots;             // [B] int32 or int64 (slots64), -1: none; null: no fold
  long long qb, qh, tb, kp, ko, kh;
  int lens64, slots64, hkv, group, P, page_size, items_per_b, items, per_cta, pdl;
  int sp;                        // a scores row's length (P, or more)
};

// The larger of two floats, NaN if either is (torch's max, which the reference takes).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ long long load_index(const void* p, int is64, int i) {
  return is64 ? static_cast<const long long*>(p)[i] : static_cast<const int*>(p)[i];
}

// A warp's tile of an item: request b, pages p0 .. p0 + 15; the lane's pages g and g + 8.
struct Tile {
  int b, p0, n_pages;
  int id[2];  // the lane's two pages' physical ids, -1 for none of the request's
};

__device__ __forceinline__ Tile tile_of(const Args& a, int item, int warp, int g) {
  Tile t;
  t.b = item / a.items_per_b;
  const int tiles_per_item = WARPS / a.hkv;
  t.p0 = ((item % a.items_per_b) * tiles_per_item + warp / a.hkv) * TILE;
  const int n = (int)load_index(a.kv_lens, a.lens64, t.b);  // 32-bit arithmetic: lengths and slots < 2^31
  t.n_pages = (n + a.page_size - 1) / a.page_size;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int p = t.p0 + g + 8 * i;
    t.id[i] = p < t.n_pages && p < a.P ? a.table[t.b * a.tb + p] : -1;
  }
  return t;
}

// The lane's 16 B of each step of its two pages' bounds for head h (zeros off the request).
struct Bounds {
  uint4 hi[2][STEPS], lo[2][STEPS];
};

__device__ __forceinline__ void load_bounds(const Args& a, const Tile& t, int h, int lane4, Bounds& m) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const bool ok = t.id[i] >= 0;
    const size_t row = ((size_t)(ok ? t.id[i] : 0) * a.hkv + h) * (D / 8) + lane4;
    const uint4* hi = reinterpret_cast<const uint4*>(a.kmax) + row;
    const uint4* lo = reinterpret_cast<const uint4*>(a.kmin) + row;
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      m.hi[i][s] = ok ? load_stream(hi + s * 4) : make_uint4(0u, 0u, 0u, 0u);
      m.lo[i][s] = ok ? load_stream(lo + s * 4) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// The lane's 16 B of each step of its query column (head h * group + g; zeros past the
// group), bf16, into its own slots of shared memory `q` ([STEPS][32], a warp's): only the
// lane reads them back, and they leave its registers to the tile's bounds (no spills).
__device__ __forceinline__ void load_query(const Args& a, int b, int h, int g, int lane4, uint4 (*q)[32]) {
  const uint4* row = reinterpret_cast<const uint4*>(a.q + b * a.qb + (long long)(h * a.group + g) * a.qh) + lane4;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int s = 0; s < STEPS; ++s) q[s][lane] = g < a.group ? __ldcg(row + s * 4) : make_uint4(0u, 0u, 0u, 0u);
}

// Two bf16 q values as (max(q, 0), min(q, 0)) by their sign bits: a negative half goes to
// the second, the others to the first (-0.0 to the second; a NaN by its sign bit, the sum
// is NaN either way).
__device__ __forceinline__ void split_signs(uint32_t w, uint32_t& pos, uint32_t& neg) {
  const uint32_t neg_mask = ((w & 0x80008000u) >> 15) * 0xffffu;
  pos = w & ~neg_mask;
  neg = w & neg_mask;
}

// The decode step's key into the lane's page i bounds (when that page is the request's last and
// the row has a key) and back to memory: offset 0 starts the page afresh.
__device__ __forceinline__ void fold(const Args& a, const Tile& t, int h, int lane4, Bounds& m) {
  if (a.slots == nullptr) return;
  const int slot = (int)load_index(a.slots, a.slots64, t.b);  // the wrapper checks pages x page_size < 2^31
  if (slot < 0) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (t.id[i] < 0 || t.p0 + (threadIdx.x & 31) / 4 + 8 * i != t.n_pages - 1) continue;
    const int page = slot / a.page_size, off = slot % a.page_size;
    const uint4* key = reinterpret_cast<const uint4*>(a.k_cache + page * a.kp + off * a.ko + h * a.kh) + lane4;
    const size_t row = ((size_t)t.id[i] * a.hkv + h) * (D / 8) + lane4;
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const uint4 k = __ldcg(key + s * 4);
      if (off != 0) {
        const __nv_bfloat162* kk = reinterpret_cast<const __nv_bfloat162*>(&k);
        __nv_bfloat162* hi = reinterpret_cast<__nv_bfloat162*>(&m.hi[i][s]);
        __nv_bfloat162* lo = reinterpret_cast<__nv_bfloat162*>(&m.lo[i][s]);
#pragma unroll
        for (int j = 0; j < 4; ++j) hi[j] = __hmax2_nan(hi[j], kk[j]), lo[j] = __hmin2_nan(lo[j], kk[j]);
      } else {
        m.hi[i][s] = k, m.lo[i][s] = k;
      }
      reinterpret_cast<uint4*>(a.kmax)[row + s * 4] = m.hi[i][s];
      reinterpret_cast<uint4*>(a.kmin)[row + s * 4] = m.lo[i][s];
    }
  }
}

// The tile's scores: C = bounds x query columns, the max over the group's columns, stored by
// lanes t = 0 (page g) and t = 1 (page g + 8); -inf for the tile's pages past the request's.
__device__ __forceinline__ void score(const Args& a, const Tile& t, int h, const Bounds& m, const uint4 (*q)[32]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, col = 2 * (lane & 3);
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const uint4 h0 = m.hi[0][s], h1 = m.hi[1][s], l0 = m.lo[0][s], l1 = m.lo[1][s], qs = q[s][lane];
    uint32_t p[4], n[4];
    split_signs(qs.x, p[0], n[0]);
    split_signs(qs.y, p[1], n[1]);
    split_signs(qs.z, p[2], n[2]);
    split_signs(qs.w, p[3], n[3]);
    mma_bf16(c, h0.x, h1.x, h0.y, h1.y, p[0], p[1]);
    mma_bf16(c, h0.z, h1.z, h0.w, h1.w, p[2], p[3]);
    mma_bf16(c, l0.x, l1.x, l0.y, l1.y, n[0], n[1]);
    mma_bf16(c, l0.z, l1.z, l0.w, l1.w, n[2], n[3]);
  }
  const float ninf = -__int_as_float(0x7f800000);
  float v[2];
  v[0] = max_nan(col < a.group ? c[0] : ninf, col + 1 < a.group ? c[1] : ninf);  // page g, columns col, col + 1
  v[1] = max_nan(col < a.group ? c[2] : ninf, col + 1 < a.group ? c[3] : ninf);  // page g + 8
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    v[i] = max_nan(v[i], __shfl_xor_sync(FULL, v[i], 1));
    v[i] = max_nan(v[i], __shfl_xor_sync(FULL, v[i], 2));
  }
  if ((lane & 3) < 2) {
    const bool second = lane & 1;
    const int p = t.p0 + g + (second ? 8 : 0);
    const bool ok = (second ? t.id[1] : t.id[0]) >= 0;
    if (p < a.P) a.scores[((long long)t.b * a.hkv + h) * a.sp + p] = ok ? (second ? v[1] : v[0]) : ninf;
  }
}

// The CTA's items [first, last) (`a.pdl`: its first tile's page ids and bounds loaded before
// griddepcontrol.wait); `q_smem`: the CTA's [WARPS][STEPS][32] staging of the query columns.
__device__ __forceinline__ void score_items(const Args& a, int first, int last, uint4 (*q_smem)[STEPS][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, lane4 = lane & 3;
  const int h = warp % a.hkv;
  Tile t = tile_of(a, first, warp, g);
  Bounds m;
  if (t.p0 < t.n_pages) load_bounds(a, t, h, lane4, m);  // before the wait: the bounds and page ids are not the
  if (a.pdl) asm volatile("griddepcontrol.wait;" ::: "memory");  // kernel before's (the header)
  uint4 (*q)[32] = q_smem[warp];
  int q_of = -1;  // the request whose query column q holds
  for (int item = first; item < last; ++item) {
    Tile next;
    if (item + 1 < last) next = tile_of(a, item + 1, warp, g);  // its page ids in flight while this tile scores
    if (t.p0 < t.n_pages) {  // else the tile is past the request's pages: nothing to score, nothing written
      if (t.b != q_of) load_query(a, t.b, h, g, lane4, q), q_of = t.b;
      fold(a, t, h, lane4, m);
      score(a, t, h, m, q);
    }
    if (item + 1 < last) {
      t = next;
      if (t.p0 < t.n_pages) load_bounds(a, t, h, lane4, m);
    }
  }
}

// The launch's Args from an entry point's arguments (se_quest_scores's, in its order), per_cta 0 (the launch
// sizes the grid) and rows of P rounded up to 4 floats; false where one is out of range.
inline bool make_args(Args& a, const void* q, long long qb, long long qh, void* kmax, void* kmin, const void* table,
                      long long tb, const void* kv_lens, int lens64, void* scores, const void* k_cache, long long kp,
                      long long ko, long long kh, const void* slots, int slots64, int B, int hkv, int group, int P,
                      int page_size, int pdl) {
  if (B < 0 || hkv < 1 || WARPS % hkv || group < 1 || group > MAX_GROUP || P < 1 || page_size < 1) return false;
  const int pages_per_item = TILE * (WARPS / hkv), items_per_b = (P + pages_per_item - 1) / pages_per_item;
  a = {(const __nv_bfloat16*)q, (__nv_bfloat16*)kmax, (__nv_bfloat16*)kmin, (const int*)table, kv_lens,
       (float*)scores, (const __nv_bfloat16*)k_cache, slots, qb, qh, tb, kp, ko, kh, lens64, slots64, hkv, group, P,
       page_size, items_per_b, B * items_per_b, 0, pdl, (P + 3) / 4 * 4};
  return true;
}

}  // namespace qscore
