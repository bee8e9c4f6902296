// Quest's page scores and page choice in one launch (quest_pick_cuda.py builds it with nvcc,
// launches it and holds its contract: the pages and counts of quest_select.cu's kernel over
// the scores of quest_scores.cu's, bit for bit, and those scores).
//
// Why: at the 128K benchmark's shape the choice is a launch of its own after the scores'
// (48 CTAs, ~8.6 us a layer in the decode graph, 30 layers a step), though its work is a few
// microseconds once the scores are in L2. Here each CTA scores its run of items as
// quest_scores.cu's kernel does (quest_scores.cuh), then announces the requests it scored;
// CTAs 0 .. selectors - 1 then each take (request, KV head) rows as quest_select.cu's kernel
// does (quest_select.cuh), a row once every CTA that scores its request has announced it.
//
// The hand-off (a semaphore as CUTLASS's): the CTA meets at a barrier after its score stores,
// and thread 0 adds one to arrive[b] for each request b of its items with a release
// reduction (red.release.gpu: cumulative over the stores the barrier ordered before it). A
// row's CTA waits (thread 0, ld.acquire.gpu, __nanosleep between polls) until arrive[b]
// counts every CTA whose items hold request b's, meets its threads at a barrier, and reads
// the scores through L2 only (ld.global.cg: no stale L1 line). The last of request b's H rows to see its
// count complete resets arrive[b] and its own counter seen[b] to 0 for the next launch, so
// `counters` ([2, B] int32, zero before the first launch) stays zero between launches.
// No CTA waits on a CTA that waits: a CTA scores (never waiting, but for the PDL wait on the
// kernel before) before it takes any row, and the grid is no larger than the CTAs the GPU
// holds at once (host, by the occupancy API), so every scoring CTA runs while rows wait.
// Where the rows fit that, a CTA takes one (CTAs past the scoring ones only choose); else
// the scoring CTAs take several each (LOOP, whose registers spill at the wider rows).
// Every CTA passes the PDL wait before it touches the counters or writes anything. A row
// that waits over 2 s traps (the launch fails with an error instead of hanging the GPU).
#include <cuda_runtime.h>

#include "launch_pdl.cuh"
#include "quest_scores.cuh"
#include "quest_select.cuh"

namespace {

static_assert(qscore::THREADS == qsel::THREADS, "one CTA shape for both phases");

struct PickArgs {
  qscore::Args s;  // the scores (rows of sp = P4, P rounded up to 4 floats)
  qsel::Args c;    // the choice over them (rows of P4 floats)
  int* counters;   // [2, B]: arrive, seen
  int B, selectors;
};

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

constexpr unsigned long long WAIT_LIMIT_NS = 2000000000ull;  // a row's wait for its scores, at most (then a trap)

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The CTAs whose runs of items hold request b's items.
__device__ __forceinline__ int ctas_of(const qscore::Args& a, int b) {
  const int lo = b * a.items_per_b / a.per_cta, hi = ((b + 1) * a.items_per_b - 1) / a.per_cta;
  return hi - lo + 1;
}

// LOOP: a CTA may take several rows (more rows than CTAs fit the GPU at once); else each of the first B x H CTAs
// takes one (no loop: at the 128K shape the loop's registers spill).
template <int KPT, bool LOOP>
__global__ void __launch_bounds__(qscore::THREADS, 2) pick_kernel(const PickArgs p) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // nothing for a kernel launched without PDL
  __shared__ uint4 q_smem[qscore::WARPS][qscore::STEPS][32];
  __shared__ qsel::Shared s;
  extern __shared__ float4 staged[];
  const qscore::Args& a = p.s;
  const int first = blockIdx.x * a.per_cta, last = min(first + a.per_cta, a.items);
  if (first < a.items) {  // else a CTA that only chooses
    qscore::score_items(a, first, last, q_smem);
    __syncthreads();  // the CTA's score stores before thread 0's release (cumulative over what the barrier ordered)
    if (threadIdx.x == 0) {
      for (int b = first / a.items_per_b; b <= (last - 1) / a.items_per_b; ++b) add_release(p.counters + b, 1);
    }
  } else if (a.pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");  // as the scoring CTAs: nothing before it but the launch
  }
  const int H = p.c.H, rows = p.B * H;
  for (int row = blockIdx.x; row < rows; row += p.selectors) {
    const int b = row / H;
    if (threadIdx.x == 0) {
      const int want = ctas_of(a, b);
      const unsigned long long start = global_ns();
      while (load_acquire(p.counters + b) < want) {
        __nanosleep(64);
        if (global_ns() - start > WAIT_LIMIT_NS) __trap();  // a broken hand-off fails the launch instead of hanging
      }
      if (atomicAdd(p.counters + p.B + b, 1) == H - 1) p.counters[b] = 0, p.counters[p.B + b] = 0;  // the last row
    }
    __syncthreads();  // the row's scores in; the row before's readers of s and staged are past it
    qsel::select_row<KPT, true, true>(p.c, row, s, staged);
    if (!LOOP) break;
    __syncthreads();
  }
}

