// The receiver's side of the host delta codec (delta_codec.h): a MASK or RUNS
// payload checked whole, then written through the bucket's segments.
#include <algorithm>
#include <cstring>
#include <vector>

#include "../common.h"
#include "delta_codec.h"
#include "delta_common.h"

namespace llamarl {
namespace {

using delta_detail::for_each_mask_run;
using delta_detail::load_word;
using delta_detail::put_bytes;

// The set bits among bits [lo, hi) of a little-endian bitmask.
int64_t count_bits(const uint8_t* mask, int64_t lo, int64_t hi) {
  int64_t n = 0;
  for (; lo < hi && (lo & 63); ++lo) n += (mask[lo >> 3] >> (lo & 7)) & 1;
  for (; lo + 64 <= hi; lo += 64) n += __builtin_popcountll(load_word(mask + (lo >> 3), 8));
  for (; lo < hi; ++lo) n += (mask[lo >> 3] >> (lo & 7)) & 1;
  return n;
}

struct Segment {
  uint8_t* address;
  int64_t pitch, width, height, size, first, count;
};

}  // namespace

int64_t delta_apply_host(int64_t encoding, const uint8_t* index, int64_t index_bytes, int64_t index_size,
                         const uint8_t* values, int64_t value_bytes, int64_t changed, const int64_t* segment_rows,
                         int64_t segment_count) {
  LLAMARL_CHECK(encoding == 1 || encoding == 2, "apply takes a MASK (1) or RUNS (2) delta, got " << encoding);
  LLAMARL_CHECK(index_size == 4 || index_size == 8, "index size " << index_size << " (4 or 8)");
  std::vector<Segment> segs;
  int64_t elements = 0;
  for (int64_t i = 0; i < segment_count; ++i) {
    const int64_t* r = segment_rows + 5 * i;
    LLAMARL_CHECK(r[0] != 0 && r[1] >= 0 && r[2] >= 0 && r[3] >= 0 &&
                      (r[4] == 1 || r[4] == 2 || r[4] == 4 || r[4] == 8),
                  "segment " << i << ": null address, negative size or itemsize " << r[4]);
    Segment g{reinterpret_cast<uint8_t*>(r[0]), r[1], r[2], r[3], r[4], elements, r[2] * r[3]};
    if (g.pitch == g.width * g.size && g.count > 0) g.width = g.count, g.height = 1;  // rows back to back: one row
    segs.push_back(g);
    elements += g.count;
  }
  // The runs, checked as they come.
  auto for_each_run = [&](auto&& f) {
    if (encoding == 1) {
      for_each_mask_run(index, elements, f);
      return;
    }
    const int64_t pair = 2 * index_size, count = index_bytes / pair;
    int64_t end = -1;  // one past the last run's last element
    for (int64_t i = 0; i < count; ++i) {
      int64_t first, length;
      if (index_size == 4) {
        int32_t p[2];
        std::memcpy(p, index + i * pair, 8);
        first = p[0];
        length = p[1];
      } else {
        int64_t p[2];
        std::memcpy(p, index + i * pair, 16);
        first = p[0];
        length = p[1];
      }
      LLAMARL_CHECK(length > 0 && first > end && first < elements && length <= elements - first,
                    "a runs delta whose runs are not increasing, apart, non-empty and within the bucket's "
                        << elements << " elements (run " << i << ": " << first << ", " << length << ")");
      end = first + length;
      f(first, length);
    }
  };
  // The whole delta checked first: a mask's counts by popcount, runs walked without writing.
  int64_t taken = 0, read = 0;
  if (encoding == 1) {
    LLAMARL_CHECK(index_bytes * 8 >= elements, "a mask of " << index_bytes << " bytes for " << elements << " elements");
    for (const Segment& g : segs) {
      const int64_t n = count_bits(index, g.first, g.first + g.count);
      taken += n;
      read += n * g.size;
    }
  } else {
    LLAMARL_CHECK(index_bytes % (2 * index_size) == 0, "runs of " << index_bytes << " bytes, not whole pairs");
    size_t s = 0;
    for_each_run([&](int64_t first, int64_t count) {
      taken += count;
      while (count > 0) {
        while (first >= segs[s].first + segs[s].count) ++s;
        const int64_t take = std::min(count, segs[s].first + segs[s].count - first);
        read += take * segs[s].size;
        first += take;
        count -= take;
      }
    });
  }
  LLAMARL_CHECK(taken == changed && read == value_bytes,
                "a delta of " << taken << " elements and " << value_bytes << " value bytes (its elements take "
                              << read << "), which says it holds " << changed << " elements");
  int64_t written = 0;
  size_t s = 0;
  for_each_run([&](int64_t first, int64_t count) {
    while (count > 0) {
      while (first >= segs[s].first + segs[s].count) ++s;
      const Segment& g = segs[s];
      const int64_t local = first - g.first;
      const int64_t row = g.height == 1 ? 0 : local / g.width, col = g.height == 1 ? local : local % g.width;
      const int64_t take = std::min(count, g.width - col);
      put_bytes(g.address + row * g.pitch + col * g.size, values + written, take * g.size);
      written += take * g.size;
      first += take;
      count -= take;
    }
  });
  return written;
}


}  // namespace llamarl
