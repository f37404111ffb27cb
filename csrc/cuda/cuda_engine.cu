#include "cuda_engine.h"

#include "copy_kernel.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <chrono>
#include <sstream>
#include <string>
#include <thread>

namespace llamarl {
namespace {

#define LLAMARL_CUDA_CHECK(expr)                                                           \
  do {                                                                                     \
    cudaError_t llamarl_err_ = (expr);                                                     \
    LLAMARL_CHECK(llamarl_err_ == cudaSuccess,                                             \
                  #expr << " failed: " << cudaGetErrorName(llamarl_err_) << ": "           \
                        << cudaGetErrorString(llamarl_err_));                              \
  } while (0)

#define LLAMARL_CU_CHECK(expr)                                                      \
  do {                                                                              \
    const CUresult llamarl_res_ = (expr);                                           \
    LLAMARL_CHECK(llamarl_res_ == CUDA_SUCCESS, #expr << " failed with CUresult " << llamarl_res_); \
  } while (0)

// A driver function fetched through the runtime, so that the module never links
// libcuda (absent on machines without a driver). Callers keep the result in a
// function-local static: one lookup per process.
template <typename Fn>
Fn driver_fn(const char* name, int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status;
  LLAMARL_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &status));
  LLAMARL_CHECK(fn != nullptr && status == cudaDriverEntryPointSuccess, "the CUDA driver lacks " << name);
  return reinterpret_cast<Fn>(fn);
}

// Makes `device` current for one engine call, then gives the calling thread back
// its own driver context, whatever it was, none included. The driver context is the
// one piece of state this module's static cudart shares with torch's. Restoring a
// runtime device instead (cudaSetDevice(previous)) made a thread that had never used
// CUDA create GPU 0's primary context on the way out: about 500 MiB of GPU 0 per
// process on an 8-GPU node.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    // Both looked up here: the destructor must not throw.
    static const auto get_current = driver_fn<PFN_cuCtxGetCurrent_v4000>("cuCtxGetCurrent", 4000);
    static const auto set_current = driver_fn<PFN_cuCtxSetCurrent_v4000>("cuCtxSetCurrent", 4000);
    set_current_ = set_current;
    LLAMARL_CU_CHECK(get_current(&previous_));
    LLAMARL_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { set_current_(previous_); }  // NULL unbinds: a thread that had no context is left with none
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  PFN_cuCtxSetCurrent_v4000 set_current_ = nullptr;
  CUcontext previous_ = nullptr;
};

void require_device(int device) {
  const int count = cuda_device_count();
  LLAMARL_CHECK(count > 0, "no CUDA device: the driver is missing or no GPU is visible");
  LLAMARL_CHECK(device >= 0 && device < count, "CUDA device " << device << " out of range [0, " << count << ")");
}

using Clock = std::chrono::steady_clock;

