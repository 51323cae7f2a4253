// A CUDA stream of its own, for the side stream that spin-waits on peers' flags.
//
// torch.cuda.Stream() hands out the streams of a 32-entry pool per priority round-robin, and
// ProcessGroupNCCL draws its streams from the same pools (the high-priority one under
// TORCH_NCCL_HIGH_PRIORITY=1 or for Megatron's high-priority groups). A collective sharing our
// stream would queue behind a spin-wait that may itself wait, through a peer, on that collective.
#include <cuda_runtime.h>
#include "ok_cuda.h"

extern "C" int ok_stream_create(int32_t device, void** stream) {
  OK_ON_DEVICE(device);
  int least = 0, greatest = 0;
  if (cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest)) return static_cast<int>(e);
  cudaStream_t s = nullptr;
  // non-blocking, like torch's own streams: no implicit sync with the legacy default stream
  if (cudaError_t e = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest)) return static_cast<int>(e);
  *stream = s;
  return 0;
}
