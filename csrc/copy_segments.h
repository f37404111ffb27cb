// The copy-segment format shared by the host and CUDA engines.
//
// A segment is a 2-D strided rectangle: `height` rows of `width` elements, each
// row starting `src_pitch` / `dst_pitch` bytes after the previous one. Addresses
// are absolute (the Python planner resolves tensor base + offset once per
// registration). The host engine and the CUDA cast kernel use the same
// element conversion below, so the host tests exercise the device arithmetic.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

#if defined(__CUDACC__)
#define LLAMARL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LLAMARL_HOST_DEVICE inline
#endif

namespace llamarl {

enum SegmentKind : int64_t {
  kCopyBytes = 0,     // width counts bytes, copied verbatim
  kFloat32ToBF16 = 1, // width counts elements: fp32 in, bf16 out
};

// Layout matches a numpy int64 array of shape (n, 7), column for column.
struct CopySegment {
  int64_t src;
  int64_t src_pitch;
  int64_t dst;
  int64_t dst_pitch;
  int64_t width;
  int64_t height;
  int64_t kind;
};
static_assert(sizeof(CopySegment) == 7 * sizeof(int64_t), "CopySegment must be 7 packed int64");

LLAMARL_HOST_DEVICE int64_t src_elem_bytes(int64_t kind) { return kind == kFloat32ToBF16 ? 4 : 1; }
LLAMARL_HOST_DEVICE int64_t dst_elem_bytes(int64_t kind) { return kind == kFloat32ToBF16 ? 2 : 1; }

// fp32 -> bf16 rounding to nearest, ties to even: bit for bit what torch's
// `.to(torch.bfloat16)` gives for every non-NaN value (overflow to inf follows
// from the integer rounding). NaN becomes the quiet NaN 0x7FC0; torch itself
// gives 0x7FC0 or 0xFFFF depending on its kernel path, so only NaN-ness is kept.
LLAMARL_HOST_DEVICE uint16_t float_to_bf16_rne(uint32_t bits) {
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) return 0x7FC0;
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

inline void validate_segment(const CopySegment& seg, int64_t index) {
  LLAMARL_CHECK(seg.kind == kCopyBytes || seg.kind == kFloat32ToBF16,
                "segment " << index << ": unknown kind " << seg.kind);
  LLAMARL_CHECK(seg.width >= 0 && seg.height >= 0,
                "segment " << index << ": negative width " << seg.width << " or height " << seg.height);
  if (seg.width == 0 || seg.height == 0) return;
  LLAMARL_CHECK(seg.src != 0 && seg.dst != 0, "segment " << index << ": null address");
  LLAMARL_CHECK(seg.height == 1 || (seg.src_pitch >= seg.width * src_elem_bytes(seg.kind) &&
                                    seg.dst_pitch >= seg.width * dst_elem_bytes(seg.kind)),
                "segment " << index << ": pitch smaller than a row (src_pitch " << seg.src_pitch
                           << ", dst_pitch " << seg.dst_pitch << ", width " << seg.width << ")");
}

// Bytes a segment writes: the figure every bandwidth number is computed from.
inline int64_t segment_dst_bytes(const CopySegment& seg) {
  return seg.width * seg.height * dst_elem_bytes(seg.kind);
}

// Validate a whole list before any of it runs; returns the bytes it writes.
inline int64_t validate_segments(const CopySegment* segs, int64_t count) {
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    validate_segment(segs[i], i);
    total += segment_dst_bytes(segs[i]);
  }
  return total;
}

// Split a segment list into about `num_parts` pieces of equal destination bytes,
// cutting segments between rows and, for a single long row, inside the row (on an
// element boundary). Each piece is itself a valid segment, so threads (host) or
// streams (CUDA) can run them independently.
inline std::vector<std::vector<CopySegment>> split_segments(const CopySegment* segs, int64_t count,
                                                            int64_t num_parts) {
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += segment_dst_bytes(segs[i]);
  num_parts = num_parts < 1 ? 1 : num_parts;
  const int64_t target = (total + num_parts - 1) / num_parts;
  std::vector<std::vector<CopySegment>> parts(1);
  int64_t room = target;
  for (int64_t i = 0; i < count; ++i) {
    CopySegment seg = segs[i];
    const int64_t out_elem = dst_elem_bytes(seg.kind);
    while (seg.width > 0 && seg.height > 0) {
      if (room <= 0 && static_cast<int64_t>(parts.size()) < num_parts) {
        parts.emplace_back();
        room = target;
      }
      const int64_t row_bytes = seg.width * out_elem;
      CopySegment piece = seg;
      if (seg.height > 1) {
        int64_t rows = room > 0 ? (room + row_bytes - 1) / row_bytes : seg.height;
        if (rows > seg.height) rows = seg.height;
        piece.height = rows;
        seg.src += rows * seg.src_pitch;
        seg.dst += rows * seg.dst_pitch;
        seg.height -= rows;
      } else {
        int64_t elems = room > 0 ? (room + out_elem - 1) / out_elem : seg.width;
        if (elems > seg.width) elems = seg.width;
        piece.width = elems;
        seg.src += elems * src_elem_bytes(seg.kind);
        seg.dst += elems * out_elem;
        seg.width -= elems;
      }
      room -= segment_dst_bytes(piece);
      parts.back().push_back(piece);
    }
  }
  return parts;
}

}  // namespace llamarl
