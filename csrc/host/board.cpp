#include "board.h"

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <thread>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "../common.h"

namespace llamarl {
namespace {

int64_t* word(int64_t address) {
  LLAMARL_CHECK(address != 0 && address % 8 == 0, "board word address " << address << " is not 8-byte aligned");
  return reinterpret_cast<int64_t*>(address);
}

uint32_t* counter(int64_t address) {
  LLAMARL_CHECK(address != 0 && address % 8 == 0, "board counter address " << address << " is not 8-byte aligned");
  return reinterpret_cast<uint32_t*>(address);
}

}  // namespace

int64_t board_load(int64_t address) { return __atomic_load_n(word(address), __ATOMIC_ACQUIRE); }

void board_store(int64_t address, int64_t value) { __atomic_store_n(word(address), value, __ATOMIC_RELEASE); }

int64_t board_add(int64_t address, int64_t delta) {
  return __atomic_add_fetch(word(address), delta, __ATOMIC_ACQ_REL);
}

uint32_t board_events(int64_t address) { return __atomic_load_n(counter(address), __ATOMIC_ACQUIRE); }

void board_notify(int64_t address) {
  uint32_t* events = counter(address);
  __atomic_add_fetch(events, 1u, __ATOMIC_ACQ_REL);
#ifdef __linux__
  // Not FUTEX_PRIVATE: the waiters are other processes mapping the same pages.
  syscall(SYS_futex, events, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#endif
}

uint32_t board_wait(int64_t address, uint32_t seen, double timeout_s) {
  uint32_t* events = counter(address);
  // At most a day (NaN, infinite or negative: none), so that the deadline cannot overflow.
  const double seconds = timeout_s > 0 ? (timeout_s < 86400.0 ? timeout_s : 86400.0) : 0.0;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
  while (true) {
    const uint32_t now_seen = __atomic_load_n(events, __ATOMIC_ACQUIRE);
    const auto left = deadline - std::chrono::steady_clock::now();
    if (now_seen != seen || left <= std::chrono::steady_clock::duration::zero()) return now_seen;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
#ifdef __linux__
    struct timespec wait {};
    wait.tv_sec = static_cast<time_t>(ns / 1000000000);
    wait.tv_nsec = static_cast<long>(ns % 1000000000);
    // Returns at once (EAGAIN) if the counter moved since the load above: no wake-up is lost.
    const long rc = syscall(SYS_futex, events, FUTEX_WAIT, seen, &wait, nullptr, 0);
    LLAMARL_CHECK(rc == 0 || errno == EAGAIN || errno == EINTR || errno == ETIMEDOUT,
                  "futex wait on the board failed: " << std::strerror(errno));
#else
    std::this_thread::sleep_for(std::chrono::nanoseconds(ns < 50000 ? ns : 50000));
#endif
  }
}

}  // namespace llamarl
