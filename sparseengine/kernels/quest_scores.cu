// Quest's page scores in CUDA (quest_scores_cuda.py builds it with nvcc, launches it and
// holds its contract, which is quest.py's `quest_page_scores_triton`: the page bound
// U = max over the group's query heads of sum_c max(q_c M_c, q_c m_c) for every page of a
// request, float32, with the decode step's new key folded into its page's bounds first).
//
// Why CUDA: the Triton kernel reads the bounds at ~3.9 TB/s (51 us a layer at the 128K
// benchmark's shape) where the dense attention reads the KV at ~4.4; its programs each take
// one (request, KV head), so a page's 2 KB of bounds (8 heads) is read 256 B at a time by 8
// programs far apart; and it cannot start before the qkv linear before it has finished.
//
// The device code (layout, fold, PDL): quest_scores.cuh.
#include <cuda_runtime.h>

#include "launch_pdl.cuh"
#include "quest_scores.cuh"

namespace {

using namespace qscore;

__global__ void __launch_bounds__(THREADS, 2) scores_kernel(const Args a) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // nothing for a kernel launched without PDL
  __shared__ uint4 q_smem[WARPS][STEPS][32];
  const int first = blockIdx.x * a.per_cta;
  score_items(a, first, min(first + a.per_cta, a.items), q_smem);
}

}  // namespace

// -> 0 when launched, a cudaError_t, or -1 (an argument out of range: hkv must divide 8,
// group 1..8, D 128). q bf16 rows of D at b * qb + head * qh (16-byte aligned); kmax, kmin
// [num_pages, hkv, D] bf16 contiguous; table int32 rows at b * tb; scores [B, hkv, P4] fp32, P4 = P rounded
// up to 4 (rows a float4 read may take whole: quest_select.cu's VEC; the floats past P unwritten);
// k_cache and slots null for no fold (else k_cache's (page, off, head) row at page * kp +
// off * ko + head * kh, 16-byte aligned). `ctas_per_sm`: the grid, CTAs an SM (2 fit at once; more
// queue behind them, each taking a shorter run of items).
extern "C" int se_quest_scores(const void* q, long long qb, long long qh, void* kmax, void* kmin, const void* table,
                               long long tb, const void* kv_lens, int lens64, void* scores, const void* k_cache,
                               long long kp, long long ko, long long kh, const void* slots, int slots64, int B,
                               int hkv, int group, int P, int page_size, int ctas_per_sm, int pdl, void* stream) {
  Args a;
  if (ctas_per_sm < 1 || !make_args(a, q, qb, qh, kmax, kmin, table, tb, kv_lens, lens64, scores, k_cache, kp, ko, kh,
                                    slots, slots64, B, hkv, group, P, page_size, pdl))
    return -1;
  if (B == 0) return 0;
  const int want = sm_count(current_device()) * ctas_per_sm;
  a.per_cta = (a.items + want - 1) / want;
  const int grid = (a.items + a.per_cta - 1) / a.per_cta;
  return launch_maybe_pdl(scores_kernel, dim3(grid), dim3(THREADS), 0, stream, pdl, a);
}

// The head dim the kernel takes (the wrapper checks it).
extern "C" int se_quest_scores_head_dim() { return D; }
