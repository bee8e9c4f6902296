// Quest's page selection in CUDA: one CTA of 256 threads a (request, KV head) row
// (quest_select_cuda.py builds it with nvcc, launches it and holds its contract, which is
// quest_select.py's: the same pages in the same slots, ties to the earlier page).
//
// Why CUDA: the Triton kernel's searches are chains of block-wide reductions, a barrier
// each (~14 us a launch at the 128K benchmark's shape, 30 launches a step). Here the
// bound runs in one warp with `__reduce_add_sync`, no barrier, and the pick ranks the candidates
// against each other, a thread each.
//
// The row's work: quest_select.cuh.
// `pdl`: launched as a programmatic dependent launch, the CTA waits (griddepcontrol.wait)
// for the kernel before it (the page scores) before it reads anything.
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch_pdl.cuh"
#include "quest_select.cuh"

namespace {

using namespace qsel;

// One row a CTA (VEC: the row staged in dynamic shared memory; quest_select.cuh).
template <int KPT, bool VEC>
__global__ void __launch_bounds__(THREADS) select_kernel(const Args a) {
  if (a.pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  __shared__ Shared s;
  extern __shared__ float4 staged[];
  select_row<KPT, VEC>(a, blockIdx.x, s, staged);
}

template <int KPT, bool VEC>
int launch(const Args& a, int rows, void* stream) {
  // VEC stages the row (P rounded up to 4 floats, KPT * THREADS covers it) in dynamic shared memory
  const size_t smem = VEC ? (size_t)KPT * THREADS * sizeof(float) : 0;
  if (const int e = allow_dynamic_smem<select_kernel<KPT, VEC>>(smem, current_device())) return e;
  return launch_maybe_pdl(select_kernel<KPT, VEC>, dim3(rows), dim3(THREADS), smem, stream, a.pdl, a);
}

template <int KPT>
int launch_kpt(const Args& a, int rows, bool vec, void* stream) {
  return vec ? launch<KPT, true>(a, rows, stream) : launch<KPT, false>(a, rows, stream);
}

}  // namespace

// -> 0 when launched, a cudaError_t, -1 (P outside 1..se_quest_select_max_pages(), or
// another argument out of range). `vec_ok`: each row's storage extends to P rounded up to 4
// floats (then aligned rows are read as float4). scores fp32, row (b, h) at b * sb + h * sh elements, its
// pages contiguous; pages [B, H, K] int64 and counts [B, H] int32 contiguous.
extern "C" int se_quest_select(const void* scores, long long sb, long long sh, const void* kv_lens, int lens64,
                               void* pages, void* counts, int B, int H, int P, int K, int page_size, int sink_pages,
                               int recent, int total, int top, int pdl, int vec_ok, void* stream) {
  if (B < 0 || H < 1 || P < 1 || K < 1 || page_size < 1 || sink_pages < 0 || recent < 0 || top < 1) return -1;
  if (B == 0) return 0;
  const Args a = {(const float*)scores, sb, sh, kv_lens, (long long*)pages, (int*)counts, lens64, H, P, K,
                  page_size, sink_pages, recent, total, top, pdl};
  const int rows = B * H;
  // float4 reads of whole rows: 16-byte aligned rows (the row's last float4 may pass P, not the allocation's end:
  // the wrapper passes vec only where the rows' storage holds P rounded up to 4 floats)
  const bool vec = vec_ok && ((uintptr_t)scores % 16 == 0) && sb % 4 == 0 && sh % 4 == 0;
  return with_kpt(P, [&](auto kpt) { return launch_kpt<decltype(kpt)::value>(a, rows, vec, stream); });
}

// The most pages a row may have (the widest build's THREADS x KPT).
extern "C" int se_quest_select_max_pages() { return THREADS * MAX_KPT; }
