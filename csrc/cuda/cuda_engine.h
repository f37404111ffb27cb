// CUDA side of the copy engine: IPC export / open of device memory keyed by GPU
// UUID, and execution of a segment list on a stream (cudaMemcpy2DAsync for
// copies, a small kernel for fp32 -> bf16 segments) with a completion event.
// Every call that touches a device leaves the calling thread's CUDA context as it
// found it (none stays none).
// Compiled only when nvcc is found; never needs a device to be imported.
#pragma once

#include <cstdint>
#include <string>

#include "../copy_segments.h"

namespace llamarl {

// Number of visible devices; 0 when there is no driver or no device.
int cuda_device_count();
// 32 hex digits of the device's UUID, the stable identity across processes
// (device indices change with CUDA_VISIBLE_DEVICES).
std::string cuda_device_uuid(int device);
// Local index of the device with this UUID, or -1 when it is not visible here.
int cuda_device_by_uuid(const std::string& uuid);

struct IpcExport {
  std::string handle;  // the 64 bytes of cudaIpcMemHandle_t
  int64_t offset;      // of `ptr` from the start of its allocation
  int64_t alloc_bytes; // size of that allocation
};
// Whether `ptr` (on `device`) lies in a cudaMalloc allocation, the only kind
// cudaIpcGetMemHandle exports (not VMM / expandable segments, not a cudaMallocAsync pool).
bool cuda_ipc_capable(int device, int64_t ptr);
// Whether kernels on `device` can address `peer`'s memory (true when they are equal).
bool cuda_can_access_peer(int device, int peer);
// Let `device` address `peer`'s memory (same process; IPC mappings do it themselves).
void cuda_enable_peer_access(int device, int peer);

// Export the allocation containing `ptr` (made on `device`); refuses memory that
// is not IPC capable, naming the allocator settings that produce it.
IpcExport cuda_ipc_export(int device, int64_t ptr);
// Map a peer's allocation into this process on `device`; returns its base address.
int64_t cuda_ipc_open(int device, const std::string& handle);
void cuda_ipc_close(int device, int64_t base);

// Enqueue the segments on `stream` (a cudaStream_t as an integer), then wait for
// them with a deadline of `timeout_s` seconds. Returns the bytes written. Never
// returns or throws while segments it queued are still running (unless the GPU is
// hung for a further 60 s, which the message says): a missed deadline throws
// TimeoutError once they have completed, a queuing error throws Error likewise.
int64_t execute_segments_cuda(const CopySegment* segs, int64_t count, int device, int64_t stream,
                              double timeout_s);

}  // namespace llamarl