// How long a failed or late call still waits for the copies it queued before it
// reports: a copy left running could land old bytes after a newer version is
// reported, or read a source the optimizer is already overwriting. 140 GB (a 70B
// model in bf16) takes 0.05 s at HBM speed (3 TB/s) and 6 s over PCIe without peer
// access (25 GB/s); 60 s is ten times the slowest.
constexpr double kDrainTimeoutS = 60.0;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// A completion marker for the work queued on a stream, polled with a deadline.
class Event {
 public:
  Event() { LLAMARL_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Marks what is queued on `stream` now (on the first call only) and polls it until
  // `deadline`: cudaSuccess when it has completed, cudaErrorNotReady when it is still
  // running at the deadline, or the error the stream reported. If the marker cannot
  // be recorded (a broken context) the whole stream is polled instead.
  cudaError_t wait(cudaStream_t stream, Clock::time_point deadline) {
    if (!recorded_) {
      recorded_ = true;
      record_error_ = cudaEventRecord(event_, stream);
      if (record_error_ != cudaSuccess) cudaGetLastError();
    }
    // Polled without sleeping for the first 2 ms (a yield between polls): a 1 GiB
    // copy takes about 0.4 ms at HBM speed, and a 50 us sleep granularity cost up to
    // 14% of it. Longer waits sleep 50 us between polls, so a slow copy does not
    // hold a core.
    const auto spin_until = Clock::now() + std::chrono::milliseconds(2);
    cudaError_t state;
    while ((state = record_error_ == cudaSuccess ? cudaEventQuery(event_) : cudaStreamQuery(stream)) ==
           cudaErrorNotReady) {
      const auto now = Clock::now();
      if (now > deadline) return cudaErrorNotReady;
      if (now < spin_until)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return state;
  }

 private:
  cudaEvent_t event_ = nullptr;
  bool recorded_ = false;
  cudaError_t record_error_ = cudaSuccess;
};

// The tail of an error message: what became of the copies queued before it.
std::string drained_note(cudaError_t drained) {
  std::ostringstream out;
  if (drained == cudaSuccess)
    out << "the copies queued before have completed; nothing is left running";
  else if (drained == cudaErrorNotReady)
    out << "the copies queued are still running after a further " << kDrainTimeoutS
        << " s (the GPU seems hung): they may still write the destination and read the source, so neither "
           "may be reused; restart the process";
  else
    out << "the stream reported " << cudaGetErrorName(drained) << " (a broken CUDA context: nothing runs on it)";
  return out.str();
}

}  // namespace

int cuda_device_count() {
  int count = 0;  // left unwritten when the call fails (error 35 without a driver)
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::string cuda_device_uuid(int device) {
  require_device(device);
  cudaDeviceProp prop;
  LLAMARL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < 16; ++i) {
    const auto b = static_cast<unsigned char>(prop.uuid.bytes[i]);
    out.push_back(hex[b >> 4]);
    out.push_back(hex[b & 15]);
  }
  return out;
}

int cuda_device_by_uuid(const std::string& uuid) {
  const int count = cuda_device_count();
  for (int device = 0; device < count; ++device)
    if (cuda_device_uuid(device) == uuid) return device;
  return -1;
}

bool cuda_ipc_capable(int device, int64_t ptr) {
  require_device(device);
  DeviceGuard guard(device);
  static const auto get_attribute = driver_fn<PFN_cuPointerGetAttribute_v4000>("cuPointerGetAttribute", 4000);
  int capable = 0;  // the driver writes a boolean
  LLAMARL_CU_CHECK(get_attribute(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                 static_cast<CUdeviceptr>(ptr)));
  return capable != 0;
}

bool cuda_can_access_peer(int device, int peer) {
  require_device(device);
  require_device(peer);
  if (device == peer) return true;
  DeviceGuard guard(device);  // a query, but through the runtime: leave the caller's context as it was
  int can = 0;
  LLAMARL_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer));
  return can != 0;
}

void cuda_enable_peer_access(int device, int peer) {
  LLAMARL_CHECK(cuda_can_access_peer(device, peer), "CUDA device " << device << " cannot access device " << peer
                                                                  << " peer to peer (cudaDeviceCanAccessPeer is 0)");
  if (device == peer) return;
  DeviceGuard guard(device);
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // enabled before (by torch or an earlier call): not an error
    return;
  }
  LLAMARL_CUDA_CHECK(err);
}

IpcExport cuda_ipc_export(int device, int64_t ptr) {
  LLAMARL_CHECK(cuda_ipc_capable(device, ptr),
                "address " << ptr << " on CUDA device " << device
                           << " is not from cudaMalloc (a VMM or memory-pool allocation: "
                              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or backend:cudaMallocAsync); "
                              "cudaIpcGetMemHandle cannot export it");
  DeviceGuard guard(device);
  static const auto get_range = driver_fn<PFN_cuMemGetAddressRange_v3020>("cuMemGetAddressRange", 12000);
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult res = get_range(&base, &size, static_cast<CUdeviceptr>(ptr));
  LLAMARL_CHECK(res == CUDA_SUCCESS, "cuMemGetAddressRange(" << ptr << ") failed with CUresult " << res);
  cudaIpcMemHandle_t handle;
  LLAMARL_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)));
  IpcExport out;
  out.handle.assign(handle.reserved, sizeof(handle.reserved));
  out.offset = ptr - static_cast<int64_t>(base);
  out.alloc_bytes = static_cast<int64_t>(size);
  return out;
}

int64_t cuda_ipc_open(int device, const std::string& handle) {
  require_device(device);
  cudaIpcMemHandle_t h;
  LLAMARL_CHECK(handle.size() == sizeof(h.reserved),
                "CUDA IPC handle must be " << sizeof(h.reserved) << " bytes, got " << handle.size());
  std::memcpy(h.reserved, handle.data(), sizeof(h.reserved));
  DeviceGuard guard(device);
  void* base = nullptr;
  LLAMARL_CUDA_CHECK(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<int64_t>(base);
}

void cuda_ipc_close(int device, int64_t base) {
  require_device(device);
  DeviceGuard guard(device);
  LLAMARL_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(base)));
}

int cuda_num_sms(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int sms = 0;
  LLAMARL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cached[device] = sms;
  return sms;
}

