// Quest's page choice for one (request, KV head) row by a CTA of 256 threads: the device code of
// quest_select.cu's kernel, in a header of its own so that another launch can choose with it (tag
// quest-pick-experiment). Everything is in namespace qsel.
//
// A row: thread t holds the keys of pages [t * KPT, t * KPT + KPT) in registers (0 where a
// page is not a middle page: a key of a real score is never 0 but for one NaN pattern).
// A score's key is an unsigned int in the float's order (-0.0 as +0.0).
// 1. L, a lower bound of the m-th largest of the threads' maxima (its top 2 * BOUND_PASSES
//    bits, by warp 0): at least m middle keys are >= L, so every key the choice takes is >= L.
// 2. The candidates (keys >= L), in page order, into shared memory (one block scan).
// 3. With at most CAND_CAP of them, each thread ranks one or two candidates against all of
//    them (the keys above it plus the earlier keys equal to it: ranks 0..n-1, each once); the
//    ranks below m are the choice, each written at its place among them (a block scan):
//    ascending pages, no sort. With more (many equal scores), the whole block finds the m-th
//    largest key t (16 passes of 2 bits over the registers) and takes the keys > t and the
//    earliest keys == t until m are taken.
// Sink and recent slots are written by arithmetic, as in the Triton kernel.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace qsel {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int CAND_CAP = 2 * THREADS;     // candidates the block ranks (2 a thread)
constexpr int GROUPS_PER_LANE = THREADS / 32;  // the threads' maxima warp 0 holds a lane
// Warp 0's passes for L (2 bits each). At 8 (16 bits) the engine's rows at the 128K shape had up to 249 candidates
// (157 on average) against 135 (117) for the exact m-th maximum; at 12 (24 bits) 135 (118): the choice took
// 224 us a Quest b=6 step against 249 (session 54, H200), where 4 more passes cost ~0.45 us a launch.
constexpr int BOUND_PASSES = 12;
constexpr unsigned FULL = 0xffffffffu;

struct Args {
  const float* scores;  // row (b, h) at b * sb + h * sh, its P pages contiguous
  long long sb, sh;
  const void* kv_lens;  // [B] int32 or int64 (lens64)
  long long* pages;     // [B, H, K]
  int* counts;          // [B, H]
  int lens64, H, P, K, page_size, sink_pages, recent, total, top, pdl;
};

struct Shared {
  alignas(16) int red[2][WARPS][4];  // a block search's counts, a buffer a pass parity
  int2 scan[2][WARPS];    // the block scans' warp totals (two scans in a row)
  unsigned maxima[THREADS];
  unsigned bound;
  alignas(16) unsigned cand_key[CAND_CAP + 4];  // + 0s up to a multiple of 4 (rank_of reads them as uint4)
  int cand_page[CAND_CAP];
};

// The float's order as an unsigned int: negative floats flipped whole, others with the
// sign bit set; -0.0 counts as +0.0.
__device__ __forceinline__ unsigned key_of(float s) {
  const unsigned bits = __float_as_uint(s == 0.0f ? 0.0f : s);
  return (bits >> 31) ? ~bits : bits | 0x80000000u;
}

// 2 key bits a pass: the counts of keys >= lo + d * step for d = 1, 2, 3 (keys 0 never
// count: every candidate is >= 1).
template <int N>
__device__ __forceinline__ void count3(const unsigned (&k)[N], unsigned lo, unsigned step, int& n1, int& n2,
                                       int& n3) {
  const unsigned c1 = lo + step, c2 = c1 + step, c3 = c2 + step;
  n1 = n2 = n3 = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    n1 += k[j] >= c1;
    n2 += k[j] >= c2;
    n3 += k[j] >= c3;
  }
}

__device__ __forceinline__ unsigned digit(int t1, int t2, int t3, int m) {
  return t3 >= m ? 3u : t2 >= m ? 2u : t1 >= m ? 1u : 0u;
}

