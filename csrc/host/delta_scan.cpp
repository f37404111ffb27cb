// The sender's side of the host delta codec (delta_codec.h): the scan of a bucket
// against its base, straight from the sender's tensors through the pack table or
// from packed bytes, split over threads, AVX-512 or AVX2 where the CPU has it; the runs of
// a scan's bitmask.
#include <algorithm>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "../common.h"
#include "checksum.h"
#include "delta_codec.h"
#include "delta_common.h"
#include "host_copy.h"
#include "simd.h"

#ifdef LLAMARL_HOST_X86
#include <immintrin.h>
#endif

namespace llamarl {
namespace {

using delta_detail::for_each_mask_run;
using delta_detail::load_word;
using delta_detail::put_bytes;
using delta_detail::Stretch;
using delta_detail::stretches_of;

// One scan of a bucket against its base, fed its fresh bytes one window at a time
// (all of them at once, or a fused pack's chunks): marks the elements that differ
// in increasing order (an element marked from two of its bytes' words counts
// once), copies each one's bytes to `values`, keeps the base and checksum change.
struct Scanner {
  const std::vector<Stretch>& st;
  uint8_t* base;
  uint8_t* mask;    // from the bucket's mask byte mask_lo on
  uint8_t* values;  // null: not copied
  bool update_base;
  int64_t mask_lo = 0;
  DeltaScan out{0, 0, 0, 0};
  int64_t first = -1, last = -1;  // the first and last element marked
  uint64_t change = 0;
  size_t s = 0;  // the stretch of the last position looked at (positions only increase)
  const uint8_t* window = nullptr;  // the fresh bytes from bucket byte window_lo on
  int64_t window_lo = 0;

  const uint8_t* fresh(int64_t at) const { return window + (at - window_lo); }

  // Element e, whose `size` bytes start at byte `at` of the bucket.
  void one(int64_t e, int64_t size, int64_t at) {
    if (e == last) return;
    if (first < 0) first = e;
    mask[(e >> 3) - mask_lo] |= static_cast<uint8_t>(1u << (e & 7));
    if (values != nullptr) put_bytes(values + out.value_bytes, fresh(at), size);
    out.changed += 1;
    out.value_bytes += size;
    if (last < 0 || e != last + 1) out.runs += 1;
    last = e;
  }

  // The elements e0 .. e0 + lanes - 1 (lanes <= 64) whose bits `m` (not 0) sets,
  // all after `last`; their values are the caller's to copy, to values +
  // out.value_bytes, before this call.
  void block(int64_t e0, uint64_t m, int lanes, int64_t size) {
    const int shift = static_cast<int>(e0 & 7);
    const unsigned __int128 bits = static_cast<unsigned __int128>(m) << shift;
    for (int i = 0, n = (shift + lanes + 7) >> 3; i < n; ++i)
      mask[(e0 >> 3) + i - mask_lo] |= static_cast<uint8_t>(bits >> (8 * i));
    if (first < 0) first = e0 + __builtin_ctzll(m);
    const uint64_t before = (last >= 0 && last == e0 - 1) ? 1 : 0;  // a run that goes on into this block
    const int64_t count = __builtin_popcountll(m);
    out.runs += __builtin_popcountll(m & ~((m << 1) | before));
    out.changed += count;
    out.value_bytes += count * size;
    last = e0 + 63 - __builtin_clzll(m);
  }

  // The stretch of bucket byte `offset` (positions only increase) when bytes
  // [offset, offset + len) are whole elements of it alone, else nullptr.
  const Stretch* whole_elements(int64_t offset, int64_t len) {
    while (offset >= st[s].end) ++s;
    const Stretch& t = st[s];
    return offset + len <= t.end && ((offset - t.start) & (t.size - 1)) == 0 ? &t : nullptr;
  }

