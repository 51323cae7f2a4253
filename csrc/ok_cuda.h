// overlapkernels CUDA library: a C ABI over raw device pointers and cudaStream_t.
//
// Loaded through ctypes by overlapkernels/kernels/cuda.py, so it needs no torch headers (torch's
// CPU wheel cannot compile a CUDA extension). Every function returns a cudaError_t as int
// (0 = success); ok_error_string turns it into text.
#pragma once
#include <stdint.h>

// The library is built with -fvisibility=hidden; only these functions are exported.
#define OK_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever a signature below changes; the loader refuses a library of another version.
#define OK_CUDA_ABI_VERSION 1
// The most source buffers ok_reduce_sum accepts (passed by value in the kernel's parameters).
#define OK_MAX_REDUCE_SRCS 64

enum ok_dtype { OK_FLOAT32 = 0, OK_FLOAT16 = 1, OK_BFLOAT16 = 2 };

// Error record written by a timed-out wait: int32[4] = {code, rank, chunk, op_id}; code 0 = none.
enum ok_error_code { OK_ERR_NONE = 0, OK_ERR_WAIT_TIMEOUT = 1 };

OK_API int ok_abi_version(void);
OK_API const char* ok_error_string(int err);

// *flag = value with release semantics at system scope (visible to peers and the host).
OK_API int ok_signal_set(uint32_t* flag, uint32_t value, void* stream);

// Spins (acquire, system scope) until *flag >= expected. After timeout_ns of the GPU's global
// timer it stops waiting and writes {OK_ERR_WAIT_TIMEOUT, rank, chunk, op_id} to error_record
// (first error wins), so the stream moves on and the host can raise instead of hanging.
OK_API int ok_signal_wait(const uint32_t* flag, uint32_t expected, uint64_t timeout_ns, int32_t* error_record,
                   int32_t op_id, int32_t rank, int32_t chunk, void* stream);

// dst[i] = sum_{s=0..num_srcs-1} srcs[s][i], accumulated in fp32 in that fixed source order
// (so the result never depends on timing), rounded once to dtype. srcs is a host array of
// device pointers; dst may alias srcs[0].
OK_API int ok_reduce_sum(void* dst, const void* const* srcs, int32_t num_srcs, int64_t numel, int32_t dtype,
                  void* stream);

#ifdef __cplusplus
}
#endif