// In one warp: the m-th largest of the lanes' keys, its top 2 * PASSES bits (the rest 0: a
// lower bound with at least m keys >= it); 0 when fewer than m keys are >= 1.
template <int N, int PASSES>
__device__ unsigned warp_kth(const unsigned (&k)[N], int m) {
  unsigned lo = 0, step = 1u << 30;
#pragma unroll 1
  for (int pass = 0; pass < PASSES; ++pass) {
    int n1, n2, n3;
    count3(k, lo, step, n1, n2, n3);
    lo += digit(__reduce_add_sync(FULL, n1), __reduce_add_sync(FULL, n2), __reduce_add_sync(FULL, n3), m) * step;
    step >>= 2;
  }
  return lo;
}

// The same over the whole block (all 32 bits): one barrier a pass.
template <int N>
__device__ unsigned block_kth(const unsigned (&k)[N], int m, Shared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned lo = 0, step = 1u << 30;
#pragma unroll 1
  for (int pass = 0; pass < 16; ++pass) {
    int n1, n2, n3;
    count3(k, lo, step, n1, n2, n3);
    n1 = __reduce_add_sync(FULL, n1);
    n2 = __reduce_add_sync(FULL, n2);
    n3 = __reduce_add_sync(FULL, n3);
    int* buf = s.red[pass & 1][warp];
    if (lane == 0) *reinterpret_cast<int4*>(buf) = make_int4(n1, n2, n3, 0);
    __syncthreads();  // this pass's counts in; the other buffer's readers of the last pass are past it
    int t1 = 0, t2 = 0, t3 = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const int4 v = *reinterpret_cast<const int4*>(s.red[pass & 1][w]);
      t1 += v.x, t2 += v.y, t3 += v.z;
    }
    lo += digit(t1, t2, t3, m) * step;
    step >>= 2;
  }
  return lo;
}

// Exclusive prefix sums of (a, b) over the warp's lanes; the warp's totals in `total`.
__device__ __forceinline__ int2 warp_scan2(int a, int b, int2& total) {
  const int lane = threadIdx.x & 31;
  int ia = a, ib = b;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int x = __shfl_up_sync(FULL, ia, o), y = __shfl_up_sync(FULL, ib, o);
    if (lane >= o) ia += x, ib += y;
  }
  total = make_int2(__shfl_sync(FULL, ia, 31), __shfl_sync(FULL, ib, 31));
  return make_int2(ia - a, ib - b);
}

// The same over the block's threads, in thread order (`buf`: this scan's warp totals).
__device__ int2 block_scan2(int a, int b, int2 (&buf)[WARPS], int2& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int2 wt;
  const int2 in = warp_scan2(a, b, wt);
  if (lane == 0) buf[warp] = wt;
  __syncthreads();
  int2 pre = make_int2(0, 0);
  total = make_int2(0, 0);
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const int2 v = buf[w];
    if (w < warp) pre.x += v.x, pre.y += v.y;
    total.x += v.x, total.y += v.y;
  }
  return make_int2(pre.x + in.x, pre.y + in.y);
}

// Writes the m chosen pages at slots out[0..m) ascending, from keys k (0: none) on pages
// page_of(j), given t, the m-th largest key: every key > t, then the earliest keys == t
// until m are taken. `pre`/`total`: this holder's exclusive prefix (and the totals) of its
// (> t, == t) counts in page order.
template <int N, typename PageOf>
__device__ __forceinline__ void write_chosen(const unsigned (&k)[N], PageOf page_of, unsigned t, int m, int2 pre,
                                             int2 total, long long* out) {
  const int ties = m - total.x;
  int slot = pre.x + min(pre.y, ties), eq = pre.y;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const bool take = k[j] > t || (k[j] == t && k[j] != 0u && eq++ < ties);
    if (take) out[slot++] = page_of(j);
  }
}

template <int N>
__device__ __forceinline__ int2 gt_eq(const unsigned (&k)[N], unsigned t) {
  int gt = 0, eq = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) gt += k[j] > t, eq += k[j] == t && k[j] != 0u;
  return make_int2(gt, eq);
}

