// OmniKV's token pick in CUDA, one launch: a cluster of CL CTAs a request (omnikv_select_cuda.py
// builds it with nvcc, launches it and holds its contract, which is omnikv_select.py's: sink +
// the top `budget` middle tokens ascending + recent, ties to the earlier token).
//
// Why CUDA: the Triton pick is a memset and six launches whose passes meet through global
// atomics and re-read the keys from L2 (~45 us a pick at the 128K benchmark's shape, 50 from
// the attention's end to the next launch: three picks a step). Session 61 (H100, b=3): 23.7 us
// alone against 36.6, and 43.5 us from the merge's end to the o projection's against 52.5. Here a cluster splits a
// request's row: each CTA holds its chunk's keys in shared memory, builds each radix pass's
// histogram there, and reads the other CTAs' histograms through distributed shared memory
// after one cluster barrier a pass.
//
// A request (n = kv_lens[b] > sink + budget + recent; else rank 0 writes 0 .. total-1):
// 1. Each CTA (1024 threads) loads its chunk's middle tokens [sink, n - recent) (the max over
//    the H rows; 8 loads in flight a thread, issued before n arrives), as keys in the float's
//    order (qsel::key_of: -0.0 as +0.0), into shared memory, padded a word every 32 so that
//    threads walking their own segments hit different banks; given a page table, also the
//    page entries of its tokens (where they fit in shared memory: `staged`).
// 2. Four passes of 8 bits settle t, the budget-th largest middle key, and `ties`, the keys
//    equal to t to take: each pass histograms the digit of the keys that match the bytes
//    settled so far (warp-aggregated shared atomics), then every CTA sums the cluster's
//    histograms bin by bin and finds the same digit (a suffix scan).
// 3. Each thread counts its segment's keys > t and == t; a block scan and the totals of the
//    CTAs before it (read from their shared memory) give its first slot and earlier ties, and
//    it writes its chosen tokens in order (and their pool rows, given a page table).
// `pdl`: waits (griddepcontrol.wait) for the kernel before it before reading the scores;
// `trigger`: lets a kernel launched after it with PDL start at once (it still waits for this
// one's writes).
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch_pdl.cuh"
#include "quest_select.cuh"  // qsel::key_of, qsel::warp_scan2

namespace cg = cooperative_groups;

namespace {

constexpr int THREADS = 1024;
constexpr int WARPS = THREADS / 32;
constexpr int BINS = 256;
constexpr int SCAN_WARPS = BINS / 32;
constexpr int PASSES = 4;
constexpr int LOADS = 8;          // a thread's score loads in flight at once
constexpr int MAX_CHUNK = 49152;  // tokens a CTA (its keys, padded, in 198 KB of shared memory)
constexpr int SMEM_CAP = 220 * 1024;  // dynamic shared memory a CTA may take (the page entries staged within it)
constexpr unsigned NONE = 0xffffffffu;  // no digit: a lane with no key in a histogram step

struct Args {
  const float* scores;  // row (b, h) at b * sb + h * sh, its L tokens contiguous
  long long sb, sh;
  const void* kv_lens;  // [B] int32 or int64 (lens64)
  long long* out;       // [B, total]
  int* counts;          // [B]
  const int* page_table;  // [B, *] at b * spt, or null (then no rows)
  long long spt;
  int* rows;              // [B, total]
  int lens64, H, L, chunk, page_size, sink, budget, recent, pdl, trigger;
  int key_words;          // dynamic shared memory: the padded keys, then (staged > 0) the chunk's page entries
  int staged;
};

struct Shared {
  int hist[PASSES][BINS];  // this CTA's histogram of each pass (the cluster reads it)
  int sum[BINS];           // the cluster's
  int warp_total[SCAN_WARPS];
  int2 scan[WARPS];
  int2 cta_total;  // this CTA's (keys > t, keys == t): the later CTAs read it
  int2 before;     // the earlier CTAs'
  unsigned digit;
  int need;
};

__device__ __forceinline__ int pad(int i) { return i + (i >> 5); }

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

__device__ __forceinline__ int row_of(const int* pt, long long token, int page_size) {
  return pt[token / page_size] * page_size + (int)(token % page_size);
}

// The digit of this pass: the largest d whose keys at or above it (among those that match the
// bytes settled so far) are at least `need`; s.need becomes what the keys == d must still give.
// The caller's __syncthreads after s.sum's writes orders them before these reads; s.digit and
// s.need were last read before the pass's cluster barrier.
__device__ void settle_digit(Shared& s, int need) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int v = 0, suffix = 0;
  if (tid == 0) s.digit = 0, s.need = need;  // kept only where no bin qualifies: kv_lens past L breaks the contract
  if (tid < BINS) {
    v = s.sum[BINS - 1 - tid];
    suffix = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(qsel::FULL, suffix, o);
      if (lane >= o) suffix += x;
    }
    if (lane == 31) s.warp_total[warp] = suffix;
  }
  __syncthreads();
  if (tid < BINS) {
    for (int w = 0; w < warp; ++w) suffix += s.warp_total[w];
    if (suffix >= need && suffix - v < need) {  // exactly one bin: need >= 1 and the bins hold >= need keys
      s.digit = BINS - 1 - tid;
      s.need = need - (suffix - v);
    }
  }
  __syncthreads();
}