  // Marks the elements of the word at `offset` (`len` bytes) whose bytes the set
  // bits of `x` (fresh ^ base) cover.
  void mark_word(int64_t offset, int64_t len, uint64_t x) {
    const Stretch* whole = whole_elements(offset, len);
    if (len == 8 && whole != nullptr) {
      // The word holds whole elements of one stretch: one test per element.
      const Stretch& t = *whole;
      const int lane_bits = static_cast<int>(8 * t.size);
      const uint64_t lane = lane_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << lane_bits) - 1;
      const int64_t e0 = t.first + ((offset - t.start) >> t.shift);
      for (int j = 0; x; ++j, x = lane_bits == 64 ? 0 : x >> lane_bits) {
        if (x & lane) one(e0 + j, t.size, offset + j * t.size);
      }
      return;
    }
    while (x) {  // element by element through the bytes that differ
      const int byte = __builtin_ctzll(x) >> 3;
      x &= ~(uint64_t{0xFF} << (8 * byte));
      const int64_t position = offset + byte;
      size_t k = s;
      while (position >= st[k].end) ++k;
      const int64_t local = (position - st[k].start) >> st[k].shift;
      one(st[k].first + local, st[k].size, st[k].start + (local << st[k].shift));
    }
  }

  // The plain scan of bytes [offset, hi) (offset a multiple of 64; hi too, or the
  // bucket's end): word by word where a 64-byte block differs.
  void words(int64_t offset, int64_t hi) {
    auto word = [&](int64_t at, int64_t len) {
      const uint64_t now = load_word(fresh(at), len), was = load_word(base + at, len);
      if (now == was) return;
      change += checksum_term(static_cast<uint64_t>(at) >> 3, now) - checksum_term(static_cast<uint64_t>(at) >> 3, was);
      if (update_base) std::memcpy(base + at, fresh(at), static_cast<size_t>(len));
      mark_word(at, len, now ^ was);
    };
    for (; offset + 64 <= hi; offset += 64) {
      if (std::memcmp(fresh(offset), base + offset, 64) == 0) continue;
      for (int64_t w = 0; w < 64; w += 8) word(offset + w, 8);
    }
    for (; offset < hi; offset += 8) word(offset, hi - offset < 8 ? hi - offset : 8);
  }

