// Sum of P equally shaped source buffers into one destination: the reduction step of
// GEMM + reduce-scatter, where each source is one peer's partial for our chunk.
//
// fp32 accumulation in a fixed source order, so results are bitwise reproducible whatever order
// the partials arrived in. 16-byte vector loads on the aligned body, a scalar tail.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include "ok_cuda.h"

namespace {

struct SrcTable {
  const void* ptr[OK_MAX_REDUCE_SRCS];
};

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void reduce_sum_kernel(T* dst, SrcTable srcs, int num_srcs, int64_t numel, bool vectorised) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_vec = vectorised ? numel / kVec : 0;
  for (int64_t v = tid; v < num_vec; v += stride) {
    float acc[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] = 0.f;
    for (int s = 0; s < num_srcs; ++s) {
      uint4 raw = reinterpret_cast<const uint4*>(srcs.ptr[s])[v];
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] += to_f32(vals[j]);
    }
    uint4 out;
    T* outs = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int j = 0; j < kVec; ++j) outs[j] = from_f32<T>(acc[j]);
    reinterpret_cast<uint4*>(dst)[v] = out;
  }
  for (int64_t i = num_vec * kVec + tid; i < numel; i += stride) {
    float acc = 0.f;
    for (int s = 0; s < num_srcs; ++s) acc += to_f32(static_cast<const T*>(srcs.ptr[s])[i]);
    dst[i] = from_f32<T>(acc);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
int launch(void* dst, const void* const* src_ptrs, int num_srcs, int64_t numel, cudaStream_t stream) {
  SrcTable srcs;
  bool vectorised = aligned16(dst);
  for (int s = 0; s < num_srcs; ++s) {
    srcs.ptr[s] = src_ptrs[s];
    vectorised = vectorised && aligned16(src_ptrs[s]);
  }
  constexpr int kThreads = 256;
  const int64_t work = vectorised ? (numel + 16 / sizeof(T) - 1) / (16 / sizeof(T)) : numel;
  const int blocks = static_cast<int>(work / kThreads + 1 < 65535 ? work / kThreads + 1 : 65535);
  reduce_sum_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(dst), srcs, num_srcs, numel, vectorised);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int ok_reduce_sum(int32_t device, void* dst, const void* const* srcs, int32_t num_srcs, int64_t numel,
                             int32_t dtype, void* stream) {
  if (num_srcs < 1 || num_srcs > OK_MAX_REDUCE_SRCS || numel < 0) return static_cast<int>(cudaErrorInvalidValue);
  if (numel == 0) return 0;
  OK_ON_DEVICE(device);
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case OK_FLOAT32: return launch<float>(dst, srcs, num_srcs, numel, s);
    case OK_FLOAT16: return launch<__half>(dst, srcs, num_srcs, numel, s);
    case OK_BFLOAT16: return launch<__nv_bfloat16>(dst, srcs, num_srcs, numel, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}
