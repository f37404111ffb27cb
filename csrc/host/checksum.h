// Position-mixed checksum of byte rows: the base check of delta weight sync
// (llamarl_core/sync/delta.py computes the same sum with torch on a GPU).
#pragma once

#include <cstdint>

namespace llamarl {

// One 8-byte word's term: a 64-bit mix of its index and value (splitmix64's
// finaliser, logical shifts), so that no small pattern of changes cancels out in
// the sum, as it can in a linear one. Word w holds the bytes at positions 8w ..
// 8w + 7, little-endian; positions past the data read as zero bytes.
inline uint64_t checksum_term(uint64_t word_index, uint64_t value) {
  uint64_t v = word_index * 0x9E3779B97F4A7C15ull + (value + 1) * 0xC2B2AE3D27D4EB4Full;
  v ^= v >> 30;
  v *= 0xBF58476D1CE4E5B9ull;
  v ^= v >> 27;
  v *= 0x94D049BB133111EBull;
  v ^= v >> 31;
  return v;
}

// rows: `count` rows of 5 int64 [address, pitch, row_bytes, height, first_position]:
// `height` rows of `row_bytes` bytes, `pitch` bytes apart, whose bytes sit at
// positions first_position, first_position + 1, ... (row after row). Returns the
// sum modulo 2**64 of checksum_term over every word the bytes touch, as a signed
// int64. A word's bytes may come from several rows, given in position order (a
// word's partial bytes are completed from the rows that follow before it is
// mixed). Reads only; the caller keeps every row inside its memory (delta.py
// checks each against its tensor), this checks only non-negative sizes and a
// non-null address.
int64_t checksum_rows_host(const int64_t* rows, int64_t count);

// The sum modulo 2**64 of checksum_term over the words of `n` bytes whose first sits
// at `position` (a multiple of 8), the last word padded with zero bytes: a part of
// checksum_rows_host's sum over a stream those bytes belong to.
uint64_t checksum_span(const unsigned char* bytes, int64_t n, int64_t position);

}  // namespace llamarl