  // Bytes [lo, hi) of the bucket, whose fresh bytes start at `data` (bucket byte
  // data_lo <= lo - 7 where lo > 0; through hi + 7 where hi < nbytes: an element
  // that straddles lo or hi is read whole).
  void scan(const uint8_t* data, int64_t data_lo, int64_t lo, int64_t hi);
};

#ifdef LLAMARL_HOST_X86
// checksum_term of 8 words at once, written with the compiler's vector types (the
// same C arithmetic as checksum_term, lane by lane).
LLAMARL_TARGET_AVX512 inline __m512i checksum_terms(__m512i index, __m512i value) {
  typedef uint64_t Lanes __attribute__((vector_size(64)));
  const Lanes v = reinterpret_cast<Lanes>(value);
  const Lanes masked = v ^ (reinterpret_cast<Lanes>(index) * kChecksumKey);
  return reinterpret_cast<__m512i>((masked & 0xFFFFFFFFull) * (masked >> 32) + ((v << 32) | (v >> 32)));
}

// The whole 64-byte blocks of [lo, hi) (lo a multiple of 64) with AVX-512: a block
// that differs is marked and its changed elements compressed into the values lane
// by lane where it holds whole elements of one stretch, word by word (mark_word)
// where it does not. Returns the first byte it did not scan (a tail under 64 bytes).
LLAMARL_TARGET_AVX512 int64_t scan_blocks_avx512(Scanner& sc, int64_t lo, int64_t hi) {
  __m512i sum = _mm512_setzero_si512();
  const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  int64_t offset = lo;
  for (; offset + 64 <= hi; offset += 64) {
    const __m512i now = _mm512_loadu_si512(sc.fresh(offset)), was = _mm512_loadu_si512(sc.base + offset);
    const __mmask8 words = _mm512_cmpneq_epi64_mask(now, was);
    if (!words) continue;
    const __m512i index = _mm512_add_epi64(_mm512_set1_epi64(offset >> 3), lanes);
    sum = _mm512_mask_add_epi64(sum, words, sum,
                                _mm512_sub_epi64(checksum_terms(index, now), checksum_terms(index, was)));
    if (sc.update_base) _mm512_storeu_si512(sc.base + offset, now);
    const Stretch* whole = sc.whole_elements(offset, 64);
    if (whole == nullptr) {
      alignas(64) uint64_t a[8], b[8];
      _mm512_store_si512(a, now);
      _mm512_store_si512(b, was);
      for (int w = 0; w < 8; ++w)
        if (a[w] != b[w]) sc.mark_word(offset + 8 * w, 8, a[w] ^ b[w]);
      continue;
    }
    const Stretch& t = *whole;
    // Compressed in a register, then stored whole (a compress straight to memory is
    // microcoded on some CPUs, Zen 4's among them): up to 63 bytes past the values.
    uint64_t m;
    __m512i packed;
    switch (t.size) {
      case 1:
        m = _mm512_cmpneq_epi8_mask(now, was);
        packed = _mm512_maskz_compress_epi8(m, now);
        break;
      case 2:
        m = _mm512_cmpneq_epi16_mask(now, was);
        packed = _mm512_maskz_compress_epi16(static_cast<__mmask32>(m), now);
        break;
      case 4:
        m = _mm512_cmpneq_epi32_mask(now, was);
        packed = _mm512_maskz_compress_epi32(static_cast<__mmask16>(m), now);
        break;
      default:
        m = words;
        packed = _mm512_maskz_compress_epi64(words, now);
        break;
    }
    if (sc.values != nullptr) _mm512_storeu_si512(sc.values + sc.out.value_bytes, packed);
    sc.block(t.first + ((offset - t.start) >> t.shift), m, static_cast<int>(64 >> t.shift), t.size);
  }
  sc.change += static_cast<uint64_t>(_mm512_reduce_add_epi64(sum));
  return offset;
}

// Bit w set where byte group w (bits 8w .. 8w + 7) of x has a bit set.
inline uint64_t group_bits(uint64_t x) {
  x |= x >> 4;
  x |= x >> 2;
  x |= x >> 1;
  return ((x & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56;
}

// Bit e set where element e of a 64-byte block of (1 << shift)-byte elements has a
// byte whose bit of `bytes` is set (no pext: microcoded on Zen 2 and earlier).
inline uint64_t element_bits(uint64_t bytes, int shift) {
  uint64_t x = bytes;
  switch (shift) {
    case 0:
      return x;
    case 1:
      x = (x | (x >> 1)) & 0x5555555555555555ull;
      x = (x | (x >> 1)) & 0x3333333333333333ull;
      x = (x | (x >> 2)) & 0x0F0F0F0F0F0F0F0Full;
      x = (x | (x >> 4)) & 0x00FF00FF00FF00FFull;
      x = (x | (x >> 8)) & 0x0000FFFF0000FFFFull;
      return (x | (x >> 16)) & 0xFFFFFFFFull;
    case 2:
      x = (x | (x >> 1) | (x >> 2) | (x >> 3)) & 0x1111111111111111ull;
      x = (x | (x >> 3)) & 0x0303030303030303ull;
      x = (x | (x >> 6)) & 0x000F000F000F000Full;
      x = (x | (x >> 12)) & 0x000000FF000000FFull;
      return (x | (x >> 24)) & 0xFFFFull;
    default:
      return group_bits(x);
  }
}

// The whole 64-byte blocks of [lo, hi) (lo a multiple of 64) with AVX2: a block
// that differs is marked and its changed elements copied out one by one where it
// holds whole elements of one stretch, word by word (mark_word) where it does not.
// Returns the first byte it did not scan (a tail under 64 bytes).
LLAMARL_TARGET_AVX2 int64_t scan_blocks_avx2(Scanner& sc, int64_t lo, int64_t hi) {
  int64_t offset = lo;
  for (; offset + 64 <= hi; offset += 64) {
    const uint8_t* fresh = sc.fresh(offset);
    uint8_t* base = sc.base + offset;
    const __m256i now0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(fresh));
    const __m256i now1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(fresh + 32));
    const __m256i was0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base));
    const __m256i was1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 32));
    const __m256i any = _mm256_or_si256(_mm256_xor_si256(now0, was0), _mm256_xor_si256(now1, was1));
    if (_mm256_testz_si256(any, any)) continue;
    const uint64_t same = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(now0, was0))) |
                          static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(now1, was1))))
                              << 32;
    const uint64_t bytes = ~same, words = group_bits(bytes);
    alignas(32) uint64_t a[9], b[8];  // a's ninth word: room for an element's 8-byte copy from its last
    _mm256_store_si256(reinterpret_cast<__m256i*>(a), now0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(a + 4), now1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b), was0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b + 4), was1);
    a[8] = 0;
    for (uint64_t m = words; m; m &= m - 1) {
      const int w = __builtin_ctzll(m);
      const uint64_t index = (static_cast<uint64_t>(offset) >> 3) + static_cast<uint64_t>(w);
      sc.change += checksum_term(index, a[w]) - checksum_term(index, b[w]);
    }
    if (sc.update_base) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(base), now0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + 32), now1);
    }
    const Stretch* whole = sc.whole_elements(offset, 64);
    if (whole == nullptr) {
      for (uint64_t m = words; m; m &= m - 1) {
        const int w = __builtin_ctzll(m);
        sc.mark_word(offset + 8 * w, 8, a[w] ^ b[w]);
      }
      continue;
    }
    const Stretch& t = *whole;
    const uint64_t m = element_bits(bytes, t.shift);
    if (sc.values != nullptr) {  // 8 bytes an element: up to 7 past the values (room: 64 a thread)
      uint8_t* out = sc.values + sc.out.value_bytes;
      const uint8_t* from = reinterpret_cast<const uint8_t*>(a);
      for (uint64_t r = m; r; r &= r - 1, out += t.size) std::memcpy(out, from + (__builtin_ctzll(r) << t.shift), 8);
    }
    sc.block(t.first + ((offset - t.start) >> t.shift), m, static_cast<int>(64 >> t.shift), t.size);
  }
  return offset;
}
#endif

