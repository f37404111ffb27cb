#include "checksum.h"

#include <cstring>

#include "../common.h"
#include "simd.h"

#ifdef LLAMARL_HOST_X86
#include <immintrin.h>
#endif

namespace llamarl {
namespace {

// The sum of checksum_term over `words` whole words from `bytes`, the first word
// index `first`, in plain code (the key advances by addition).
uint64_t sum_words_plain(const unsigned char* bytes, int64_t words, uint64_t first) {
  uint64_t total = 0, key = first * kChecksumKey;
  for (int64_t k = 0; k < words; ++k, key += kChecksumKey) {
    uint64_t value;
    std::memcpy(&value, bytes + 8 * k, 8);
    total += checksum_keyed_term(key, value);
  }
  return total;
}

#ifdef LLAMARL_HOST_X86
// The same with AVX2, 8 words a round in two lanes of 4 (also where the CPU has
// AVX-512: the sum runs at memory speed at this width). The compiler's own
// vectorisation of the plain loop multiplies all 64 bits (three vpmuludq a word);
// the halves' product is one.
LLAMARL_TARGET_AVX2 uint64_t sum_words_avx2(const unsigned char* bytes, int64_t words, uint64_t first) {
  const uint64_t k = kChecksumKey;
  __m256i key0 = _mm256_set_epi64x(static_cast<long long>((first + 3) * k), static_cast<long long>((first + 2) * k),
                                   static_cast<long long>((first + 1) * k), static_cast<long long>(first * k));
  __m256i key1 = _mm256_add_epi64(key0, _mm256_set1_epi64x(static_cast<long long>(4 * k)));
  const __m256i step = _mm256_set1_epi64x(static_cast<long long>(8 * k));
  __m256i sum0 = _mm256_setzero_si256(), sum1 = _mm256_setzero_si256();
  int64_t w = 0;
  for (; w + 8 <= words; w += 8) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 8 * w));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 8 * w + 32));
    const __m256i m0 = _mm256_xor_si256(v0, key0), m1 = _mm256_xor_si256(v1, key1);
    // mul_epu32 multiplies each lane's low halves: the masked value's low half by its high half.
    sum0 = _mm256_add_epi64(sum0, _mm256_add_epi64(_mm256_mul_epu32(m0, _mm256_srli_epi64(m0, 32)),
                                                   _mm256_shuffle_epi32(v0, 0xB1)));
    sum1 = _mm256_add_epi64(sum1, _mm256_add_epi64(_mm256_mul_epu32(m1, _mm256_srli_epi64(m1, 32)),
                                                   _mm256_shuffle_epi32(v1, 0xB1)));
    key0 = _mm256_add_epi64(key0, step);
    key1 = _mm256_add_epi64(key1, step);
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(sum0, sum1));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_words_plain(bytes + 8 * w, words - w, first + w);
}
#endif

uint64_t sum_words(const unsigned char* bytes, int64_t words, uint64_t first) {
#ifdef LLAMARL_HOST_X86
  switch (host_simd()) {
    case kSimdAvx512:
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