template <int KPT, bool LOOP>
int launch_grid(const PickArgs& p, size_t smem, int grid, int pdl, void* stream) {
  if (const int e = allow_dynamic_smem<pick_kernel<KPT, LOOP>>(smem, current_device())) return e;
  return launch_maybe_pdl(pick_kernel<KPT, LOOP>, dim3(grid), dim3(qsel::THREADS), smem, stream, pdl, p);
}

template <int KPT>
int launch(PickArgs p, int ctas_per_sm, int pdl, void* stream) {
  const size_t smem = (size_t)KPT * qsel::THREADS * sizeof(float);  // the staged row
  const int dev = current_device();
  // CTAs an SM at once (both builds alike), asked once a device: the grid stays within them (rows wait on other
  // CTAs' scores)
  static int fits[MAX_DEVICES] = {};
  int fit = dev >= 0 && dev < MAX_DEVICES ? fits[dev] : 0;
  if (!fit) {
    if (const int e = allow_dynamic_smem<pick_kernel<KPT, false>>(smem, dev)) return e;
    if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, pick_kernel<KPT, false>,
                                                                           qsel::THREADS, smem)) return (int)e;
    if (fit < 1) return -1;
    if (dev >= 0 && dev < MAX_DEVICES) fits[dev] = fit;
  }
  qscore::Args& a = p.s;
  const int most = sm_count(dev) * fit, want = sm_count(dev) * min(ctas_per_sm, fit), rows = p.B * p.c.H;
  a.per_cta = (a.items + want - 1) / want;
  const int grid = (a.items + a.per_cta - 1) / a.per_cta;  // <= most
  if (rows <= most) {  // a row a CTA: CTAs past the scoring ones only choose
    p.selectors = max(grid, rows);
    return launch_grid<KPT, false>(p, smem, p.selectors, pdl, stream);
  }
  p.selectors = grid;
  return launch_grid<KPT, true>(p, smem, grid, pdl, stream);
}

}  // namespace

// -> 0 when launched, a cudaError_t, or -1 (an argument out of range). The scores' arguments
// as se_quest_scores's, but `scores` [B, hkv, P4] fp32 with P4 = P rounded up to 4 (16-byte
// aligned: the choice reads its rows as float4); the choice's as se_quest_select's (rows of
// `scores`, H = hkv); `counters` [2, B] int32, zero (and left zero). `ctas_per_sm` 1 or 2,
// at most what fits an SM.
extern "C" int se_quest_pick(const void* q, long long qb, long long qh, void* kmax, void* kmin, const void* table,
                             long long tb, const void* kv_lens, int lens64, void* scores, const void* k_cache,
                             long long kp, long long ko, long long kh, const void* slots, int slots64, int B, int hkv,
                             int group, int P, int page_size, void* pages, void* counts, int K, int sink_pages,
                             int recent, int total, int top, void* counters, int ctas_per_sm, int pdl, void* stream) {
  PickArgs p = {};
  if (!qscore::make_args(p.s, q, qb, qh, kmax, kmin, table, tb, kv_lens, lens64, scores, k_cache, kp, ko, kh, slots,
                         slots64, B, hkv, group, P, page_size, pdl) ||
      ctas_per_sm < 1 || ctas_per_sm > 2 || K < 1 || sink_pages < 0 || recent < 0 || top < 1 ||
      (uintptr_t)scores % 16)
    return -1;
  if (B == 0) return 0;
  const int P4 = p.s.sp;
  p.c = {(const float*)scores, (long long)hkv * P4, P4, kv_lens, (long long*)pages, (int*)counts, lens64, hkv, P,
         K, page_size, sink_pages, recent, total, top, 0};
  p.counters = (int*)counters;
  p.B = B;
  return qsel::with_kpt(P, [&](auto kpt) { return launch<decltype(kpt)::value>(p, ctas_per_sm, pdl, stream); });
}

// The most pages a row may have (the widest build's THREADS x KPT, as se_quest_select's).
extern "C" int se_quest_pick_max_pages() { return qsel::THREADS * qsel::MAX_KPT; }
