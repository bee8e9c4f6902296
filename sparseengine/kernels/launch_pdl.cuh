// Launching a kernel, as a programmatic dependent launch (PDL) when `pdl` is set: the kernel
// may then start while the one before it on the stream is still running, so it must execute
// griddepcontrol.wait before it reads anything that kernel writes. quest_scores.cu and the
// probe scripts/cuda_gemv.cu launch through it; cuda_linear.cu and quest_select.cu still
// spell the same lines out (the sources the H200 ran; nvcc_build.py hashes every header here
// with each source).
#pragma once
#include <cuda_runtime.h>

template <typename... Params, typename... Args>
inline int launch_maybe_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, void* stream, int pdl,
                            Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return (int)cudaLaunchKernelEx(&cfg, kernel, args...);
}
