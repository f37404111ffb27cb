// Words in memory that several processes of one host map (a SharedMemoryRegion):
// atomic loads and stores of 64-bit words, and a 32-bit event counter that a
// process bumps after its stores and others sleep on (a futex) until it moves.
// The sync's ticket board (llamarl_core/sync/board.py) is built from these; this
// file knows nothing of it. Addresses come from Python: 8-byte aligned words
// inside a mapping the caller keeps open for the call.
//
// Ordering: board_store is a release store and board_load an acquire load; a
// board_notify orders every store this thread made before it (a release
// fetch_add), so a waiter that sees the counter move and then loads sees them.
#pragma once

#include <cstdint>

namespace llamarl {

int64_t board_load(int64_t address);
void board_store(int64_t address, int64_t value);
// Adds `delta` to the word, returns the new value.
int64_t board_add(int64_t address, int64_t delta);
// The 32-bit event counter at `address` (acquire).
uint32_t board_events(int64_t address);
// Bumps the 32-bit event counter at `address` and wakes every process sleeping on it.
void board_notify(int64_t address);
// Sleeps until the event counter at `address` differs from `seen`, or `timeout_s`
// has passed (<= 0 or NaN: does not sleep; at most a day); returns the counter. Spurious wake-ups
// (signals) go back to sleep for what is left.
uint32_t board_wait(int64_t address, uint32_t seen, double timeout_s);

}  // namespace llamarl
