// The copy kernel: every piece of a piece table (copy_segments.h CopyPiece) in one
// launch. Device code only: it takes the table's device address, its length and a
// stream, and knows nothing of syncs, plans or processes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../copy_segments.h"

namespace llamarl {

// Threads per block of the copy kernel.
constexpr int kCopyThreads = 256;

// Blocks per multiprocessor the kernel keeps resident on `device` (cached per device).
int copy_kernel_blocks_per_sm(int device);

// Enqueue the copy of `num_pieces` pieces (a device array) on `stream` in `num_blocks`
// blocks that grid-stride over them. No host synchronisation, no allocation: the
// launch can be captured in a CUDA graph. Returns the launch's error (cudaSuccess).
cudaError_t launch_copy_pieces(const CopyPiece* pieces, int64_t num_pieces, int num_blocks, cudaStream_t stream);

}  // namespace llamarl