// The rank of key k (>= 1), the i-th of the n candidates in page order in `keys`, among them: the keys above it
// plus the earlier keys equal to it (ties to the earlier page). The ranks of n keys are 0..n-1, each once.
// Entries [n, n rounded up to 4) must hold 0, which never counts.
__device__ __forceinline__ int rank_of(const unsigned* keys, int n, int i, unsigned k) {
  const uint4* k4 = reinterpret_cast<const uint4*>(keys);
  int r = 0;
#pragma unroll 4
  for (int j = 0; j < (n + 3) / 4; ++j) {  // an earlier key counts from k on (k - 1 < it), a later one above k
    const uint4 v = k4[j];
    const int j0 = 4 * j;
    r += (v.x > k - (j0 < i)) + (v.y > k - (j0 + 1 < i)) + (v.z > k - (j0 + 2 < i)) + (v.w > k - (j0 + 3 < i));
  }
  return r;
}

// The pick from the n_cand candidates in shared memory (at most CAND_CAP, in page order): each thread ranks
// PER of them (candidate c * THREADS + tid) against all; those ranked below m are the choice, written in page
// order (a block scan of the chosen).
template <int PER>
__device__ __forceinline__ void block_pick(Shared& s, int n_cand, int m, long long* out) {
  const int tid = threadIdx.x;
  bool chosen[PER];
#pragma unroll
  for (int c = 0; c < PER; ++c) {
    const int i = c * THREADS + tid;
    chosen[c] = i < n_cand && rank_of(s.cand_key, n_cand, i, s.cand_key[i]) < m;
  }
  int2 total;
  const int2 pre = block_scan2(chosen[0], PER > 1 && chosen[PER - 1], s.scan[1], total);
  if (chosen[0]) out[pre.x] = s.cand_page[tid];
  if (PER > 1 && chosen[PER - 1]) out[total.x + pre.y] = s.cand_page[THREADS + tid];
}

// VEC: the row, 16-byte aligned, is read as float4 into shared memory at once (P rounded up to 4 floats: the
// row's storage must hold them; the floats past P are never taken) and
// each thread takes its KPT keys from there (16-byte reads, threads KPT * 4 bytes apart: conflict-free
// where KPT / 4 is odd, as at the 128K table's KPT 36; 2-way at KPT 8 and 24, 4-way at 16 and 48, 8-way at 64);
// otherwise each thread loads its KPT scores itself.
// Every thread of the CTA returns at the same point (the caller may go on to another row after a
// barrier).
template <int KPT, bool VEC>
__device__ __forceinline__ void select_row(const Args& a, int row, Shared& s, float4* staged) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = row / a.H, h = row % a.H;
  const float* scores = a.scores + b * a.sb + h * a.sh;
  if (VEC) {  // the whole row, its loads in flight while kv_len is read (pages past the request's are masked below)
    const float4* src = reinterpret_cast<const float4*>(scores);
    for (int i = tid; i < (a.P + 3) / 4; i += THREADS) staged[i] = src[i];
  }
  const long long n = a.lens64 ? static_cast<const long long*>(a.kv_lens)[b] : static_cast<const int*>(a.kv_lens)[b];
  const int ps = a.page_size, sink = a.sink_pages;
  const int n_pages = (int)((n + ps - 1) / ps);
  const int recent_first = a.recent > 0 ? (int)((n > a.recent ? n - a.recent : 0) / ps) : n_pages;
  const bool everything = n <= a.total || recent_first <= sink;
  const int m = min(recent_first - sink, a.top);  // middle pages to take (when not everything)
  const int count = everything ? n_pages : sink + m + n_pages - recent_first;
  long long* out = a.pages + (long long)row * a.K;
  if (tid == 0) a.counts[row] = count;
  // Slots [0, sink) and [sink + m, count) hold consecutive pages; -1 after.
  for (int j = tid; j < a.K; j += THREADS) {
    const bool head = everything || j < sink;
    if (head || j >= sink + m) out[j] = j < count ? (head ? j : recent_first + (j - sink - m)) : -1;
  }
  if (everything) return;
  const int mid_end = min(recent_first, a.P);  // == recent_first for a valid kv_len
  if (recent_first - sink <= a.top) {  // every middle page is taken
    for (int p = sink + tid; p < mid_end; p += THREADS) out[p] = p;
    return;
  }
  const int page0 = tid * KPT;
  unsigned k[KPT], mx = 0;
  if (VEC) {
    __syncthreads();  // the row staged
#pragma unroll
    for (int j = 0; j < KPT; j += 4) {
      const float4 v = staged[page0 / 4 + j / 4];  // past the row only where no key is taken
      const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int p = page0 + j + i;
        k[j + i] = p >= sink && p < mid_end ? key_of(f[i]) : 0u;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
      const int p = page0 + j;
      k[j] = p >= sink && p < mid_end ? key_of(scores[p]) : 0u;
    }
  }
