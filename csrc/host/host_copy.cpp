#include "host_copy.h"

#include <cstring>
#include <exception>
#include <thread>
#include <vector>

namespace llamarl {

void copy_segment_host(const CopySegment& seg) {
  auto* src = reinterpret_cast<const unsigned char*>(seg.src);
  auto* dst = reinterpret_cast<unsigned char*>(seg.dst);
  if (seg.kind == kCopyBytes) {
    if (seg.height == 1 || (seg.src_pitch == seg.width && seg.dst_pitch == seg.width)) {
      std::memcpy(dst, src, static_cast<size_t>(seg.width * seg.height));
      return;
    }
    for (int64_t row = 0; row < seg.height; ++row)
      std::memcpy(dst + row * seg.dst_pitch, src + row * seg.src_pitch, static_cast<size_t>(seg.width));
    return;
  }
  for (int64_t row = 0; row < seg.height; ++row) {
    const unsigned char* in = src + row * seg.src_pitch;
    auto* out = reinterpret_cast<uint16_t*>(dst + row * seg.dst_pitch);
    for (int64_t i = 0; i < seg.width; ++i) {
      uint32_t bits;
      std::memcpy(&bits, in + 4 * i, 4);  // fp32 rows may be unaligned views
      out[i] = float_to_bf16_rne(bits);
    }
  }
}

namespace {

void run_part(const std::vector<CopySegment>& part) {
  for (const CopySegment& seg : part) copy_segment_host(seg);
}

}  // namespace

int64_t execute_segments_host(const CopySegment* segs, int64_t count, int64_t num_threads) {
  LLAMARL_CHECK(num_threads >= 1, "num_threads must be >= 1, got " << num_threads);
  const int64_t total = validate_segments(segs, count);
  // At least 4 MiB per thread: about 0.3 ms of copying at the 13 GB/s memcpy
  // measured here (bench/RESULTS.md), well above what starting a thread costs.
  constexpr int64_t kMinBytesPerThread = 4 << 20;
  int64_t threads = total / kMinBytesPerThread;
  threads = threads < 1 ? 1 : (threads > num_threads ? num_threads : threads);
  const auto parts = split_segments(segs, count, threads);
  if (parts.size() == 1) {
    run_part(parts[0]);
    return total;
  }
  std::vector<std::thread> workers;
  workers.reserve(parts.size() - 1);
  for (size_t i = 1; i < parts.size(); ++i) workers.emplace_back(run_part, std::cref(parts[i]));
  run_part(parts[0]);
  for (auto& worker : workers) worker.join();
  return total;
}

}  // namespace llamarl