// This CTA's scores from position `lo` of its `len` tokens (the max over the H rows) into
// registers LOADS at a time, then as keys into shared memory where below `hi` (known only once
// the request's length has come: the loads do not wait for it; past hi they are never used).
__device__ __forceinline__ void load_keys(const Args& a, const float* row, int lo, int len, const long long& n,
                                          long long base, unsigned* keys, int& hi) {
  bool settled = false;
  for (int i0 = lo + (int)threadIdx.x; i0 < len; i0 += LOADS * THREADS) {
    float v[LOADS];
#pragma unroll
    for (int k = 0; k < LOADS; ++k) {
      const int i = i0 + k * THREADS;
      v[k] = i < len ? row[i] : 0.0f;
    }
    for (int h = 1; h < a.H; ++h) {
#pragma unroll
      for (int k = 0; k < LOADS; ++k) {
        const int i = i0 + k * THREADS;
        if (i < len) v[k] = fmaxf(v[k], row[h * a.sh + i]);
      }
    }
    if (!settled) {
      hi = (int)max((long long)lo, min((long long)len, min(n - a.recent, (long long)a.L) - base));
      settled = true;
    }
#pragma unroll
    for (int k = 0; k < LOADS; ++k) {
      const int i = i0 + k * THREADS;
      if (i < hi) keys[pad(i)] = qsel::key_of(v[k]);
    }
  }
  if (!settled) hi = (int)max((long long)lo, min((long long)len, min(n - a.recent, (long long)a.L) - base));
}

