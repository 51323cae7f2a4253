// Flags between ranks: a release store and a timed acquire spin, each one single-thread kernel,
// so they order against the GEMM and copy kernels of the same stream.
#include <cuda_runtime.h>
#include "ok_cuda.h"

namespace {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__global__ void signal_set_kernel(uint32_t* flag, uint32_t value) { store_release_sys(flag, value); }

__global__ void signal_wait_kernel(const uint32_t* flag, uint32_t expected, uint64_t timeout_ns,
                                   int32_t* error_record, int32_t op_id, int32_t rank, int32_t chunk) {
  const uint64_t start = global_timer_ns();
  while (load_acquire_sys(flag) < expected) {
    if (global_timer_ns() - start > timeout_ns) {
      if (atomicCAS(error_record, OK_ERR_NONE, OK_ERR_WAIT_TIMEOUT) == OK_ERR_NONE) {
        error_record[1] = rank;
        error_record[2] = chunk;
        error_record[3] = op_id;
        __threadfence_system();
      }
      return;
    }
    __nanosleep(64);  // eases pressure on the memory system while we wait
  }
}

}  // namespace

extern "C" int ok_abi_version(void) { return OK_CUDA_ABI_VERSION; }

extern "C" const char* ok_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

extern "C" int ok_signal_set(int32_t device, uint32_t* flag, uint32_t value, void* stream) {
  OK_ON_DEVICE(device);
  signal_set_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(flag, value);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int ok_signal_wait(int32_t device, const uint32_t* flag, uint32_t expected, uint64_t timeout_ns,
                              int32_t* error_record, int32_t op_id, int32_t rank, int32_t chunk, void* stream) {
  OK_ON_DEVICE(device);
  signal_wait_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(flag, expected, timeout_ns, error_record,
                                                                     op_id, rank, chunk);
  return static_cast<int>(cudaGetLastError());
}
