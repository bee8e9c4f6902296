// Launching a kernel, as a programmatic dependent launch (PDL) when `pdl` is set: the kernel
// may then start while the one before it on the stream is still running, so it must execute
// griddepcontrol.wait before it reads anything that kernel writes; and the current device's
// SM count, asked once a device (persistent grids size by it). Shared by cuda_linear.cu,
// quest_select.cu, quest_scores.cu and the probe scripts/cuda_gemv.cu (nvcc_build.py hashes
// every header here with each source).
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

constexpr int SM_COUNT_DEVICES = 64;  // devices whose SM count is kept; one past them is asked at every call

inline int current_device() {
  int dev = 0;
  cudaGetDevice(&dev);
  return dev;
}

inline int sm_count(int dev) {
  static int sms[SM_COUNT_DEVICES] = {};
  if (dev >= 0 && dev < SM_COUNT_DEVICES && sms[dev]) return sms[dev];
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (dev >= 0 && dev < SM_COUNT_DEVICES) sms[dev] = n;
  return n;
}