template <int CL>
__global__ void __launch_bounds__(THREADS) pick_kernel(const Args a) {
  __shared__ Shared s;
  extern __shared__ unsigned smem[];
  unsigned* keys = smem;
  int* pages = reinterpret_cast<int*>(smem + a.key_words);
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank(), b = blockIdx.x / CL, tid = threadIdx.x;
  for (int i = tid; i < PASSES * BINS; i += THREADS) (&s.hist[0][0])[i] = 0;
  // This CTA's tokens [base, base + len), the middle ones [lo, hi) (chunk positions; hi once n is in)
  const long long base = (long long)rank * a.chunk;
  const int len = (int)max(0LL, min((long long)a.chunk, a.L - base));
  const int lo = (int)max(0LL, min((long long)len, a.sink - base));
  const int* pt = a.page_table ? a.page_table + b * a.spt : nullptr;
  const long long first_page = (base + lo) / max(a.page_size, 1);
  if (a.pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (a.trigger) asm volatile("griddepcontrol.launch_dependents;");
  const long long n = a.lens64 ? ((const long long*)a.kv_lens)[b] : (long long)((const int*)a.kv_lens)[b];
  if (a.staged && len > lo) {  // the page entries of this CTA's middle tokens, for their pool rows
    const int count = (int)((base + len - 1) / a.page_size - first_page) + 1;
    for (int j = tid; j < count; j += THREADS) pages[j] = pt[first_page + j];
  }
  int hi;
  load_keys(a, a.scores + b * a.sb + base, lo, len, n, base, keys, hi);
  const int total = a.sink + a.budget + a.recent;
  long long* out = a.out + (long long)b * total;
  int* rows = a.page_table ? a.rows + (long long)b * total : nullptr;
  if (n <= total) {  // every token the request has (the whole cluster returns here: no barrier waits)
    if (rank == 0) {
      for (int j = tid; j < total; j += THREADS) {
        out[j] = j;
        if (rows) rows[j] = j < n ? row_of(pt, j, a.page_size) : -1;
      }
      if (tid == 0) a.counts[b] = (int)n;
    }
    return;
  }
  if (rank == 0) {  // the count; sink and recent slots
    for (int j = tid; j < total; j += THREADS) {
      if (j >= a.sink && j < a.sink + a.budget) continue;
      const long long token = j < a.sink ? j : n - total + j;
      out[j] = token;
      if (rows) rows[j] = row_of(pt, token, a.page_size);
    }
    if (tid == 0) a.counts[b] = total;
  }
  if (a.budget == 0) return;  // sink and recent only (the whole cluster returns here)
  // thread tid's segment [first, first + seg), its middle ones [my_lo, my_hi)
  const int seg = (a.chunk + THREADS - 1) / THREADS, first = tid * seg;
  const int my_lo = max(lo, first), my_hi = min(hi, first + seg);
  __syncthreads();  // the keys and the zeroed histograms in
  unsigned prefix = 0;
  int need = a.budget;
#pragma unroll 1
  for (int p = 0; p < PASSES; ++p) {
    int* h = s.hist[p];
    const int shift = 24 - 8 * p;
    const unsigned high = p == 0 ? 0u : NONE << (32 - 8 * p);
    for (int j = 0; j < seg; ++j) {  // the same trip count in every lane (the match below is warp-wide)
      const int i = first + j;
      unsigned d = NONE;
      if (i >= my_lo && i < my_hi) {
        const unsigned u = keys[pad(i)];
        if ((u & high) == prefix) d = (u >> shift) & 255u;
      }
      if (!__any_sync(qsel::FULL, d != NONE)) continue;  // (warp-uniform) most keys stop matching after a pass or two
      const unsigned peers = __match_any_sync(qsel::FULL, d);
      if (d != NONE && (tid & 31) == __ffs(peers) - 1) atomicAdd(&h[d], __popc(peers));
    }
    cluster_arrive();  // this CTA's histogram is complete ...
    cluster_wait();    // ... and so is every other CTA's
    if (tid < BINS) {
      int c = 0;
#pragma unroll
      for (int r = 0; r < CL; ++r) c += cluster.map_shared_rank(h, r)[tid];
      s.sum[tid] = c;
    }
    __syncthreads();
    settle_digit(s, need);
    prefix |= s.digit << shift;
    need = s.need;
  }
  const unsigned t = prefix;
  const int ties = need;  // keys == t to take
  int2 mine = make_int2(0, 0);
  for (int i = my_lo; i < my_hi; ++i) {
    const unsigned u = keys[pad(i)];
    mine.x += u > t;
    mine.y += u == t;
  }
  int2 warp_total;
  const int2 in_warp = qsel::warp_scan2(mine.x, mine.y, warp_total);
  if ((tid & 31) == 0) s.scan[tid >> 5] = warp_total;
  __syncthreads();
  int2 pre = in_warp, cta = make_int2(0, 0);
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const int2 v = s.scan[w];
    if (w < (tid >> 5)) pre.x += v.x, pre.y += v.y;
    cta.x += v.x, cta.y += v.y;
  }
  if (tid == 0) s.cta_total = cta;
  cluster_arrive();
  cluster_wait();  // every CTA's totals are in
  if (tid < 32) {
    int2 v = make_int2(0, 0);
    if (tid < rank) v = *cluster.map_shared_rank(&s.cta_total, tid);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      v.x += __shfl_down_sync(qsel::FULL, v.x, o);
      v.y += __shfl_down_sync(qsel::FULL, v.y, o);
    }
    if (tid == 0) s.before = v;
  }
  __syncthreads();
  cluster_arrive();  // done with the cluster's shared memory (waited for below, before this CTA's may go)
  int gt = s.before.x + pre.x, eq = s.before.y + pre.y;  // keys > t and == t before this thread's first
  for (int i = my_lo; i < my_hi; ++i) {
    const unsigned u = keys[pad(i)];
    int slot = -1;
    if (u > t) {
      slot = a.sink + gt + min(eq, ties);
      ++gt;
    } else if (u == t) {
      if (eq < ties) slot = a.sink + gt + eq;
      ++eq;
    }
    if (slot >= 0 && slot < a.sink + a.budget) {  // always, for a settled t: a guard against writing past the row
      const long long token = base + i;
      out[slot] = token;
      if (rows) {
        rows[slot] = a.staged ? pages[token / a.page_size - first_page] * a.page_size + (int)(token % a.page_size)
                              : row_of(pt, token, a.page_size);
      }
    }
  }
  cluster_wait();
}

