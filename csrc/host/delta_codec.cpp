#include "delta_codec.h"

#include <cstring>
#include <vector>

#include "../common.h"
#include "checksum.h"

namespace llamarl {
namespace {

struct Stretch {
  int64_t start, end, size, first, count;  // bytes [start, end), elements [first, first + count)
  int shift;                               // log2(size)
};

std::vector<Stretch> stretches_of(const int64_t* rows, int64_t n, int64_t nbytes) {
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
  std::memcpy(&v, p, static_cast<size_t>(len));
  return v;
}

// Calls f(first, count) for each run of set bits among the first `elements` bits
// of a little-endian bitmask, in order.
template <typename F>
void for_each_mask_run(const uint8_t* mask, int64_t elements, F&& f) {
  int64_t run_first = -1, run_count = 0;
  const int64_t bytes = (elements + 7) / 8;
  for (int64_t w = 0; w * 8 < bytes; ++w) {
    const int64_t len = bytes - w * 8 < 8 ? bytes - w * 8 : 8;
    uint64_t x = load_word(mask + w * 8, len);
    const int64_t base = w * 64;
    if (elements - base < 64) x &= (uint64_t{1} << (elements - base)) - 1;
    while (x) {
      const int t = __builtin_ctzll(x);
      const uint64_t rest = ~(x >> t);
      const int n = rest ? __builtin_ctzll(rest) : 64 - t;
      if (run_count && run_first + run_count == base + t) {
        run_count += n;
      } else {
        if (run_count) f(run_first, run_count);
        run_first = base + t;
        run_count = n;
      }
      x = (t + n >= 64) ? 0 : (x & ~(((uint64_t{1} << n) - 1) << t));
    }
  }
  if (run_count) f(run_first, run_count);
}

struct Segment {
  uint8_t* address;
  int64_t pitch, width, height, size, first, count;
};

}  // namespace

DeltaScan delta_scan_host(const uint8_t* fresh, uint8_t* base, int64_t nbytes, const int64_t* stretch_rows,
                          int64_t stretch_count, uint8_t* mask, bool update_base) {
  LLAMARL_CHECK(nbytes >= 0, "negative bucket size " << nbytes);
  const std::vector<Stretch> st = stretches_of(stretch_rows, stretch_count, nbytes);
  DeltaScan out{0, 0, 0, 0};
  uint64_t change = 0;
  size_t s = 0;
  int64_t last = -1;  // the last element marked (marks come in increasing order)
  auto mark = [&](int64_t e, int64_t size) {
    if (e == last) return;
    mask[e >> 3] |= static_cast<uint8_t>(1u << (e & 7));
    out.changed += 1;
    out.value_bytes += size;
    if (last < 0 || e != last + 1) out.runs += 1;
    last = e;
  };
  auto word = [&](int64_t offset, int64_t len) {
    const uint64_t now = load_word(fresh + offset, len), was = load_word(base + offset, len);
    if (now == was) return;
    change += checksum_term(static_cast<uint64_t>(offset) >> 3, now) -
              checksum_term(static_cast<uint64_t>(offset) >> 3, was);
    if (update_base) std::memcpy(base + offset, fresh + offset, static_cast<size_t>(len));
    uint64_t x = now ^ was;
    while (offset >= st[s].end) ++s;
    const Stretch& t = st[s];
    if (len == 8 && offset + 8 <= t.end && ((offset - t.start) & (t.size - 1)) == 0) {
      // The word holds whole elements of one stretch: one test per element.
      const int lane_bits = static_cast<int>(8 * t.size);
      const uint64_t lane = lane_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << lane_bits) - 1;
      const int64_t e0 = t.first + ((offset - t.start) >> t.shift);
      for (int j = 0; x; ++j, x = lane_bits == 64 ? 0 : x >> lane_bits) {
        if (x & lane) mark(e0 + j, t.size);
      }
      return;
    }
    while (x) {  // element by element through the bytes that differ
      const int byte = __builtin_ctzll(x) >> 3;
      x &= ~(uint64_t{0xFF} << (8 * byte));
      const int64_t position = offset + byte;
      size_t k = s;
      while (position >= st[k].end) ++k;
      mark(st[k].first + ((position - st[k].start) >> st[k].shift), st[k].size);
    }
  };
  int64_t offset = 0;
  for (; offset + 64 <= nbytes; offset += 64) {
    if (std::memcmp(fresh + offset, base + offset, 64) == 0) continue;
    for (int64_t w = 0; w < 64; w += 8) word(offset + w, 8);
  }
  for (; offset < nbytes; offset += 8) word(offset, nbytes - offset < 8 ? nbytes - offset : 8);
  out.checksum_change = static_cast<int64_t>(change);
  return out;
}

