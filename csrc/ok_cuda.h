// overlapkernels CUDA library: a C ABI over raw device pointers and cudaStream_t.
//
// Loaded through ctypes by overlapkernels/kernels/cuda.py, so it needs no torch headers (torch's
// CPU wheel cannot compile a CUDA extension). Every function returns a cudaError_t as int
// (0 = success); ok_error_string turns it into text.
//
// `device` comes first in every call that touches the GPU: the CUDA runtime is linked statically,
// so this library's idea of the current device is its own, not torch's. Each call makes `device`
// current for its duration and restores the previous one (runtimes share the driver's current
// context, so leaving it changed could move torch's next launch to another GPU).
#pragma once
#include <stdint.h>

// The library is built with -fvisibility=hidden; only these functions are exported.
#define OK_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever a signature below changes; the loader refuses a library of another version.
#define OK_CUDA_ABI_VERSION 3
// The most source buffers ok_reduce_sum accepts (passed by value in the kernel's parameters).
#define OK_MAX_REDUCE_SRCS 64

enum ok_dtype { OK_FLOAT32 = 0, OK_FLOAT16 = 1, OK_BFLOAT16 = 2 };

// Error record written by a timed-out wait: int32[4] = {code, rank, chunk, op_id}; code 0 = none.
enum ok_error_code { OK_ERR_NONE = 0, OK_ERR_WAIT_TIMEOUT = 1 };

OK_API int ok_abi_version(void);
OK_API const char* ok_error_string(int err);

// *flag = value with release semantics at system scope (visible to peers and the host).
OK_API int ok_signal_set(int32_t device, uint32_t* flag, uint32_t value, void* stream);

// Spins (acquire, system scope) until *flag >= expected. After timeout_ns of the GPU's global
// timer it stops waiting and writes {OK_ERR_WAIT_TIMEOUT, rank, chunk, op_id} to error_record
// (first error wins), so the stream moves on and the host can raise instead of hanging.
OK_API int ok_signal_wait(int32_t device, const uint32_t* flag, uint32_t expected, uint64_t timeout_ns,
                          int32_t* error_record, int32_t op_id, int32_t rank, int32_t chunk, void* stream);

// dst[i] = sum_{s=0..num_srcs-1} srcs[s][i], accumulated in fp32 in that fixed source order
// (so the result never depends on timing), rounded once to dtype. srcs is a host array of
// device pointers; dst may alias srcs[0].
OK_API int ok_reduce_sum(int32_t device, void* dst, const void* const* srcs, int32_t num_srcs, int64_t numel,
                         int32_t dtype, void* stream);

// Peer memory through CUDA IPC, for torches without symmetric memory (or where it fails): a plain
// cudaMalloc on `device` whose handle (OK_IPC_HANDLE_BYTES opaque bytes) other processes open.
#define OK_IPC_HANDLE_BYTES 64
OK_API int ok_ipc_alloc(int32_t device, uint64_t bytes, void** ptr, unsigned char* handle);
// Maps a peer's buffer into this process, reachable from `device` (peer access enabled as needed).
OK_API int ok_ipc_open(int32_t device, const unsigned char* handle, void** ptr);
OK_API int ok_ipc_close(int32_t device, void* ptr);
OK_API int ok_free(int32_t device, void* ptr);

// A new non-blocking stream on `device` at the device's highest priority, never one of torch's
// pooled streams (which collectives may share); it lives as long as the process.
OK_API int ok_stream_create(int32_t device, void** stream);

#ifdef __cplusplus
}

#ifdef __CUDACC__
#include <cuda_runtime.h>
// Makes `device` current until the end of the scope; error() is nonzero if that failed.
// Restoring calls cudaSetDevice, which opens a context on the previous device if it had none;
// the Python wrappers (kernels/cuda.py) make `device` current first, so that never happens.
class OkDeviceGuard {
 public:
  explicit OkDeviceGuard(int device) {
    if ((err_ = cudaGetDevice(&previous_)) == cudaSuccess && previous_ != device) err_ = cudaSetDevice(device);
    else previous_ = -1;
  }
  ~OkDeviceGuard() {
    if (previous_ >= 0 && err_ == cudaSuccess) cudaSetDevice(previous_);
  }
  int error() const { return static_cast<int>(err_); }

 private:
  int previous_ = -1;
  cudaError_t err_ = cudaSuccess;
};
#define OK_ON_DEVICE(device)            \
  OkDeviceGuard ok_device_guard(device); \
  if (ok_device_guard.error()) return ok_device_guard.error()
#endif
#endif