template <int CL>
int launch(Args a, int B, void* stream) {
  a.key_words = a.chunk + (a.chunk >> 5) + 1;
  const int page_words = a.page_table ? a.chunk / a.page_size + 2 : 0;  // the pages a chunk's tokens touch
  a.staged = page_words > 0 && (size_t)(a.key_words + page_words) * 4 <= SMEM_CAP;
  const size_t smem = (size_t)(a.key_words + (a.staged ? page_words : 0)) * sizeof(unsigned);
  const int dev = current_device();
  if (const int e = allow_dynamic_smem<pick_kernel<CL>>(smem, dev)) return e;
  if (CL > 8) {
    static bool allowed[MAX_DEVICES] = {};
    if (dev < 0 || dev >= MAX_DEVICES || !allowed[dev]) {
      const cudaError_t e = cudaFuncSetAttribute(pick_kernel<CL>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (e != cudaSuccess) return (int)e;
      if (dev >= 0 && dev < MAX_DEVICES) allowed[dev] = true;
    }
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(B * CL);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CL;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = a.pdl ? 2 : 1;
  return (int)cudaLaunchKernelEx(&cfg, pick_kernel<CL>, a);
}

}  // namespace

// -> 0 when launched, a cudaError_t, or -1 (an argument out of range: cluster not 8 or 16, a
// chunk of ceil(L / cluster) past se_omnikv_select_max_chunk(), a negative count). scores
// fp32, row (b, h) at b * sb + h * sh elements, its L tokens contiguous; out [B, total] int64,
// counts [B] int32 and rows [B, total] int32 contiguous; page_table int32, row b at b * spt
// (null: no rows).
extern "C" int se_omnikv_select(const void* scores, long long sb, long long sh, int H, int L, const void* kv_lens,
                                int lens64, void* out, void* counts, const void* page_table, long long spt,
                                int page_size, void* rows, int B, int sink, int budget, int recent, int cluster,
                                int pdl, int trigger, void* stream) {
  if (B < 0 || H < 1 || L < 1 || sink < 0 || budget < 0 || recent < 0 || (cluster != 8 && cluster != 16)) return -1;
  if (page_table && page_size < 1) return -1;
  const int chunk = (L + cluster - 1) / cluster;
  if (chunk > MAX_CHUNK) return -1;
  if (B == 0) return 0;
  const Args a = {(const float*)scores, sb, sh, kv_lens, (long long*)out, (int*)counts, (const int*)page_table,
                  spt, (int*)rows, lens64, H, L, chunk, page_size, sink, budget, recent, pdl, trigger, 0, 0};
  return cluster == 16 ? launch<16>(a, B, stream) : launch<8>(a, B, stream);
}

// The most tokens a CTA holds (a row takes up to this times the cluster size).
extern "C" int se_omnikv_select_max_chunk() { return MAX_CHUNK; }
