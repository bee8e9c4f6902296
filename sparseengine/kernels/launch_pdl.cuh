// Launching a kernel, as a programmatic dependent launch (PDL) when `pdl` is set: the kernel
// may then start while the one before it on the stream is still running, so it must execute
// griddepcontrol.wait before it reads anything that kernel writes; the current device's
// SM count, asked once a device (persistent grids size by it); and a kernel's dynamic shared
// memory allowed, asked once a device and size. Shared by cuda_linear.cu,
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

constexpr int MAX_DEVICES = 64;  // devices whose values below are kept; one past them is asked at every call

inline int current_device() {
  int dev = 0;
  cudaGetDevice(&dev);
  return dev;
}

inline int sm_count(int dev) {
  static int sms[MAX_DEVICES] = {};
  if (dev >= 0 && dev < MAX_DEVICES && sms[dev]) return sms[dev];
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (dev >= 0 && dev < MAX_DEVICES) sms[dev] = n;
  return n;
}

// Allows `Kernel` `smem` bytes of dynamic shared memory on device `dev` (the attribute a launch
// needs once its static and dynamic shared memory pass 48 KB; harmless below), asked only when
// `smem` passes what was allowed there before. -> 0 or a cudaError_t.
template <auto Kernel>
int allow_dynamic_smem(size_t smem, int dev) {
  static size_t allowed[MAX_DEVICES] = {};
  const bool cached = dev >= 0 && dev < MAX_DEVICES;
  if (cached && smem <= allowed[dev]) return 0;
  const cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e == cudaSuccess && cached) allowed[dev] = smem;
  return (int)e;
}
