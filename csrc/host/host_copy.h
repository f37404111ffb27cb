// Host copy engine: executes a segment list with memcpy threads.
#pragma once

#include <cstdint>

#include "../copy_segments.h"

namespace llamarl {

// Validates every segment first, then runs them split over `num_threads` threads
// (about equal destination bytes each). Returns the bytes written.
int64_t execute_segments_host(const CopySegment* segs, int64_t count, int64_t num_threads);

// Runs one segment (validated by the caller) on this thread.
void copy_segment_host(const CopySegment& seg);

}  // namespace llamarl
