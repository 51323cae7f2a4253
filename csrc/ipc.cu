// Peer memory through CUDA IPC: the fallback of the process world when torch's symmetric memory
// is missing or fails. Buffers are plain cudaMalloc allocations (their own, so an IPC handle maps
// exactly the buffer, not a caching-allocator segment around it).
#include <cuda_runtime.h>
#include <string.h>
#include "ok_cuda.h"

static_assert(sizeof(cudaIpcMemHandle_t) == OK_IPC_HANDLE_BYTES, "cudaIpcMemHandle_t size changed");

extern "C" int ok_ipc_alloc(int32_t device, uint64_t bytes, void** ptr, unsigned char* handle) {
  OK_ON_DEVICE(device);
  if (cudaError_t e = cudaMalloc(ptr, bytes)) return static_cast<int>(e);
  cudaIpcMemHandle_t h;
  if (cudaError_t e = cudaIpcGetMemHandle(&h, *ptr)) {
    cudaFree(*ptr);
    *ptr = nullptr;
    return static_cast<int>(e);
  }
  memcpy(handle, &h, sizeof(h));
  return 0;
}

extern "C" int ok_ipc_open(int32_t device, const unsigned char* handle, void** ptr) {
  OK_ON_DEVICE(device);
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof(h));
  return static_cast<int>(cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess));
}

extern "C" int ok_ipc_close(int32_t device, void* ptr) {
  OK_ON_DEVICE(device);
  return static_cast<int>(cudaIpcCloseMemHandle(ptr));
}

extern "C" int ok_free(int32_t device, void* ptr) {
  OK_ON_DEVICE(device);
  return static_cast<int>(cudaFree(ptr));
}
