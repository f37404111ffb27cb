// The copy-segment format shared by the host and CUDA engines.
//
// A segment is a 2-D strided rectangle: `height` rows of `width` elements, each
// row starting `src_pitch` / `dst_pitch` bytes after the previous one. Addresses
// are absolute (the Python planner resolves tensor base + offset once per
// registration). The host engine and the CUDA copy kernel use the same
// element conversion below, so the host tests exercise the device arithmetic.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
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

// A piece of a segment list as the CUDA copy kernel runs it: at most about
// `piece_bytes` of destination, whole rows where rows fit (rows merged into one
// where both sides are contiguous), and `vec` the widest access every address,
// pitch and width of the piece is aligned to: bytes per access for copies (16, 8,
// 4, 2 or 1), elements per access for casts (4, 2 or 1). width keeps the segment's
// unit (bytes for copies, elements for casts); width / vec * height < 2**31.
struct CopyPiece {
  CopySegment seg;
  int64_t vec;
};
static_assert(sizeof(CopyPiece) == 8 * sizeof(int64_t), "CopyPiece must be 8 packed int64");

// Destination bytes per piece for a table writing `total_bytes`: 64 KiB, so that the
// last piece a block copies (the tail of a persistent grid) is a few percent of a
// 1 GiB copy at most; past 4 GiB the next multiple of 64 KiB that keeps the pieces
// of its long rows under 65536 (4 MiB of table; every segment and every row shorter
// than a piece is a piece or more of its own besides). A multiple of 64 KiB, not just of 16 bytes: pieces of a
// contiguous run then start on 128-byte lines, and a warp's 512 bytes of 16-byte
// accesses touch 4 lines, not 5 (on an H100 an 8.2 GiB plan in pieces of 134,xxx
// bytes ran at 0.75x of cudaMemcpy, a flat 8 GiB copy in 128 KiB pieces at 0.95x).
inline int64_t piece_bytes_for(int64_t total_bytes) {
  constexpr int64_t kGrain = 64 << 10, kMaxPieces = 65536;
  const int64_t bytes = (total_bytes + kMaxPieces - 1) / kMaxPieces;
  return bytes <= kGrain ? kGrain : (bytes + kGrain - 1) / kGrain * kGrain;
}

// The largest power of two <= `limit` dividing every value (1 when none is larger).
inline int64_t common_alignment(std::initializer_list<int64_t> values, int64_t limit) {
  int64_t align = limit;
  for (int64_t v : values)
    while (align > 1 && v % align != 0) align >>= 1;
  return align;
}

// Split a validated segment list into pieces of about `piece_bytes` destination
// bytes (see CopyPiece), covering exactly the bytes the segments write.
inline std::vector<CopyPiece> split_into_pieces(const CopySegment* segs, int64_t count, int64_t piece_bytes) {
  LLAMARL_CHECK(piece_bytes >= 16 && piece_bytes <= (int64_t{1} << 30),
                "piece_bytes must be in [16, 2**30], got " << piece_bytes);
  validate_segments(segs, count);
  std::vector<CopyPiece> pieces;
  for (int64_t i = 0; i < count; ++i) {
    CopySegment seg = segs[i];
    if (seg.width == 0 || seg.height == 0) continue;
    const bool cast = seg.kind == kFloat32ToBF16;
    const int64_t in_bytes = src_elem_bytes(seg.kind), out_bytes = dst_elem_bytes(seg.kind);
    if (seg.height > 1 && seg.src_pitch == seg.width * in_bytes && seg.dst_pitch == seg.width * out_bytes) {
      seg.width *= seg.height;  // both sides contiguous: one long row
      seg.height = 1;
    }
    // Accesses of `vec` units: up to 16-byte loads for copies, 4 fp32 in / 4 bf16 out for casts.
    const int64_t src_pitch = seg.height > 1 ? seg.src_pitch : 0, dst_pitch = seg.height > 1 ? seg.dst_pitch : 0;
    int64_t vec = 1;
    if (cast) {
      LLAMARL_CHECK(seg.src % 4 == 0 && seg.dst % 2 == 0 && src_pitch % 4 == 0 && dst_pitch % 2 == 0,
                    "segment " << i << ": an fp32 -> bf16 segment on a GPU needs 4-byte aligned fp32 rows and "
                               "2-byte aligned bf16 rows (src " << seg.src << ", pitch " << seg.src_pitch << "; dst "
                               << seg.dst << ", pitch " << seg.dst_pitch << ")");
      vec = common_alignment({seg.src / 4, seg.dst / 2, seg.width, src_pitch / 4, dst_pitch / 2}, 4);
    } else {
      vec = common_alignment({seg.src, seg.dst, seg.width, src_pitch, dst_pitch}, 16);
    }
    const int64_t unit_out_bytes = vec * out_bytes;  // destination bytes of one access
    const int64_t units_per_row = seg.width / vec;
    const int64_t row_bytes = seg.width * out_bytes;
    if (row_bytes <= piece_bytes) {
      // Whole rows per piece.
      const int64_t rows_per_piece = piece_bytes / row_bytes;
      for (int64_t row = 0; row < seg.height; row += rows_per_piece) {
        const int64_t rows = seg.height - row < rows_per_piece ? seg.height - row : rows_per_piece;
        pieces.push_back({{seg.src + row * seg.src_pitch, seg.src_pitch, seg.dst + row * seg.dst_pitch,
                           seg.dst_pitch, seg.width, rows, seg.kind}, vec});
      }
      continue;
    }
    // Rows longer than a piece: each row cut into pieces of whole accesses.
    const int64_t units_per_piece = piece_bytes / unit_out_bytes > 0 ? piece_bytes / unit_out_bytes : 1;
    for (int64_t row = 0; row < seg.height; ++row) {
      for (int64_t unit = 0; unit < units_per_row; unit += units_per_piece) {
        const int64_t units = units_per_row - unit < units_per_piece ? units_per_row - unit : units_per_piece;
        pieces.push_back({{seg.src + row * seg.src_pitch + unit * vec * in_bytes, seg.src_pitch,
                           seg.dst + row * seg.dst_pitch + unit * vec * out_bytes, seg.dst_pitch, units * vec, 1,
                           seg.kind}, vec});
      }
    }
  }
  return pieces;
}

}  // namespace llamarl
