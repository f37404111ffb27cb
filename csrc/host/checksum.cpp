#include "checksum.h"

#include "../common.h"

namespace llamarl {

int64_t checksum_rows_host(const int64_t* rows, int64_t count) {
  uint64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* row = rows + 5 * i;
    const int64_t pitch = row[1], row_bytes = row[2], height = row[3];
    LLAMARL_CHECK(pitch >= 0 && row_bytes >= 0 && height >= 0 && row[4] >= 0,
                  "checksum row " << i << ": negative pitch, size or position");
    LLAMARL_CHECK(row[0] != 0 || row_bytes == 0 || height == 0, "checksum row " << i << ": null address");
    auto* base = reinterpret_cast<const unsigned char*>(row[0]);
    uint64_t position = static_cast<uint64_t>(row[4]);
    for (int64_t r = 0; r < height; ++r) {
      const unsigned char* bytes = base + r * pitch;
      for (int64_t b = 0; b < row_bytes; ++b) total += checksum_term(position++, bytes[b]);
    }
  }
  return static_cast<int64_t>(total);
}

}  // namespace llamarl
