// One warp-wide mma.sync m16n8k16 on the tensor cores: c (float32, 16 x 8) += A (bf16,
// 16 x 16, row-major fragments a0..a3) x B (bf16, 16 x 8, column fragments b0, b1), with
// PTX's fragment layouts (lane l: g = l / 4, t = l % 4; a0 = A[g][2t, 2t+1], a1 = A[g+8][..],
// a2 = A[g][2t+8, 2t+9], a3 = A[g+8][..]; b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g];
// c = C[g][2t, 2t+1], C[g+8][2t, 2t+1]). Shared by cuda_linear.cu, quest_scores.cu and the
// probe scripts/cuda_gemv.cu.
#pragma once
#include <stdint.h>

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