void delta_gather_host(const uint8_t* fresh, const int64_t* stretch_rows, int64_t stretch_count,
                       const uint8_t* mask, int64_t elements, uint8_t* values, int64_t value_bytes,
                       uint8_t* runs, int64_t run_count, int64_t index_size) {
  LLAMARL_CHECK(index_size == 4 || index_size == 8, "index size " << index_size << " (4 or 8)");
  const int64_t nbytes = stretch_count ? stretch_rows[4 * (stretch_count - 1) + 1] : 0;
  const std::vector<Stretch> st = stretches_of(stretch_rows, stretch_count, nbytes);
  const int64_t total = st.empty() ? 0 : st.back().first + st.back().count;
  LLAMARL_CHECK(elements == total, "a mask of " << elements << " elements over stretches of " << total);
  LLAMARL_CHECK(index_size == 8 || elements <= INT32_MAX, "int32 runs for a bucket of " << elements << " elements");
  int64_t written = 0, run = 0;
  size_t s = 0;
  for_each_mask_run(mask, elements, [&](int64_t first, int64_t count) {
    if (runs != nullptr) {
      LLAMARL_CHECK(run < run_count, "more than the " << run_count << " runs the scan counted");
      if (index_size == 4) {
        const int32_t pair[2] = {static_cast<int32_t>(first), static_cast<int32_t>(count)};
        std::memcpy(runs + run * 8, pair, 8);
      } else {
        const int64_t pair[2] = {first, count};
        std::memcpy(runs + run * 16, pair, 16);
      }
    }
    run += 1;
    while (count > 0) {
      while (first >= st[s].first + st[s].count) ++s;
      const int64_t take = count < st[s].first + st[s].count - first ? count : st[s].first + st[s].count - first;
      const int64_t bytes = take * st[s].size;
      LLAMARL_CHECK(written + bytes <= value_bytes, "more than the " << value_bytes << " value bytes the scan counted");
      std::memcpy(values + written, fresh + st[s].start + (first - st[s].first) * st[s].size,
                  static_cast<size_t>(bytes));
      written += bytes;
      first += take;
      count -= take;
    }
  });
  LLAMARL_CHECK(written == value_bytes && (runs == nullptr || run == run_count),
                "gathered " << written << " value bytes in " << run << " runs, the scan counted " << value_bytes
                            << " in " << run_count);
}

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
    segs.push_back({reinterpret_cast<uint8_t*>(r[0]), r[1], r[2], r[3], r[4], elements, r[2] * r[3]});
    elements += r[2] * r[3];
  }
  // The runs, checked as they come; a pass that only counts, then the one that writes.
  auto for_each_run = [&](auto&& f) {
    if (encoding == 1) {
      LLAMARL_CHECK(index_bytes * 8 >= elements,
                    "a mask of " << index_bytes << " bytes for " << elements << " elements");
      for_each_mask_run(index, elements, f);
      return;
    }
    const int64_t pair = 2 * index_size, count = index_bytes / pair;
    LLAMARL_CHECK(index_bytes % pair == 0, "runs of " << index_bytes << " bytes, not whole pairs");
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
  auto walk = [&](bool write) {
    int64_t taken = 0, read = 0;
    size_t s = 0;
    for_each_run([&](int64_t first, int64_t count) {
      taken += count;
      while (count > 0) {
        while (first >= segs[s].first + segs[s].count) ++s;
        const Segment& g = segs[s];
        const int64_t local = first - g.first, row = local / g.width, col = local % g.width;
        const int64_t take = count < g.width - col ? count : g.width - col;
        const int64_t bytes = take * g.size;
        if (write) std::memcpy(g.address + row * g.pitch + col * g.size, values + read, static_cast<size_t>(bytes));
        read += bytes;
        first += take;
        count -= take;
      }
    });
    LLAMARL_CHECK(taken == changed && read == value_bytes,
                  "a delta of " << taken << " elements and " << value_bytes << " value bytes (its elements take "
                                << read << "), which says it holds " << changed << " elements");
    return read;
  };
  walk(false);
  return walk(true);
}

}  // namespace llamarl
