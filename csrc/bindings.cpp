// The one Python module, llamarl_core._C: one register_* call per subsystem.
// No torch headers: Python validates tensors and passes addresses and sizes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "copy_segments.h"
#include "host/host_copy.h"
#include "host/shared_memory.h"
#ifdef LLAMARL_WITH_CUDA
#include "cuda/cuda_engine.h"
#endif

namespace py = pybind11;
using SegmentArray = py::array_t<int64_t, py::array::c_style>;

namespace llamarl {
namespace {

const CopySegment* segments_of(const SegmentArray& segs, int64_t* count) {
  LLAMARL_CHECK(segs.ndim() == 2 && segs.shape(1) == 7,
                "segments must be an int64 array of shape (n, 7), got ndim " << segs.ndim());
  *count = segs.shape(0);
  return reinterpret_cast<const CopySegment*>(segs.data());
}

void register_host(py::module_& m) {
  py::class_<SharedMemoryRegion>(m, "SharedMemoryRegion", py::buffer_protocol())
      .def_static("create", &SharedMemoryRegion::create, py::arg("nbytes"))
      .def_static("open", &SharedMemoryRegion::open, py::arg("owner_pid"), py::arg("owner_fd"), py::arg("name"),
                  py::arg("nbytes"))
      .def("close", &SharedMemoryRegion::close)
      .def_property_readonly("is_open", &SharedMemoryRegion::is_open)
      .def_property_readonly("address", &SharedMemoryRegion::address)
      .def_property_readonly("nbytes", &SharedMemoryRegion::nbytes)
      .def_property_readonly("fd", &SharedMemoryRegion::fd)
      .def_property_readonly("name", &SharedMemoryRegion::name)
      .def_property_readonly("is_owner", &SharedMemoryRegion::is_owner)
      .def_buffer([](SharedMemoryRegion& region) {
        LLAMARL_CHECK(region.is_open(), "shared memory region is closed");
        return py::buffer_info(reinterpret_cast<void*>(region.address()), 1,
                               py::format_descriptor<uint8_t>::format(), 1, {region.nbytes()}, {1});
      });

  m.def(
      "execute_segments_host",
      [](const SegmentArray& segs, int64_t num_threads) {
        int64_t count = 0;
        const CopySegment* data = segments_of(segs, &count);
        py::gil_scoped_release release;
        return execute_segments_host(data, count, num_threads);
      },
      py::arg("segments"), py::arg("num_threads"),
      "Run (n, 7) int64 segments [src, src_pitch, dst, dst_pitch, width, height, kind] "
      "with memcpy threads; returns bytes written.");
  m.def("float_to_bf16_bits", &float_to_bf16_rne, py::arg("fp32_bits"),
        "The engine's fp32 -> bf16 rounding of one value's bits (shared with the CUDA kernel).");
}

#ifdef LLAMARL_WITH_CUDA
void register_cuda(py::module_& m) {
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_device_uuid", &cuda_device_uuid, py::arg("device"));
  m.def("cuda_device_by_uuid", &cuda_device_by_uuid, py::arg("uuid"));
  m.def(
      "cuda_ipc_export",
      [](int device, int64_t ptr) {
        IpcExport out = cuda_ipc_export(device, ptr);
        return py::make_tuple(py::bytes(out.handle), out.offset, out.alloc_bytes);
      },
      py::arg("device"), py::arg("ptr"));
  m.def(
      "cuda_ipc_open", [](int device, py::bytes handle) { return cuda_ipc_open(device, std::string(handle)); },
      py::arg("device"), py::arg("handle"));
  m.def("cuda_ipc_close", &cuda_ipc_close, py::arg("device"), py::arg("base"));
  m.def(
      "execute_segments_cuda",
      [](const SegmentArray& segs, int device, int64_t stream, double timeout_s) {
        int64_t count = 0;
        const CopySegment* data = segments_of(segs, &count);
        py::gil_scoped_release release;
        return execute_segments_cuda(data, count, device, stream, timeout_s);
      },
      py::arg("segments"), py::arg("device"), py::arg("stream"), py::arg("timeout_s"));
}
#endif

}  // namespace
}  // namespace llamarl

PYBIND11_MODULE(_C, m) {
  m.doc() = "llamarl native copy engine (host shared memory, CUDA IPC)";
  py::register_exception<llamarl::Error>(m, "EngineError", PyExc_RuntimeError);
  llamarl::register_host(m);
#ifdef LLAMARL_WITH_CUDA
  m.attr("built_with_cuda") = true;
  llamarl::register_cuda(m);
#else
  m.attr("built_with_cuda") = false;
#endif
}
