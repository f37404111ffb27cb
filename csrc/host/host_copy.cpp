#include "host_copy.h"

#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "simd.h"

#ifdef LLAMARL_HOST_X86
#include <immintrin.h>
#endif

namespace llamarl {
namespace {

// One row of fp32 -> bf16: float_to_bf16_rne on each of `n` elements.
void cast_row(const unsigned char* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, in + 4 * i, 4);  // fp32 rows may be unaligned views
    out[i] = float_to_bf16_rne(bits);
  }
}

#ifdef LLAMARL_HOST_X86
// float_to_bf16_rne on 8 lanes: round to nearest even in integers, a NaN (a
// magnitude above inf's, compared as signed ints once the sign is cleared) to 0x7FC0.
LLAMARL_TARGET_AVX2 inline __m256i bf16_rne_avx2(__m256i x) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i is_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
}

// cast_row with AVX2, 16 elements at a time (the same bits), the rest one by one.
LLAMARL_TARGET_AVX2 void cast_row_avx2(const unsigned char* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = bf16_rne_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 4 * i)));
    const __m256i hi = bf16_rne_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 4 * i + 32)));
    // packus packs within 128-bit lanes: [lo0 hi0 lo1 hi1] -> [lo0 lo1 hi0 hi1].
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  cast_row(in + 4 * i, out + i, n - i);
}
#endif

}  // namespace

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
  auto* row_cast = &cast_row;
#ifdef LLAMARL_HOST_X86
  if (host_simd() >= kSimdAvx2) row_cast = &cast_row_avx2;
#endif
  for (int64_t row = 0; row < seg.height; ++row)
    row_cast(src + row * seg.src_pitch, reinterpret_cast<uint16_t*>(dst + row * seg.dst_pitch), seg.width);
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