void Scanner::scan(const uint8_t* data, int64_t data_lo, int64_t lo, int64_t hi) {
  window = data;
  window_lo = data_lo;
  int64_t offset = lo;
#ifdef LLAMARL_HOST_X86
  const HostSimd level = host_simd();
  if (level == kSimdAvx512)
    offset = scan_blocks_avx512(*this, lo, hi);
  else if (level == kSimdAvx2)
    offset = scan_blocks_avx2(*this, lo, hi);
#endif
  words(offset, hi);
}

// Writes the bytes of packed positions [lo, hi) into `out` as the pack segments
// would (`packs`: segments whose destination rows follow one another, segment g
// from position starts[g]; starts ends with the bucket's size). A cast segment's
// elements are written whole: up to one byte before `out` and one past its end.
void pack_window(const std::vector<CopySegment>& packs, const std::vector<int64_t>& starts, int64_t lo, int64_t hi,
                 uint8_t* out) {
  size_t g = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin()) - 1;
  for (int64_t at = lo; at < hi;) {
    const CopySegment& seg = packs[g];
    const int64_t unit = dst_elem_bytes(seg.kind), row_bytes = seg.width * unit;
    const int64_t local = at - starts[g], row = local / row_bytes, col = local % row_bytes;
    const int64_t stop = std::min(row_bytes, col + (hi - at));
    const int64_t first = col - col % unit, last = stop + (unit - stop % unit) % unit;  // whole elements
    copy_segment_host(CopySegment{seg.src + row * seg.src_pitch + first / unit * src_elem_bytes(seg.kind), 0,
                                  reinterpret_cast<int64_t>(out + (at - lo) - (col - first)), 0,
                                  (last - first) / unit, 1, seg.kind});
    at += stop - col;
    if (at == starts[g + 1]) ++g;
  }
}

// The element that holds byte `at` of the bucket (at < the bucket's size).
int64_t element_at(const std::vector<Stretch>& st, int64_t at) {
  size_t t = 0;
  while (at >= st[t].end) ++t;
  return st[t].first + ((at - st[t].start) >> st[t].shift);
}

