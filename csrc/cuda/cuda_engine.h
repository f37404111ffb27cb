// CUDA side of the copy engine: IPC export / open of device memory keyed by GPU
// UUID, and execution of a segment list on a stream: its pieces (copy_segments.h)
// copied by one launch of the copy kernel (copy_kernel.cuh), then waited for
// through an event with a deadline.
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

// Multiprocessors of `device` (cached).
int cuda_num_sms(int device);

// Enqueue the copy kernel over a piece table already on `device` (`pieces`: the
// device address of `num_pieces` CopyPiece) on `stream` (a cudaStream_t as an
// integer). No host synchronisation and no allocation: capturable in a CUDA graph.
// The table and every address in it must stay valid until the kernel has run.
void launch_pieces_cuda(int device, int64_t stream, int64_t pieces, int64_t num_pieces);

// Wait for the work queued on `stream` so far, with a deadline of `timeout_s`
// seconds; `total_bytes` only names the copy in messages. Never returns or throws
// while that work is still running (unless the GPU is hung for a further 60 s,
// which the message says): a missed deadline throws TimeoutError once it has
// completed.
void wait_stream_cuda(int device, int64_t stream, double timeout_s, int64_t total_bytes);

// One-off: split the segments into pieces, upload the table through stream-ordered
// memory, launch and wait as the two calls above do. Returns the bytes written.
// Validates every segment before anything is queued.
int64_t execute_segments_cuda(const CopySegment* segs, int64_t count, int device, int64_t stream,
                              double timeout_s);

}  // namespace llamarl
