// Rows times a packed kernel on x86 CPUs with AVX512-BF16: C[M, N] = A[M, K] W^T, bfloat16
// operands accumulated in float32, W being a decoding copy's kernel [N, K] stored in
// panels of 16 outputs (see hflax/models/cpu_matmul.py for the layout, why, and the
// measurements).
//
// Each call computes 8 rows x 48 outputs at a time in 24 vector registers: per pair of K
// indices it loads three 16-output slices of W and broadcasts one pair of each of the 8
// rows, so the multiply-adds, not the loads, set the pace. All rows of a
// group of 48 outputs are done while its slice of W (K x 48) sits in L2. One thread: a
// device per core (see cpu_matmul.py for why not more).
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

// One 16-output panel of a packed bfloat16 kernel: [K / 2][16][2] (pairs along K).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")
// Out: float (float32 results) or uint16_t (rounded to bfloat16, to nearest even, as
// XLA's convert rounds).
// Lines of the next group's slice of W to bring into L2 while this block runs: `per`
// every step along K, from `next` up to `end`.
struct Ahead {
  const char* next;
  const char* end;
  int64_t per;
};

template <int MR, int NV, typename Out>
inline void Bf16Block(const uint16_t* a, int64_t K, const uint16_t* w, int64_t panel,
                      Out* c, int64_t N, Ahead ahead) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512bh b[NV];
    for (int j = 0; j < NV; ++j) {
      b[j] = (__m512bh)_mm512_loadu_si512(w + j * panel + p * 2 * kLanes);
      _mm_prefetch(reinterpret_cast<const char*>(w + j * panel + (p + kAhead) * 2 * kLanes),
                   _MM_HINT_T0);
    }
    for (int64_t q = 0; q < ahead.per && ahead.next < ahead.end; ++q, ahead.next += 64)
      _mm_prefetch(ahead.next, _MM_HINT_T1);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * K + 2 * p, sizeof(pair));
      __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, b[j]);
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

template <int NV, typename Out>
void Bf16Group(const uint16_t* a, int64_t M, int64_t K, const uint16_t* w, Out* c,
               int64_t N, const uint16_t* next, int64_t next_bytes) {
  const int64_t panel = K * kLanes;
  // The next group's slice, shared out over this group's row blocks (from DRAM to L2
  // while these compute from L2, so that its first block does not wait on DRAM).
  const int64_t blocks = (M + kRows - 1) / kRows, lines = (next_bytes + 63) / 64;
  const int64_t block_lines = (lines + blocks - 1) / blocks;
  const int64_t per = (block_lines + K / 2 - 1) / (K / 2);
  const char* base = reinterpret_cast<const char*>(next);
  auto ahead = [&](int64_t block) {
    const char* from = base + std::min(lines, block * block_lines) * 64;
    const char* to = base + std::min(lines, (block + 1) * block_lines) * 64;
    return Ahead{from, to, per};
  };
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    Bf16Block<kRows, NV, Out>(a + m * K, K, w, panel, c + m * N, N, ahead(m / kRows));
  const uint16_t* ar = a + m * K;
  Out* cr = c + m * N;
  switch (M - m) {
    case 7: Bf16Block<7, NV, Out>(ar, K, w, panel, cr, N, ahead(m / kRows)); break;
    case 6: Bf16Block<6, NV, Out>(ar, K, w, panel, cr, N, ahead(m / kRows)); break;
    case 5: Bf16Block<5, NV, Out>(ar, K, w, panel, cr, N, ahead(m / kRows)); break;
    case 4: Bf16Block<4, NV, Out>(ar, K, w, panel, cr, N, ahead(m / kRows)); break;
    case 3: Bf16Block<3, NV, Out>(ar, K, w, panel, cr, N, ahead(m / kRows)); break;
    case 2: Bf16Block<2, NV, Out>(ar, K, w, panel, cr, N, ahead(m / kRows)); break;
    case 1: Bf16Block<1, NV, Out>(ar, K, w, panel, cr, N, ahead(m / kRows)); break;
    default: break;
  }
}
#pragma GCC pop_options

// Output group g (kSlices panels, fewer in the last) of every row.
template <typename Out>
void Group(const uint16_t* a, int64_t M, int64_t K, const uint16_t* w, Out* c, int64_t N,
           int64_t g) {
  const int64_t first = g * kSlices, panels = N / kLanes;
  const int nv = static_cast<int>(panels - first < kSlices ? panels - first : kSlices);
  const uint16_t* wg = w + first * K * kLanes;
  Out* cg = c + first * kLanes;
  const int64_t after = std::min<int64_t>(kSlices, panels - first - nv);
  const uint16_t* next = wg + nv * K * kLanes;
  const int64_t next_bytes = after * K * kLanes * 2;
  if (nv == 3) Bf16Group<3>(a, M, K, wg, cg, N, next, next_bytes);
  else if (nv == 2) Bf16Group<2>(a, M, K, wg, cg, N, next, next_bytes);
  else Bf16Group<1>(a, M, K, wg, cg, N, next, next_bytes);
}

template <typename Out>
void Run(const uint16_t* a, int64_t M, int64_t K, const uint16_t* w, Out* c, int64_t N) {
  const int64_t groups = (N / kLanes + kSlices - 1) / kSlices;
  for (int64_t g = 0; g < groups; ++g) Group(a, M, K, w, c, N, g);
}

template <typename Out, ffi::DataType D>
ffi::Error Matmul(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<D> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("hflax cpu matmul: expects x [M, K] and w [N, K]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (N % kLanes || K % 2)
    return ffi::Error::InvalidArgument("hflax cpu matmul: N must be a multiple of 16, K even");
  Run(reinterpret_cast<const uint16_t*>(x.untyped_data()), M, K,
      reinterpret_cast<const uint16_t*>(w.untyped_data()),
      reinterpret_cast<Out*>(out->untyped_data()), N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HflaxCpuMatmulBf16, (Matmul<float, ffi::F32>),
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HflaxCpuMatmulBf16Rounded, (Matmul<uint16_t, ffi::BF16>),
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
