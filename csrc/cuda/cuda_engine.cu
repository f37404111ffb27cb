#include "cuda_engine.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <chrono>
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

// Restores the calling thread's current device on scope exit, so that a copy on
// device d does not move the caller (torch keeps its own notion of the device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    LLAMARL_CUDA_CHECK(cudaGetDevice(&previous_));
    LLAMARL_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

void require_device(int device) {
  const int count = cuda_device_count();
  LLAMARL_CHECK(count > 0, "no CUDA device: the driver is missing or no GPU is visible");
  LLAMARL_CHECK(device >= 0 && device < count, "CUDA device " << device << " out of range [0, " << count << ")");
}

// One thread per output element, grid-striding over the rectangle; rows are
// addressed through the pitches so strided views need no staging.
__global__ void cast_f32_to_bf16_kernel(const unsigned char* src, int64_t src_pitch, unsigned char* dst,
                                        int64_t dst_pitch, int64_t width, int64_t height) {
  const int64_t total = width * height;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / width;
    const int64_t col = i - row * width;
    const uint32_t bits = *reinterpret_cast<const uint32_t*>(src + row * src_pitch + 4 * col);
    *reinterpret_cast<uint16_t*>(dst + row * dst_pitch + 2 * col) = float_to_bf16_rne(bits);
  }
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

IpcExport cuda_ipc_export(int device, int64_t ptr) {
  require_device(device);
  DeviceGuard guard(device);
  // The allocation base comes from the driver; fetched through the runtime so the
  // module never links libcuda (absent on machines without a driver).
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status;
  LLAMARL_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                                      &status));
  LLAMARL_CHECK(fn != nullptr && status == cudaDriverEntryPointSuccess, "driver lacks cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult res =
      reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn)(&base, &size, static_cast<CUdeviceptr>(ptr));
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

int64_t execute_segments_cuda(const CopySegment* segs, int64_t count, int device, int64_t stream_handle,
                              double timeout_s) {
  require_device(device);
  const int64_t total = validate_segments(segs, count);
  DeviceGuard guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  for (int64_t i = 0; i < count; ++i) {
    const CopySegment& seg = segs[i];
    if (seg.width == 0 || seg.height == 0) continue;
    auto* src = reinterpret_cast<unsigned char*>(seg.src);
    auto* dst = reinterpret_cast<unsigned char*>(seg.dst);
    if (seg.kind == kCopyBytes) {
      const int64_t spitch = seg.height == 1 ? seg.width : seg.src_pitch;
      const int64_t dpitch = seg.height == 1 ? seg.width : seg.dst_pitch;
      LLAMARL_CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, seg.width, seg.height, cudaMemcpyDefault,
                                           stream));
    } else {
      // 256 threads x up to 4096 blocks: enough to saturate HBM on sm_90 for the
      // large rows of a weight matrix; the kernel grid-strides over the rest.
      const int64_t total_elems = seg.width * seg.height;
      const int64_t blocks = (total_elems + 255) / 256;
      cast_f32_to_bf16_kernel<<<blocks < 4096 ? blocks : 4096, 256, 0, stream>>>(
          src, seg.src_pitch, dst, seg.dst_pitch, seg.width, seg.height);
      LLAMARL_CUDA_CHECK(cudaGetLastError());
    }
  }
  cudaEvent_t done;
  LLAMARL_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  LLAMARL_CUDA_CHECK(cudaEventRecord(done, stream));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  cudaError_t state;
  while ((state = cudaEventQuery(done)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) {
      cudaEventDestroy(done);
      LLAMARL_CHECK(false, "CUDA copy of " << total << " bytes did not complete within " << timeout_s << " s");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  cudaEventDestroy(done);
  LLAMARL_CUDA_CHECK(state);
  return total;
}

}  // namespace llamarl
