#include "checksum.h"

#include <cstring>

#include "../common.h"
#include "simd.h"

namespace llamarl {
namespace {

// The sum of checksum_term over `words` whole words from `bytes`, the first word
// index `first`: one body, compiled for each vector level (the compiler vectorises
// it: 64-bit multiplies are native with AVX-512 DQ, about 4x the plain loop here).
__attribute__((always_inline)) inline uint64_t sum_words_body(const unsigned char* bytes, int64_t words,
                                                              uint64_t first) {
  uint64_t total = 0;
  for (int64_t k = 0; k < words; ++k) {
    uint64_t value;
    std::memcpy(&value, bytes + 8 * k, 8);
    total += checksum_term(first + static_cast<uint64_t>(k), value);
  }
  return total;
}

uint64_t sum_words_plain(const unsigned char* bytes, int64_t words, uint64_t first) {
  return sum_words_body(bytes, words, first);
}

#ifdef LLAMARL_HOST_X86
LLAMARL_TARGET_AVX2 uint64_t sum_words_avx2(const unsigned char* bytes, int64_t words, uint64_t first) {
  return sum_words_body(bytes, words, first);
}

LLAMARL_TARGET_AVX512 uint64_t sum_words_avx512(const unsigned char* bytes, int64_t words, uint64_t first) {
  return sum_words_body(bytes, words, first);
}
#endif

uint64_t sum_words(const unsigned char* bytes, int64_t words, uint64_t first) {
#ifdef LLAMARL_HOST_X86
  switch (host_simd()) {
    case kSimdAvx512:
      return sum_words_avx512(bytes, words, first);
    case kSimdAvx2:
      return sum_words_avx2(bytes, words, first);
    default:
      break;
  }
#endif
  return sum_words_plain(bytes, words, first);
}

// The running sum over a stream of bytes at increasing positions; a word is mixed
// once all its bytes that the stream holds have come.
class WordSum {
 public:
  void add(uint64_t position, const unsigned char* bytes, int64_t n) {
    while (n > 0) {
      const uint64_t word = position >> 3;
      const int offset = static_cast<int>(position & 7);
      if (offset == 0 && n >= 8) {  // whole words straight from memory
        flush();
        const int64_t words = n >> 3;
        total_ += sum_words(bytes, words, word);
        position += 8 * words;
        bytes += 8 * words;
        n -= 8 * words;
        continue;
      }
      if (!pending_ || pending_word_ != word) {
        flush();
        pending_ = true;
        pending_word_ = word;
      }
      const int64_t take = n < 8 - offset ? n : 8 - offset;
      for (int64_t j = 0; j < take; ++j) pending_value_ |= static_cast<uint64_t>(bytes[j]) << (8 * (offset + j));
      position += take;
      bytes += take;
      n -= take;
    }
  }

  uint64_t finish() {
    flush();
    return total_;
  }

 private:
  void flush() {
    if (pending_) total_ += checksum_term(pending_word_, pending_value_);
    pending_ = false;
    pending_value_ = 0;
  }

  uint64_t total_ = 0;
  bool pending_ = false;
  uint64_t pending_word_ = 0;
  uint64_t pending_value_ = 0;
};

}  // namespace

uint64_t checksum_span(const unsigned char* bytes, int64_t n, int64_t position) {
  LLAMARL_CHECK(n >= 0 && position >= 0 && position % 8 == 0,
                "a checksum span of " << n << " bytes at position " << position << " (a word's first byte)");
  WordSum sum;
  sum.add(static_cast<uint64_t>(position), bytes, n);
  return sum.finish();
}

int64_t checksum_rows_host(const int64_t* rows, int64_t count) {
  WordSum sum;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* row = rows + 5 * i;
    const int64_t pitch = row[1], row_bytes = row[2], height = row[3];
    LLAMARL_CHECK(pitch >= 0 && row_bytes >= 0 && height >= 0 && row[4] >= 0,
                  "checksum row " << i << ": negative pitch, size or position");
    LLAMARL_CHECK(row[0] != 0 || row_bytes == 0 || height == 0, "checksum row " << i << ": null address");
    auto* base = reinterpret_cast<const unsigned char*>(row[0]);
    uint64_t position = static_cast<uint64_t>(row[4]);
    for (int64_t r = 0; r < height; ++r, position += row_bytes) sum.add(position, base + r * pitch, row_bytes);
  }
  return static_cast<int64_t>(sum.finish());
}

}  // namespace llamarl