// The byte bounds of the parts a bucket of `nbytes` is split into for up to
// `threads` threads: whole 64 KiB blocks, at least 4 MiB a part.
std::vector<int64_t> part_bounds(int64_t nbytes, int64_t threads) {
  constexpr int64_t kBlock = 64 << 10, kMinPartBytes = 4 << 20;
  LLAMARL_CHECK(threads >= 1, "threads must be >= 1, got " << threads);
  const int64_t blocks = (nbytes + kBlock - 1) / kBlock;
  const int64_t parts = std::max<int64_t>(1, std::min({threads, blocks, nbytes / kMinPartBytes}));
  std::vector<int64_t> bounds;
  for (int64_t k = 0; k < parts; ++k) bounds.push_back(std::min(nbytes, blocks * k / parts * kBlock));
  bounds.push_back(nbytes);
  return bounds;
}

// f(k) for every part k < parts, part 0 on this thread and the others on threads of
// their own (one that cannot start runs here); the first exception is rethrown once
// every part has ended.
template <typename F>
void run_parts(int64_t parts, F&& f) {
  std::vector<std::exception_ptr> errors(parts);
  auto run = [&](int64_t k) {
    try {
      f(k);
    } catch (...) {
      errors[k] = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  std::vector<int64_t> here = {0};
  for (int64_t k = 1; k < parts; ++k) {
    try {
      workers.emplace_back(run, k);
    } catch (...) {  // no thread to be had: this one runs the part
      here.push_back(k);
    }
  }
  for (int64_t k : here) run(k);
  for (auto& worker : workers) worker.join();
  for (auto& error : errors)
    if (error) std::rethrow_exception(error);
}

// A scan of the bucket's bytes in the parts of part_bounds, one thread each:
// part(scanner, lo, hi) feeds a Scanner bytes [lo, hi). Part 0 marks the caller's
// mask and writes its values from `values`; part k > 0 marks a mask of its own
// over the mask bytes of its elements, ORed in after, and writes its values from
// values + lo + 64 k (room: nbytes + 64 x threads), moved down after. An element
// across two parts, marked by both, counts once; a run across them, once.
template <typename Part>
DeltaScan scan_in_parts(const std::vector<Stretch>& st, uint8_t* base, int64_t nbytes, uint8_t* mask, uint8_t* values,
                        bool update_base, int64_t threads, Part&& part) {
  const std::vector<int64_t> bounds = part_bounds(nbytes, threads);
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<std::vector<uint8_t>> masks(parts);  // part k's own (k > 0), from mask byte mask_lo on
  std::vector<Scanner> scanners;
  for (int64_t k = 0; k < parts; ++k) {
    scanners.push_back(Scanner{st, base, mask, values == nullptr ? nullptr : values + (k ? bounds[k] + 64 * k : 0),
                               update_base});
    if (k == 0) continue;
    const int64_t lo = element_at(st, bounds[k]) >> 3, hi = element_at(st, bounds[k + 1] - 1) >> 3;
    masks[k].assign(static_cast<size_t>(hi - lo + 1), 0);
    scanners[k].mask = masks[k].data();
    scanners[k].mask_lo = lo;
  }
  run_parts(parts, [&](int64_t k) { part(scanners[k], bounds[k], bounds[k + 1]); });
  DeltaScan out = scanners[0].out;
  uint64_t change = scanners[0].change;
  int64_t last = scanners[0].last;
  for (int64_t k = 1; k < parts; ++k) {
    Scanner& sc = scanners[k];
    change += sc.change;
    if (sc.first < 0) continue;
    for (int64_t b = sc.first >> 3; b <= sc.last >> 3; ++b) mask[b] |= masks[k][b - sc.mask_lo];
    int64_t skip = 0;  // value bytes of an element the part before marked too
    if (last >= 0 && sc.first == last) {
      size_t t = 0;
      while (last >= st[t].first + st[t].count) ++t;
      skip = st[t].size;
      sc.out.changed -= 1;
      sc.out.runs -= 1;
    } else if (last >= 0 && sc.first == last + 1) {
      sc.out.runs -= 1;
    }
    if (values != nullptr)
      std::memmove(values + out.value_bytes, sc.values + skip, static_cast<size_t>(sc.out.value_bytes - skip));
    out.changed += sc.out.changed;
    out.runs += sc.out.runs;
    out.value_bytes += sc.out.value_bytes - skip;
    last = sc.last;
  }
  out.checksum_change = static_cast<int64_t>(change);
  return out;
}

}  // namespace

DeltaScan delta_scan_host(const uint8_t* fresh, uint8_t* base, int64_t nbytes, const int64_t* stretch_rows,
                          int64_t stretch_count, uint8_t* mask, bool update_base, uint8_t* values, int64_t threads) {
  LLAMARL_CHECK(nbytes >= 0, "negative bucket size " << nbytes);
  const std::vector<Stretch> st = stretches_of(stretch_rows, stretch_count, nbytes);
  return scan_in_parts(st, base, nbytes, mask, values, update_base, threads,
                       [&](Scanner& sc, int64_t lo, int64_t hi) { sc.scan(fresh, 0, lo, hi); });
}

namespace {

// A pack table's segments that write a byte, each from packed position starts[g]
// (starts ends with the bucket's size), checked to write the packed bytes of
// [staging, staging + nbytes) back to back.
struct Packing {
  std::vector<CopySegment> packs;
  std::vector<int64_t> starts;
};

Packing packing_of(const CopySegment* pack, int64_t pack_count, int64_t staging, int64_t nbytes) {
  Packing out;
  int64_t position = 0;
  for (int64_t i = 0; i < pack_count; ++i) {
    const CopySegment& seg = pack[i];
    validate_segment(seg, i);
    const int64_t row_bytes = seg.width * dst_elem_bytes(seg.kind);
    if (row_bytes * seg.height == 0) continue;
    LLAMARL_CHECK(seg.dst == staging + position && (seg.height == 1 || seg.dst_pitch == row_bytes),
                  "pack segment " << i << " does not write the packed bytes that follow position " << position
                                  << " (its rows back to back)");
    out.packs.push_back(seg);
    out.starts.push_back(position);
    position += row_bytes * seg.height;
  }
  LLAMARL_CHECK(position == nbytes, "pack segments of " << position << " bytes for a bucket of " << nbytes);
  out.starts.push_back(nbytes);
  return out;
}

// Chunks of 4 KiB: each packed into a scratch buffer (in L1), then used. Small chunks
// keep the reads of the tensors and of the base close together (64 KiB chunks
// scanned 256 MiB 25% slower here, prefetching the base 30% slower).
constexpr int64_t kChunk = 4 << 10;
static_assert(kChunk % 64 == 0, "chunks start on whole words and blocks (checksum_span, the vector scans)");

}  // namespace

DeltaScan delta_scan_packing_host(const CopySegment* pack, int64_t pack_count, int64_t staging, uint8_t* base,
                                  int64_t nbytes, const int64_t* stretch_rows, int64_t stretch_count, uint8_t* mask,
                                  bool update_base, uint8_t* values, int64_t threads) {
  LLAMARL_CHECK(nbytes >= 0, "negative bucket size " << nbytes);
  const std::vector<Stretch> st = stretches_of(stretch_rows, stretch_count, nbytes);
  const Packing p = packing_of(pack, pack_count, staging, nbytes);
  // Each chunk packed with kMargin bytes either side (an element across its edges
  // read whole), then scanned: the staging buffer is never written.
  return scan_in_parts(st, base, nbytes, mask, values, update_base, threads, [&](Scanner& sc, int64_t lo, int64_t hi) {
    constexpr int64_t kMargin = 8;
    alignas(64) uint8_t scratch[kChunk + 3 * 64];
    for (int64_t at = lo; at < hi; at += kChunk) {
      const int64_t end = std::min(hi, at + kChunk);
      const int64_t from = std::max<int64_t>(0, at - kMargin), to = std::min(nbytes, end + kMargin);
      // Byte `at` lands 64-byte aligned (the scan's loads split no cache line), with
      // room for a cast element's byte before `from`.
      uint8_t* out = scratch + 64 - (at - from);
      pack_window(p.packs, p.starts, from, to, out);
      sc.scan(out, from, at, end);
    }
  });
}

int64_t delta_pack_base_host(const CopySegment* pack, int64_t pack_count, int64_t staging, uint8_t* base,
                             int64_t nbytes, int64_t threads) {
  LLAMARL_CHECK(nbytes >= 0, "negative bucket size " << nbytes);
  const Packing p = packing_of(pack, pack_count, staging, nbytes);
  const std::vector<int64_t> bounds = part_bounds(nbytes, threads);
  std::vector<uint64_t> sums(bounds.size() - 1, 0);
  run_parts(static_cast<int64_t>(sums.size()), [&](int64_t k) {
    alignas(64) uint8_t scratch[kChunk + 3 * 64];
    uint8_t* out = scratch + 64;  // room for a cast element's byte on either side
    for (int64_t at = bounds[k]; at < bounds[k + 1]; at += kChunk) {
      const int64_t n = std::min(bounds[k + 1], at + kChunk) - at;
      pack_window(p.packs, p.starts, at, at + n, out);
      std::memcpy(reinterpret_cast<uint8_t*>(staging) + at, out, static_cast<size_t>(n));
      std::memcpy(base + at, out, static_cast<size_t>(n));
      sums[k] += checksum_span(out, n, at);
    }
  });
  uint64_t total = 0;
  for (uint64_t sum : sums) total += sum;
  return static_cast<int64_t>(total);
}

namespace {

// The positions (base + bit) of the set bits of x, written from out without a
// branch for up to 4 of them (up to 4 are written past them); returns how many.
// At the densities deltas pay at, most mask words hold no run or one: a loop over
// the bits mispredicts about once a word that holds one, this does not.
__attribute__((always_inline)) inline int64_t bit_positions_scalar(uint64_t x, int32_t base, int32_t* out) {
  constexpr uint64_t kTop = uint64_t{1} << 63;  // bounds the count of zeros once x is empty (the writes past it)
  const int64_t n = __builtin_popcountll(x);
  // Unsigned sums: a filler past the count may pass INT32_MAX in a bucket of nearly 2**31 elements.
  const uint32_t at = static_cast<uint32_t>(base);
  for (int k = 0; k < 4; ++k, x &= x - 1) out[k] = static_cast<int32_t>(at + __builtin_ctzll(x | kTop));
  for (int64_t k = 4; k < n; ++k, x &= x - 1) out[k] = static_cast<int32_t>(at + __builtin_ctzll(x));
  return n;
}

// delta_runs_host with int32 indices, branch-free per mask word: each word's run
// starts and stops (a set bit after a clear one, a clear bit after a set one, the
// bit past the last element included) found with shifts and written by
// `positions` (bit_positions_*: up to 64 past them) into buffers on the stack, 64
// words at a time, then paired into `runs`. Returns the runs found; another count
// than run_count is an error (runs holds part of them: never more than
// run_count, and the count returned once more are found).
template <typename Positions>
__attribute__((always_inline)) inline int64_t runs_body(const uint8_t* mask, int64_t elements, int32_t* runs,
                                                        int64_t run_count, Positions positions) {
  constexpr int64_t kWords = 64, kRoom = 64 * kWords + 64;
  int32_t starts[kRoom + 1], stops[kRoom];  // starts: one more, a run still open from the block before
  int64_t found = 0, ns = 0, ne = 0;
  uint64_t carry = 0;  // the last bit of the word before
  const int64_t words = (elements + 63) / 64;
  for (int64_t block = 0; block < words; block += kWords) {
    const int64_t end = std::min(words, block + kWords);
    for (int64_t w = block; w < end; ++w) {
      const int64_t rest = elements - 64 * w;
      uint64_t x;
      if (rest >= 64)
        std::memcpy(&x, mask + 8 * w, 8);
      else
        x = load_word(mask + 8 * w, (rest + 7) / 8) & ((uint64_t{1} << rest) - 1);
      const uint64_t before = (x << 1) | carry;
      const uint64_t up = x & ~before, down = ~x & before;
      carry = x >> 63;
      ns += positions(up, static_cast<int32_t>(64 * w), starts + ns);
      ne += positions(down, static_cast<int32_t>(64 * w), stops + ne);
    }
    if (end == words && carry) stops[ne++] = static_cast<int32_t>(elements);  // a run to the end of a whole last word
    if (found + ne > run_count) return found + ne;
    for (int64_t r = 0; r < ne; ++r) {
      runs[2 * (found + r)] = starts[r];
      runs[2 * (found + r) + 1] = stops[r] - starts[r];
    }
    found += ne;
    if (ns > ne) starts[0] = starts[ne];  // the run still open
    ns -= ne;
    ne = 0;
  }
  return found;
}

int64_t runs_plain(const uint8_t* mask, int64_t elements, int32_t* runs, int64_t run_count) {
  return runs_body(mask, elements, runs, run_count, bit_positions_scalar);
}

#ifdef LLAMARL_HOST_X86
LLAMARL_TARGET_AVX2 int64_t runs_avx2(const uint8_t* mask, int64_t elements, int32_t* runs, int64_t run_count) {
  return runs_body(mask, elements, runs, run_count, bit_positions_scalar);
}

// bit_positions_scalar with AVX-512's compress, 16 at a time (up to 48 past them).
LLAMARL_TARGET_AVX512 inline int64_t bit_positions_avx512(uint64_t x, int32_t base, int32_t* out) {
  const __m512i iota = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44,
                                       43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24,
                                       23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                       1, 0);
  const int64_t n = __builtin_popcountll(x);
  const __m512i at = _mm512_maskz_compress_epi8(x, iota), offset = _mm512_set1_epi32(base);
  _mm512_storeu_si512(out, _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(at)), offset));
  if (n > 16) {
    _mm512_storeu_si512(out + 16, _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(at, 1)), offset));
    _mm512_storeu_si512(out + 32, _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(at, 2)), offset));
    _mm512_storeu_si512(out + 48, _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(at, 3)), offset));
  }
  return n;
}

