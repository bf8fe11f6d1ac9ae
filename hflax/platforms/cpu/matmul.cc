// Rows times a packed kernel on x86 CPUs with AVX-512: C[M, N] = A[M, K] W^T accumulated
// in float32, W being a decoding copy's kernel [N, K] stored in panels of 16 outputs
// (bfloat16 with AVX512-BF16, or float32; see hflax/platforms/cpu/matmul.py for the layout,
// why, and the measurements).
//
// Each call computes 8 rows x 48 outputs at a time in 24 vector registers: per step along
// K (a pair of K indices in bfloat16) it loads three 16-output slices of W and broadcasts
// one value of each of the 8 rows, so the multiply-adds, not the loads, set the pace. All
// rows of a group of 48 outputs are done while its slice of W (K x 48) sits in L2, and the
// next group's slice is prefetched into L2 meanwhile. One thread: a device per core (see
// matmul.py for why not more).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 8;    // rows per register block
constexpr int kSlices = 3;  // 16-output slices per register block
constexpr int kLanes = 16;  // float32 lanes of a 512-bit register
constexpr int kAhead = 16;  // steps along K between a line's prefetch into L1 and its load

// Lines of the next group's slice of W to bring into L2 while this block runs: `per`
// every step along K, from `next` up to `end`.
struct Ahead {
  const char* next;
  const char* end;
  int64_t per;
};

// In: uint16_t (bfloat16, W's panels [K / 2][16][2]: pairs along K, for vdpbf16ps) or float
// (W's panels [K][16], for FMA). Out: float, or uint16_t (rounded to bfloat16, to nearest
// even, as XLA's convert rounds).
template <typename In>
constexpr int64_t kStep = sizeof(In) == 2 ? 2 : 1;  // K indices a step along K takes

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")
template <int MR, int NV, typename In, typename Out>
inline void Block(const In* a, int64_t K, const In* w, int64_t panel, Out* c, int64_t N,
                  Ahead ahead) {
  constexpr int64_t step = kStep<In>;
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / step; ++p) {
    __m512 b[NV];
    for (int j = 0; j < NV; ++j) {
      b[j] = _mm512_castsi512_ps(_mm512_loadu_si512(w + j * panel + p * step * kLanes));
      _mm_prefetch(reinterpret_cast<const char*>(w + j * panel + (p + kAhead) * step * kLanes),
                   _MM_HINT_T0);
    }
    for (int64_t q = 0; q < ahead.per && ahead.next < ahead.end; ++q, ahead.next += 64)
      _mm_prefetch(ahead.next, _MM_HINT_T1);
    for (int i = 0; i < MR; ++i) {
      if constexpr (step == 2) {
        int32_t pair;
        std::memcpy(&pair, a + i * K + 2 * p, sizeof(pair));
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, (__m512bh)b[j]);
      } else {
        const __m512 x = _mm512_set1_ps(a[i * K + p]);
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(x, b[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) {
      if constexpr (sizeof(Out) == 4)
        _mm512_storeu_ps(c + i * N + kLanes * j, acc[i][j]);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * N + kLanes * j),
                            (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
    }
}

// Every row of one group of NV panels; `next`: the following group's slice of W.
template <int NV, typename In, typename Out>
void RowBlocks(const In* a, int64_t M, int64_t K, const In* w, Out* c, int64_t N,
               const In* next, int64_t next_bytes) {
  const int64_t panel = K * kLanes, steps = K / kStep<In>;
  // The next group's slice, shared out over this group's row blocks (from DRAM to L2
  // while these compute from L2, so that its first block does not wait on DRAM).
  const int64_t blocks = (M + kRows - 1) / kRows, lines = (next_bytes + 63) / 64;
  const int64_t block_lines = (lines + blocks - 1) / blocks;
  const int64_t per = (block_lines + steps - 1) / steps;
  const char* base = reinterpret_cast<const char*>(next);
  auto ahead = [&](int64_t block) {
    const char* from = base + std::min(lines, block * block_lines) * 64;
    const char* to = base + std::min(lines, (block + 1) * block_lines) * 64;
    return Ahead{from, to, per};
  };
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    Block<kRows, NV>(a + m * K, K, w, panel, c + m * N, N, ahead(m / kRows));
  const In* ar = a + m * K;
  Out* cr = c + m * N;
  const Ahead last = ahead(m / kRows);
  switch (M - m) {
    case 7: Block<7, NV>(ar, K, w, panel, cr, N, last); break;
    case 6: Block<6, NV>(ar, K, w, panel, cr, N, last); break;
    case 5: Block<5, NV>(ar, K, w, panel, cr, N, last); break;
    case 4: Block<4, NV>(ar, K, w, panel, cr, N, last); break;
    case 3: Block<3, NV>(ar, K, w, panel, cr, N, last); break;
    case 2: Block<2, NV>(ar, K, w, panel, cr, N, last); break;
    case 1: Block<1, NV>(ar, K, w, panel, cr, N, last); break;
    default: break;
  }
}
#pragma GCC pop_options

// Output group g (kSlices panels, fewer in the last) of every row.
template <typename In, typename Out>
void Group(const In* a, int64_t M, int64_t K, const In* w, Out* c, int64_t N, int64_t g) {
  const int64_t first = g * kSlices, panels = N / kLanes;
  const int nv = static_cast<int>(std::min<int64_t>(kSlices, panels - first));
  const In* wg = w + first * K * kLanes;
  Out* cg = c + first * kLanes;
  const int64_t after = std::min<int64_t>(kSlices, panels - first - nv);
  const In* next = wg + nv * K * kLanes;
  const int64_t next_bytes = after * K * kLanes * static_cast<int64_t>(sizeof(In));
  if (nv == 3) RowBlocks<3>(a, M, K, wg, cg, N, next, next_bytes);
  else if (nv == 2) RowBlocks<2>(a, M, K, wg, cg, N, next, next_bytes);
  else RowBlocks<1>(a, M, K, wg, cg, N, next, next_bytes);
}

template <typename In, typename Out, ffi::DataType DIn, ffi::DataType DOut>
ffi::Error Matmul(ffi::Buffer<DIn> x, ffi::Buffer<DIn> w, ffi::ResultBuffer<DOut> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("hflax cpu matmul: expects x [M, K] and w [N, K]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (N % kLanes || K % kStep<In>)
    return ffi::Error::InvalidArgument("hflax cpu matmul: N must be a multiple of 16 (and K "
                                       "even for bfloat16)");
  if (M == 0) return ffi::Error::Success();  // no rows: nothing to write (and no blocks)
  const In* a = reinterpret_cast<const In*>(x.untyped_data());
  const In* wp = reinterpret_cast<const In*>(w.untyped_data());
  Out* c = reinterpret_cast<Out*>(out->untyped_data());
  for (int64_t g = 0; g < (N / kLanes + kSlices - 1) / kSlices; ++g) Group(a, M, K, wp, c, N, g);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HflaxCpuMatmulBf16,
                              (Matmul<uint16_t, float, ffi::BF16, ffi::F32>),
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HflaxCpuMatmulBf16Rounded,
                              (Matmul<uint16_t, uint16_t, ffi::BF16, ffi::BF16>),
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HflaxCpuMatmulF32, (Matmul<float, float, ffi::F32, ffi::F32>),
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