#pragma unroll
  for (int j = 0; j < KPT; ++j) mx = max(mx, k[j]);
  s.maxima[tid] = mx;
  __syncthreads();
  if (warp == 0) {  // 1. L from the threads' maxima (a lane holds GROUPS_PER_LANE)
    unsigned g[GROUPS_PER_LANE];
#pragma unroll
    for (int i = 0; i < GROUPS_PER_LANE; ++i) g[i] = s.maxima[lane * GROUPS_PER_LANE + i];
    const unsigned bound = warp_kth<GROUPS_PER_LANE, BOUND_PASSES>(g, m);
    if (lane == 0) s.bound = bound;
  }
  __syncthreads();
  const unsigned bound = s.bound;
  int mine = 0;  // 2. the candidates
#pragma unroll
  for (int j = 0; j < KPT; ++j) mine += k[j] != 0u && k[j] >= bound;
  int2 total;
  int slot = block_scan2(mine, 0, s.scan[0], total).x;
  const int n_cand = total.x;
  if (n_cand <= CAND_CAP) {
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
      if (k[j] != 0u && k[j] >= bound) s.cand_key[slot] = k[j], s.cand_page[slot++] = page0 + j;
    }
    if (tid < 4) s.cand_key[n_cand + tid] = 0u;
    __syncthreads();
    if (n_cand <= THREADS) block_pick<1>(s, n_cand, m, out + sink);  // 3. the candidates ranked
    else block_pick<2>(s, n_cand, m, out + sink);
    return;
  }
  const unsigned t = block_kth(k, m, s);  // more candidates than the block ranks: its search over every key
  const int2 ge = gt_eq(k, t);
  const int2 pre = block_scan2(ge.x, ge.y, s.scan[1], total);
  write_chosen(k, [&](int j) { return page0 + j; }, t, m, pre, total, out + sink);
}


constexpr int MAX_KPT = 64;  // the widest build's keys a thread: rows of up to THREADS * MAX_KPT pages

// f(std::integral_constant<int, KPT>{}) for the build whose keys a thread (4, 8, 16, 24, 36, 48 or 64) is the
// fewest that cover P pages; -1 past the widest. Host code: each launch instantiates its kernel at every width.
template <typename F>
inline int with_kpt(int P, F&& f) {
  if (P <= THREADS * 4) return f(std::integral_constant<int, 4>{});
  if (P <= THREADS * 8) return f(std::integral_constant<int, 8>{});
  if (P <= THREADS * 16) return f(std::integral_constant<int, 16>{});
  if (P <= THREADS * 24) return f(std::integral_constant<int, 24>{});
  if (P <= THREADS * 36) return f(std::integral_constant<int, 36>{});
  if (P <= THREADS * 48) return f(std::integral_constant<int, 48>{});
  if (P <= THREADS * MAX_KPT) return f(std::integral_constant<int, MAX_KPT>{});
  return -1;
}

}  // namespace qsel