LLAMARL_TARGET_AVX512 int64_t runs_avx512(const uint8_t* mask, int64_t elements, int32_t* runs, int64_t run_count) {
  return runs_body(mask, elements, runs, run_count, bit_positions_avx512);
}
#endif

// The int32 runs at the host's vector level.
int64_t runs_int32(const uint8_t* mask, int64_t elements, int32_t* runs, int64_t run_count) {
#ifdef LLAMARL_HOST_X86
  switch (host_simd()) {
    case kSimdAvx512:
      return runs_avx512(mask, elements, runs, run_count);
    case kSimdAvx2:
      return runs_avx2(mask, elements, runs, run_count);
    default:
      break;
  }
#endif
  return runs_plain(mask, elements, runs, run_count);
}

}  // namespace

void delta_runs_host(const uint8_t* mask, int64_t elements, uint8_t* runs, int64_t run_count, int64_t index_size) {
  LLAMARL_CHECK(index_size == 4 || index_size == 8, "index size " << index_size << " (4 or 8)");
  LLAMARL_CHECK(elements >= 0 && run_count >= 0, "negative element or run count");
  LLAMARL_CHECK(index_size == 8 || elements <= INT32_MAX, "int32 runs for a bucket of " << elements << " elements");
  if (index_size == 4) {
    const int64_t found = runs_int32(mask, elements, reinterpret_cast<int32_t*>(runs), run_count);
    LLAMARL_CHECK(found == run_count, "found " << found << " runs, the scan counted " << run_count);
    return;
  }
  int64_t run = 0;  // int64 runs (a bucket of 2**31 elements or more)
  for_each_mask_run(mask, elements, [&](int64_t first, int64_t count) {
    LLAMARL_CHECK(run < run_count, "more than the " << run_count << " runs the scan counted");
    const int64_t pair[2] = {first, count};
    std::memcpy(runs + run * 16, pair, 16);
    run += 1;
  });
  LLAMARL_CHECK(run == run_count, "found " << run << " runs, the scan counted " << run_count);
}

}  // namespace llamarl
