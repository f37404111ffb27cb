#include "simd.h"

#include <atomic>

namespace llamarl {
namespace {

HostSimd detected() {
#ifdef LLAMARL_HOST_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("bmi2"))
    return kSimdAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2")) return kSimdAvx2;
#endif
  return kSimdNone;
}

std::atomic<int> cap_{kSimdAvx512};

}  // namespace

HostSimd host_simd() {
  static const HostSimd best = detected();
  const int cap = cap_.load(std::memory_order_relaxed);
  return static_cast<HostSimd>(cap < best ? cap : best);
}

int set_host_simd(int cap) { return cap_.exchange(cap); }

}  // namespace llamarl
