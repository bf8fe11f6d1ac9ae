// One decode step's attention on x86 CPUs with AVX-512: each row's query heads against
// its KV cache, read where the cache lies (keys [B, KV, Dh, S] as bfloat16 bits or float32,
// values [B, KV, S, Dh]); see hflax/platforms/cpu/attention.py for why and the measurements.
//
// Per row and KV head: the scores of its G query heads, 32 slots at a time, multiply-added
// over head_dim in order (bfloat16 products are exact in float32, so these are
// attention.one_query's sums); the masked softmax; the weighted sum of the values, 64 of
// head_dim at a time. A row reads its slots up to its last visible one (all where it sees
// none): a cache grown to its full width at once costs no more than the slots in use.
// While one head computes, the next head's keys and values are prefetched into L2: read
// in head_dim rows 2 x S bytes apart, the keys otherwise waited on memory at every row
// (SmolLM2's 30 layers at 32 rows and 128 slots, one thread: 13.6 against 6.8 ms).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // float32 lanes of a 512-bit register
constexpr int kSlots = 32;  // key slots a score block takes (two registers)
constexpr int kHeads = 4;   // query heads sharing the key or value loads at most
constexpr int kDims = 4;    // registers of head_dim a value block takes at most

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

inline __mmask16 First(int n) { return static_cast<__mmask16>((1u << n) - 1); }

