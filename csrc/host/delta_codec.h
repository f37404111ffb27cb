// The host side of delta weight sync's codec (llamarl_core/sync/delta.py holds
// the format and a torch version of each call for GPU tensors): the sender's scan
// of a bucket against its base, which also copies out the changed elements, the
// runs of a scan's bitmask, the receiver's apply through the bucket's segments.
// Pointers and sizes only; AVX-512 where the CPU has it, AVX2 for the scan where it
// has that (simd.h); the scans split over threads.
#pragma once

#include <cstdint>

#include "../copy_segments.h"

namespace llamarl {

// A bucket's bytes are stretches of elements of one size, back to back from byte
// 0: rows of 4 int64 [first byte, end byte, itemsize (1, 2, 4 or 8), first element].
struct DeltaScan {
  int64_t changed;       // elements with any byte differing
  int64_t runs;          // runs of consecutive changed elements
  int64_t value_bytes;   // the changed elements' bytes
  int64_t checksum_change;  // checksum_rows_host(fresh) - checksum_rows_host(base), mod 2**64
};

// Compares `fresh` with `base` (`nbytes` each) and sets, in `mask` (zeroed by the
// caller, one bit per element, little-endian within each byte), the bit of every
// element that differs; unless `values` is null, writes those elements' bytes
// there, in order (room for `nbytes` + 64 x threads: every element may differ,
// AVX-512 stores a block's changed elements 64 bytes at a time, and each thread
// writes its own from where its bytes begin). Up to `threads` threads, each over
// whole 64 KiB blocks, at least 4 MiB. With
// `update_base`, copies each differing word (64-byte block, with AVX-512 or AVX2) of fresh
// into base (base then equals fresh). Reads equal 64-byte blocks once each.
DeltaScan delta_scan_host(const uint8_t* fresh, uint8_t* base, int64_t nbytes, const int64_t* stretches,
                          int64_t stretch_count, uint8_t* mask, bool update_base, uint8_t* values, int64_t threads);

// delta_scan_host of the bytes the pack segments `pack` (copy_segments.h; their
// destination rows back to back from address `staging`, in order, `nbytes` in
// all) would write, read through them instead: 4 KiB at a time packed into a
// scratch buffer and scanned, `staging` never written (a bucket scanned straight
// from the sender's tensors). Checks the segments first.
DeltaScan delta_scan_packing_host(const CopySegment* pack, int64_t pack_count, int64_t staging, uint8_t* base,
                                  int64_t nbytes, const int64_t* stretches, int64_t stretch_count, uint8_t* mask,
                                  bool update_base, uint8_t* values, int64_t threads);

// Packs the bucket as the pack segments `pack` (delta_scan_packing_host's) write it,
// into `staging` and into `base` at once (a bucket sent whole unscanned: the
// sender's base takes its bytes), reading the sender's tensors once, on up to
// `threads` threads; returns the bytes' checksum (checksum.h). Checks the
// segments first.
int64_t delta_pack_base_host(const CopySegment* pack, int64_t pack_count, int64_t staging, uint8_t* base,
                             int64_t nbytes, int64_t threads);

// Writes each run of the elements `mask` marks (its first `elements` bits) into
// `runs` as (first element, count), `index_size` (4 or 8) bytes each; checks that
// exactly `run_count` (a scan's figure) came out.
void delta_runs_host(const uint8_t* mask, int64_t elements, uint8_t* runs, int64_t run_count, int64_t index_size);

// Destination segments, in the bucket's order: rows of 5 int64 [address, pitch,
// width (elements), height, itemsize]; segment k holds the width * height elements
// that follow segment k - 1's.
//
// Writes a delta into the segments: `encoding` 1 (MASK: `index` is the bitmask of
// `index_bytes` bytes) or 2 (RUNS: `index` is `index_bytes / (2 * index_size)`
// (first, count) pairs), `values` the changed elements' bytes. Checks the whole
// delta before writing a byte: runs increasing, apart, non-empty and within the
// elements, `changed` elements and `value_bytes` bytes in all; throws Error
// naming what does not hold. Returns the bytes written.
int64_t delta_apply_host(int64_t encoding, const uint8_t* index, int64_t index_bytes, int64_t index_size,
                         const uint8_t* values, int64_t value_bytes, int64_t changed, const int64_t* segments,
                         int64_t segment_count);

}  // namespace llamarl
