#include "copy_kernel.cuh"

namespace llamarl {
namespace {

// Independent accesses each thread issues before its first store: with 256
// threads of 16-byte accesses, 16 KiB per block in flight, and 8 blocks per
// multiprocessor keep about 128 KiB in flight there, several times the ~25 KiB
// that HBM3's latency (~1 us) at ~3 TB/s over 132 multiprocessors asks for.
constexpr int kUnroll = 4;

// The native type of an access of N bytes: the kernel's loads and stores are then
// single 16-, 8-, 4-, 2- or 1-byte instructions (LDG.E.128 for 16).
template <int N>
struct Access;
template <>
struct Access<16> { using type = uint4; };
template <>
struct Access<8> { using type = uint2; };
template <>
struct Access<4> { using type = uint32_t; };
template <>
struct Access<2> { using type = uint16_t; };
template <>
struct Access<1> { using type = uint8_t; };

// Runs one piece in accesses of In (read) and Out (written): access i of the piece
// is row i / per_row, column i % per_row; one-row pieces skip the division. Each
// thread issues kUnroll independent loads before its first store. Loads go
// through the read-only path (__ldg: LDG.E.128.CONSTANT for 16 bytes): a piece's
// source is never written while the kernel runs (sources and destinations of one
// table never overlap: the planner writes each destination byte once, from
// tensors of the other side); stores are global stores cached in L2 (__stcg).
// `convert` maps one loaded access to the one stored.
template <typename In, typename Out, typename Convert>
__device__ __forceinline__ void run_piece(const CopySegment& p, int64_t per_row_units, Convert convert) {
  const int32_t per_row = static_cast<int32_t>(per_row_units);
  const int32_t total = per_row * static_cast<int32_t>(p.height);
  const auto* src = reinterpret_cast<const unsigned char*>(p.src);
  auto* dst = reinterpret_cast<unsigned char*>(p.dst);
  const bool one_row = p.height == 1;
  for (int32_t base = threadIdx.x; base < total; base += kCopyThreads * kUnroll) {
    In v[kUnroll];
    int64_t dst_at[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t i = base + u * kCopyThreads;
      if (i < total) {
        const int32_t row = one_row ? 0 : i / per_row;
        const int32_t col = i - row * per_row;
        v[u] = __ldg(reinterpret_cast<const In*>(src + row * p.src_pitch + static_cast<int64_t>(col) * sizeof(In)));
        dst_at[u] = row * p.dst_pitch + static_cast<int64_t>(col) * sizeof(Out);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * kCopyThreads < total) __stcg(reinterpret_cast<Out*>(dst + dst_at[u]), convert(v[u]));
  }
}

// Copies one piece in accesses of T (sizeof(T) bytes each).
template <typename T>
__device__ __forceinline__ void copy_piece(const CopySegment& p) {
  run_piece<T, T>(p, p.width / static_cast<int64_t>(sizeof(T)), [](const T& v) { return v; });
}

// fp32 -> bf16 of one piece in accesses of E elements (E fp32 in, E bf16 out),
// rounded as the host engine rounds (float_to_bf16_rne).
template <int E>
__device__ __forceinline__ void cast_piece(const CopySegment& p) {
  using In = typename Access<4 * E>::type;
  using Out = typename Access<2 * E>::type;
  run_piece<In, Out>(p, p.width / E, [](const In& v) {
    const auto* in_bits = reinterpret_cast<const uint32_t*>(&v);
    Out out;
    auto* out_bits = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
    for (int e = 0; e < E; ++e) out_bits[e] = float_to_bf16_rne(in_bits[e]);
    return out;
  });
}

__global__ void __launch_bounds__(kCopyThreads) copy_pieces_kernel(const CopyPiece* pieces, int64_t num_pieces) {
  for (int64_t index = blockIdx.x; index < num_pieces; index += gridDim.x) {
    const CopyPiece piece = pieces[index];  // the same 64 bytes for every thread: one broadcast load
    const CopySegment& p = piece.seg;
    if (p.kind == kCopyBytes) {
      switch (piece.vec) {
        case 16: copy_piece<Access<16>::type>(p); break;
        case 8: copy_piece<Access<8>::type>(p); break;
        case 4: copy_piece<Access<4>::type>(p); break;
        case 2: copy_piece<Access<2>::type>(p); break;
        default: copy_piece<Access<1>::type>(p); break;
      }
    } else {
      switch (piece.vec) {
        case 4: cast_piece<4>(p); break;
        case 2: cast_piece<2>(p); break;
        default: cast_piece<1>(p); break;
      }
    }
  }
}

}  // namespace

int copy_kernel_blocks_per_sm(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, copy_pieces_kernel, kCopyThreads, 0) != cudaSuccess) {
    cudaGetLastError();
    blocks = 1;
  }
  blocks = blocks < 1 ? 1 : blocks;
  if (device >= 0 && device < 64) cached[device] = blocks;
  return blocks;
}

cudaError_t launch_copy_pieces(const CopyPiece* pieces, int64_t num_pieces, int num_blocks, cudaStream_t stream) {
  if (num_pieces == 0) return cudaSuccess;
  copy_pieces_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(pieces, num_pieces);
  return cudaGetLastError();
}

}  // namespace llamarl
