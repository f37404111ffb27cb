// The vector instructions the host's byte loops use (checksum, delta codec, the copy
// engine's fp32 -> bf16 cast), chosen at run time: the module is built for any
// x86-64 CPU, and a loop compiled for AVX-512 or AVX2 runs only where the CPU has
// it. Every level computes the same bytes; set_host_simd caps the level so that
// one machine tests each.
#pragma once

namespace llamarl {

// kAvx512: F, BW, DQ, VL and VBMI2 (Ice Lake, Sapphire Rapids, Zen 4 and later).
enum HostSimd : int { kSimdNone = 0, kSimdAvx2 = 1, kSimdAvx512 = 2 };

// The level in use: the CPU's best, capped by set_host_simd.
HostSimd host_simd();

// Caps the level at `cap` (a HostSimd; the CPU's best still bounds it) and returns
// the cap before. Meant for tests, between calls: a call running meanwhile may
// mix levels, which give the same bytes.
int set_host_simd(int cap);

}  // namespace llamarl

#if defined(__x86_64__) && defined(__GNUC__)
#define LLAMARL_HOST_X86 1
#define LLAMARL_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi2,bmi,bmi2,popcnt")))
#define LLAMARL_TARGET_AVX2 __attribute__((target("avx2,bmi,bmi2,popcnt")))
#endif