namespace {

// Enqueue the pieces at `pieces` (device memory) on `stream`; the caller has made
// `device` current. Returns the launch's error.
cudaError_t enqueue_pieces(const CopyPiece* pieces, int64_t num_pieces, int device, cudaStream_t stream) {
  // A persistent grid: every block resident at once, grid-striding over the pieces.
  const int64_t resident = static_cast<int64_t>(cuda_num_sms(device)) * copy_kernel_blocks_per_sm(device);
  const int blocks = static_cast<int>(num_pieces < resident ? num_pieces : resident);
  return launch_copy_pieces(pieces, num_pieces, blocks, stream);
}

// Waits for what is queued on `stream` until `start + timeout_s`; on a missed deadline
// or an error it first drains the stream (kDrainTimeoutS), then throws.
void wait_for_stream(cudaStream_t stream, int device, Clock::time_point start, double timeout_s, int64_t total_bytes) {
  Event done;
  const cudaError_t state = done.wait(stream, start + seconds(timeout_s));
  if (state == cudaErrorNotReady) {
    const cudaError_t drained = done.wait(stream, Clock::now() + seconds(kDrainTimeoutS));
    const double late_s = std::chrono::duration<double>(Clock::now() - start).count() - timeout_s;
    if (drained == cudaSuccess)
      LLAMARL_THROW(TimeoutError, "CUDA copy of " << total_bytes << " bytes on device " << device
                                                  << " did not complete within " << timeout_s
                                                  << " s (it completed " << late_s << " s later; nothing is left running)");
    LLAMARL_THROW(Error, "CUDA copy of " << total_bytes << " bytes on device " << device << " did not complete within "
                                         << timeout_s << " s; " << drained_note(drained));
  }
  LLAMARL_CUDA_CHECK(state);
}

// A launch that failed queued nothing; work queued on the stream before it may
// still run: drain it, then report.
[[noreturn]] void throw_launch_error(cudaError_t error, cudaStream_t stream, int device) {
  Event queued;
  const cudaError_t drained = queued.wait(stream, Clock::now() + seconds(kDrainTimeoutS));
  LLAMARL_THROW(Error, "launching the copy kernel on CUDA device " << device << " failed: " << cudaGetErrorName(error)
                                                                    << ": " << cudaGetErrorString(error) << "; "
                                                                    << drained_note(drained));
}

}  // namespace

void launch_pieces_cuda(int device, int64_t stream_handle, int64_t pieces, int64_t num_pieces) {
  require_device(device);
  LLAMARL_CHECK(num_pieces >= 0 && (num_pieces == 0 || pieces != 0), "launch_pieces_cuda: no piece table");
  DeviceGuard guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const cudaError_t error = enqueue_pieces(reinterpret_cast<const CopyPiece*>(pieces), num_pieces, device, stream);
  if (error != cudaSuccess) throw_launch_error(error, stream, device);
}

void wait_stream_cuda(int device, int64_t stream_handle, double timeout_s, int64_t total_bytes) {
  require_device(device);
  LLAMARL_CHECK(timeout_s > 0, "timeout_s must be positive, got " << timeout_s);
  const auto start = Clock::now();
  DeviceGuard guard(device);
  wait_for_stream(reinterpret_cast<cudaStream_t>(stream_handle), device, start, timeout_s, total_bytes);
}

int64_t execute_segments_cuda(const CopySegment* segs, int64_t count, int device, int64_t stream_handle,
                              double timeout_s) {
  require_device(device);
  LLAMARL_CHECK(timeout_s > 0, "timeout_s must be positive, got " << timeout_s);
  const int64_t total = validate_segments(segs, count);
  const std::vector<CopyPiece> pieces = split_into_pieces(segs, count, piece_bytes_for(total));
  const auto start = Clock::now();
  DeviceGuard guard(device);
  // Ordering: the caller made `stream` wait for whatever must precede the copies (the
  // writers of the sources). The piece table goes up through stream-ordered memory on
  // `stream` (its upload from pageable memory returns once the host copy is read),
  // then the kernel, then its release: all three in stream order.
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  if (!pieces.empty()) {
    const size_t table_bytes = pieces.size() * sizeof(CopyPiece);
    void* table = nullptr;
    LLAMARL_CUDA_CHECK(cudaMallocAsync(&table, table_bytes, stream));
    cudaError_t error = cudaMemcpyAsync(table, pieces.data(), table_bytes, cudaMemcpyHostToDevice, stream);
    if (error == cudaSuccess)
      error = enqueue_pieces(static_cast<const CopyPiece*>(table), static_cast<int64_t>(pieces.size()), device, stream);
    cudaFreeAsync(table, stream);
    if (error != cudaSuccess) throw_launch_error(error, stream, device);
  }
  wait_for_stream(stream, device, start, timeout_s, total);
  return total;
}

}  // namespace llamarl
