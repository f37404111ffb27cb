// Position-mixed checksum of byte rows: the base check of delta weight sync
// (llamarl_core/sync/delta.py computes the same sum with torch on a GPU).
#pragma once

#include <cstdint>

namespace llamarl {

// One 8-byte word's term: the product of the two 32-bit halves of the value
// masked by a key of its index (index * K, a Weyl sequence), plus the value with
// its halves swapped. The product is what keeps a pattern of changes from
// cancelling out in the sum (as, in a linear sum, two flips of the same bit in two
// words would); the swapped value keeps a change seen where the product cannot
// (one half masked to zero). One 32 x 32 -> 64-bit multiply a word (AVX2's
// vpmuludq) besides the key's: the receiver's checksum of what it holds runs at
// memory speed. Word w holds the bytes at positions 8w .. 8w + 7, little-endian;
// positions past the data read as zero bytes.
constexpr uint64_t kChecksumKey = 0x9E3779B97F4A7C15ull;

// The term of `value` at the word whose key (word index * kChecksumKey) is `key`.
inline uint64_t checksum_keyed_term(uint64_t key, uint64_t value) {
  const uint64_t masked = value ^ key;
  return (masked & 0xFFFFFFFFull) * (masked >> 32) + ((value << 32) | (value >> 32));
}

inline uint64_t checksum_term(uint64_t word_index, uint64_t value) {
  return checksum_keyed_term(word_index * kChecksumKey, value);
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
