// A kernel launch, as a programmatic dependent launch (PDL) when `pdl` is set: the launched
// kernel may start before the one before it on the stream finishes, and must wait
// (griddepcontrol.wait) before it reads that kernel's writes. Shared by cuda_linear.cu and
// quest_select.cu (nvcc_build.py hashes this header with each source).
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