// n (<= 16) values, bfloat16 bits or float32, as float32 (the rest 0).
inline __m512 Load(const uint16_t* p, int n = kLanes) {
  const __m256i h = n >= kLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                : _mm256_maskz_loadu_epi16(First(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 Load(const float* p, int n = kLanes) {
  return n >= kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(First(n), p);
}

inline float Widen(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float Widen(float f) { return f; }

// float32 rounded to bfloat16 (to nearest even, as XLA's convert) and widened again.
inline __m512 RoundToBf16(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(0xFFFF0000)));
}

inline void Store(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void Store(uint16_t* p, __m512 x) {
  const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(RoundToBf16(x)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(u));
}

// exp(x) for x <= 0 (scores less their maximum), within 2 ulp: 2^n e^r, |r| <= ln2 / 2,
// e^r by its degree-6 polynomial. Below -104 it is 0 (exp's float32 result is then 0 too).
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Lines to bring into L2 while scores compute, `per` a step: the next head's keys (`rows`
// rows of row_bytes, `stride` apart: the slots it reads of each head_dim row), then its
// values (one range).
struct Ahead {
  const char* row;
  const char* at;
  int64_t row_bytes, stride, rows;
  const char* then;
  const char* then_end;
  int64_t per;

  inline void Step() {
    for (int64_t i = 0; i < per; ++i) {
      while (at >= row + row_bytes) {
        if (--rows <= 0) {
          if (then >= then_end) return;
          row = then, at = Line(then), row_bytes = then_end - then, rows = 1, then = then_end;
          break;
        }
        row += stride;
        at = Line(row);
      }
      _mm_prefetch(at, _MM_HINT_T1);
      at += 64;
    }
  }

  static const char* Line(const char* p) {
    return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
  }
};

// Scores of NG query heads (q: [NG, Dh] float32) for the n (<= 32) slots from s of the
// `reads` a row reads, into sc[g * ld + s ..]: fused multiply-adds in head_dim order.
template <int NG, typename K>
inline void Scores(const float* q, int64_t Dh, const K* k, int64_t S, int64_t reads, int64_t s,
                   int n, float* sc, int64_t ld, Ahead& ahead) {
  __m512 lo[NG], hi[NG];
  for (int g = 0; g < NG; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
  const int n_lo = std::min(n, kLanes), n_hi = n - n_lo;
  const bool more = s + kSlots < reads;
  for (int64_t d = 0; d < Dh; ++d) {
    const K* row = k + d * S + s;
    const __m512 k_lo = Load(row, n_lo);
    const __m512 k_hi = n_hi > 0 ? Load(row + kLanes, n_hi) : _mm512_setzero_ps();
    if (more) _mm_prefetch(reinterpret_cast<const char*>(row + kSlots), _MM_HINT_T0);
    ahead.Step();
    for (int g = 0; g < NG; ++g) {
      const __m512 qg = _mm512_set1_ps(q[g * Dh + d]);
      lo[g] = _mm512_fmadd_ps(qg, k_lo, lo[g]);
      hi[g] = _mm512_fmadd_ps(qg, k_hi, hi[g]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    _mm512_storeu_ps(sc + g * ld + s, lo[g]);
    _mm512_storeu_ps(sc + g * ld + s + kLanes, hi[g]);
  }
}

// o[g, d0 .. d0 + 16 NV) = sum over slots of p[g, s] v[s, ...], in slot order.
template <int NG, int NV, typename V>
inline void Values(const float* p, int64_t ld, const V* v, int64_t S, int64_t Dh, int64_t d0,
                   float* o) {
  __m512 acc[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m512 vs[NV];
    for (int j = 0; j < NV; ++j) vs[j] = Load(v + s * Dh + d0 + j * kLanes);
    for (int g = 0; g < NG; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * ld + s]);
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(pg, vs[j], acc[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + g * Dh + d0 + j * kLanes, acc[g][j]);
}

template <int NG, typename V>
inline void ValuesOf(int nv, const float* p, int64_t ld, const V* v, int64_t S, int64_t Dh,
                     int64_t d0, float* o) {
  switch (nv) {
    case 4: Values<NG, 4>(p, ld, v, S, Dh, d0, o); break;
    case 3: Values<NG, 3>(p, ld, v, S, Dh, d0, o); break;
    case 2: Values<NG, 2>(p, ld, v, S, Dh, d0, o); break;
    default: Values<NG, 1>(p, ld, v, S, Dh, d0, o); break;
  }
}

// softmax over the visible slots of one row of scores (scaled here), in place; the
// masked ones get -1e30 as attention.MASKED, so a row with none visible is uniform.
inline void Softmax(float* row, const bool* visible, int64_t S, float scale, bool round) {
  const __m512 vscale = _mm512_set1_ps(scale), masked = _mm512_set1_ps(-1e30f);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t s = 0; s < S; s += kLanes) {
    const __mmask16 live = First(static_cast<int>(std::min<int64_t>(kLanes, S - s)));
    const __m128i bytes = _mm_maskz_loadu_epi8(live, visible + s);
    const __mmask16 seen = _mm_mask_test_epi8_mask(live, bytes, bytes);
    const __m512 x = _mm512_mask_blend_ps(seen, masked,
                                          _mm512_mul_ps(_mm512_loadu_ps(row + s), vscale));
    _mm512_storeu_ps(row + s, x);
    top = _mm512_mask_max_ps(top, live, top, x);
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; s += kLanes) {
    const __mmask16 live = First(static_cast<int>(std::min<int64_t>(kLanes, S - s)));
    const __m512 e = _mm512_maskz_mov_ps(live, Exp(_mm512_sub_ps(_mm512_loadu_ps(row + s), m)));
    _mm512_storeu_ps(row + s, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
  for (int64_t s = 0; s < S; s += kLanes) {
    const __m512 p = _mm512_div_ps(_mm512_loadu_ps(row + s), total);
    _mm512_storeu_ps(row + s, round ? RoundToBf16(p) : p);
  }
}

// One row's KV head: G query heads q_in [G, Dh] -> out [G, Dh] over its first `reads` of
// S slots (the rest are masked: their probabilities would be exactly 0); `next`: the
// following head's keys (next_reads slots of each head_dim row) and values, to prefetch.
template <typename Q, typename K, typename V>
void Head(const Q* q_in, const K* k, const V* v, const bool* visible, int64_t G, int64_t Dh,
          int64_t S, int64_t reads, float scale, Q* out, std::vector<float>& work,
          const char* next, int64_t next_reads, const char* next_v) {
  const int64_t ld = (reads + kSlots - 1) / kSlots * kSlots;
  work.resize(G * Dh * 2 + G * ld);
  float* q = work.data();
  float* o = q + G * Dh;
  float* sc = o + G * Dh;
  for (int64_t i = 0; i < G * Dh; ++i) q[i] = Widen(q_in[i]);
  const int64_t steps = (G + kHeads - 1) / kHeads * (ld / kSlots) * Dh;
  const int64_t k_row = next_reads * static_cast<int64_t>(sizeof(K));
  const int64_t v_bytes = next_reads * Dh * static_cast<int64_t>(sizeof(V));
  const int64_t lines = next ? Dh * (k_row / 64 + 2) + v_bytes / 64 + 1 : 0;
  Ahead ahead{next, Ahead::Line(next), k_row, S * static_cast<int64_t>(sizeof(K)),
              next ? Dh : 0, next_v, next_v + (next ? v_bytes : 0), (lines + steps - 1) / steps};
  for (int64_t g0 = 0; g0 < G; g0 += kHeads)
    for (int64_t s = 0; s < reads; s += kSlots) {
      const int n = static_cast<int>(std::min<int64_t>(kSlots, reads - s));
      const float* qg = q + g0 * Dh;
      float* sg = sc + g0 * ld;
      switch (std::min<int64_t>(kHeads, G - g0)) {
        case 4: Scores<4>(qg, Dh, k, S, reads, s, n, sg, ld, ahead); break;
        case 3: Scores<3>(qg, Dh, k, S, reads, s, n, sg, ld, ahead); break;
        case 2: Scores<2>(qg, Dh, k, S, reads, s, n, sg, ld, ahead); break;
        default: Scores<1>(qg, Dh, k, S, reads, s, n, sg, ld, ahead); break;
      }
    }
  for (int64_t g = 0; g < G; ++g) Softmax(sc + g * ld, visible, reads, scale, sizeof(Q) == 2);
  for (int64_t d0 = 0; d0 < Dh; d0 += kDims * kLanes) {
    const int nv = static_cast<int>(std::min<int64_t>(kDims, (Dh - d0) / kLanes));
    for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
      const float* pg = sc + g0 * ld;
      float* og = o + g0 * Dh;
      switch (std::min<int64_t>(kHeads, G - g0)) {
        case 4: ValuesOf<4>(nv, pg, ld, v, reads, Dh, d0, og); break;
        case 3: ValuesOf<3>(nv, pg, ld, v, reads, Dh, d0, og); break;
        case 2: ValuesOf<2>(nv, pg, ld, v, reads, Dh, d0, og); break;
        default: ValuesOf<1>(nv, pg, ld, v, reads, Dh, d0, og); break;
      }
    }
  }
  for (int64_t i = 0; i < G * Dh; i += kLanes) Store(out + i, _mm512_loadu_ps(o + i));
}

// The slots a row reads: up to its last visible one (a wider cache's empty tail is skipped),
// or all S where it sees none (then every slot weighs the same, as in one_query).
inline int64_t Reads(const bool* visible, int64_t S) {
  for (int64_t s = S; s > 0; --s)
    if (visible[s - 1]) return s;
  return S;
}
#pragma GCC pop_options

template <typename Q, typename K, typename V, ffi::DataType DQ, ffi::DataType DK,
          ffi::DataType DV>
ffi::Error Attend(ffi::Buffer<DQ> q, ffi::Buffer<DK> k, ffi::Buffer<DV> v,
                  ffi::Buffer<ffi::PRED> visible, ffi::ResultBuffer<DQ> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             md = visible.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || md.size() != 2)
    return ffi::Error::InvalidArgument("hflax cpu attention: expects q [B, H, Dh], keys "
                                       "[B, KV, Dh, S], values [B, KV, S, Dh], visible [B, S]");
  const int64_t B = qd[0], H = qd[1], Dh = qd[2], KV = kd[1], S = kd[3];
  if (kd[0] != B || kd[2] != Dh || vd[0] != B || vd[1] != KV || vd[2] != S || vd[3] != Dh ||
      md[0] != B || md[1] != S || KV == 0 || H == 0 || H % KV || Dh == 0 || Dh % kLanes ||
      S == 0)
    return ffi::Error::InvalidArgument("hflax cpu attention: shapes do not agree (H a "
                                       "multiple of KV, Dh of 16, none of them or S 0)");
  const int64_t G = H / KV;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dh)));
  static thread_local std::vector<float> work;
  const Q* qp = reinterpret_cast<const Q*>(q.untyped_data());
  const K* kp = reinterpret_cast<const K*>(k.untyped_data());
  const V* vp = reinterpret_cast<const V*>(v.untyped_data());
  const bool* mp = reinterpret_cast<const bool*>(visible.untyped_data());
  Q* op = reinterpret_cast<Q*>(out->untyped_data());
  const int64_t heads = B * KV, k_size = Dh * S, v_size = S * Dh;
  std::vector<int64_t> reads(B);
  for (int64_t b = 0; b < B; ++b) reads[b] = Reads(mp + b * S, S);
  for (int64_t i = 0; i < heads; ++i) {
    const int64_t b = i / KV, h = i % KV;
    const bool last = i + 1 == heads;
    Head(qp + (b * H + h * G) * Dh, kp + i * k_size, vp + i * v_size, mp + b * S, G, Dh, S,
         reads[b], scale, op + (b * H + h * G) * Dh, work,
         last ? nullptr : reinterpret_cast<const char*>(kp + (i + 1) * k_size),
         last ? 0 : reads[(i + 1) / KV],
         last ? nullptr : reinterpret_cast<const char*>(vp + (i + 1) * v_size));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HflaxCpuAttentionBf16,
                              (Attend<uint16_t, uint16_t, uint16_t, ffi::BF16, ffi::U16,
                                      ffi::BF16>),
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HflaxCpuAttentionF32,
                              (Attend<float, float, float, ffi::F32, ffi::F32, ffi::F32>),
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
