// What the host's delta codec files share (delta_scan.cpp, delta_apply.cpp): a
// bucket's stretches, word loads and stores, the walk over a bitmask's runs.
// Internal.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "../common.h"

namespace llamarl {
namespace delta_detail {

struct Stretch {
  int64_t start, end, size, first, count;  // bytes [start, end), elements [first, first + count)
  int shift;                               // log2(size)
};

inline std::vector<Stretch> stretches_of(const int64_t* rows, int64_t n, int64_t nbytes) {
  std::vector<Stretch> out;
  int64_t byte = 0, element = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* r = rows + 4 * i;
    const int64_t size = r[2];
    LLAMARL_CHECK(size == 1 || size == 2 || size == 4 || size == 8, "stretch " << i << ": itemsize " << size);
    LLAMARL_CHECK(r[0] == byte && r[1] >= r[0] && (r[1] - r[0]) % size == 0 && r[3] == element,
                  "stretch " << i << " [" << r[0] << ", " << r[1] << ") of " << size
                             << "-byte elements from element " << r[3] << " does not follow byte " << byte
                             << ", element " << element);
    out.push_back({r[0], r[1], size, r[3], (r[1] - r[0]) / size, __builtin_ctzll(static_cast<uint64_t>(size))});
    byte = r[1];
    element += (r[1] - r[0]) / size;
  }
  LLAMARL_CHECK(byte == nbytes, "stretches cover " << byte << " of the bucket's " << nbytes << " bytes");
  return out;
}

inline uint64_t load_word(const uint8_t* p, int64_t len) {
  uint64_t v = 0;
  if (len == 8)
    std::memcpy(&v, p, 8);  // inlined: one load
  else
    std::memcpy(&v, p, static_cast<size_t>(len));
  return v;
}

// memcpy, with the sizes of one element inlined.
inline void put_bytes(uint8_t* dst, const uint8_t* src, int64_t n) {
  switch (n) {
    case 2:
      std::memcpy(dst, src, 2);
      return;
    case 4:
      std::memcpy(dst, src, 4);
      return;
    case 8:
      std::memcpy(dst, src, 8);
      return;
    default:
      std::memcpy(dst, src, static_cast<size_t>(n));
  }
}

// Calls f(first, count) for each run of set bits among the first `elements` bits
// of a little-endian bitmask, in order.
template <typename F>
void for_each_mask_run(const uint8_t* mask, int64_t elements, F&& f) {
  int64_t open = -1;  // the first element of the run under way
  const int64_t bytes = (elements + 7) / 8;
  for (int64_t w = 0; w * 8 < bytes; ++w) {
    const int64_t len = bytes - w * 8 < 8 ? bytes - w * 8 : 8;
    uint64_t x = load_word(mask + w * 8, len);
    const int64_t base = w * 64;
    if (elements - base < 64) x &= (uint64_t{1} << (elements - base)) - 1;
    // A run starts at a set bit after a clear one and stops at a clear bit after a
    // set one (bit -1: whether a run is under way); they alternate.
    const uint64_t before = (x << 1) | (open >= 0 ? 1 : 0);
    uint64_t starts = x & ~before, stops = ~x & before;
    if (elements - base < 64) stops &= (uint64_t{1} << (elements - base)) - 1;  // past the end: the last stop
    while (starts | stops) {
      if (open < 0) {
        open = base + __builtin_ctzll(starts);
        starts &= starts - 1;
      } else {
        f(open, base + __builtin_ctzll(stops) - open);
        open = -1;
        stops &= stops - 1;
      }
    }
  }
  if (open >= 0) f(open, elements - open);
}

}  // namespace delta_detail
}  // namespace llamarl
