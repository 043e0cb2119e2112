// Quantized matmul for a few rows: y[M, N] = x[M, K] . W[N, K]^T, W as a GGUF file stores it.
//
// Why our own kernel: decoding on a CPU reads every weight once per pass, so a pass over 1 to 8 rows should
// cost about one weight read. Kernels that dequantize a block per row (llama.cpp's vec_dot, PyTorch's int4
// weight-only op) pay the unpacking again for every row, and cost about twice a plain step at 4 rows.
// Here each 16-channel tile of weights is unpacked once into registers and applied to every row.
//
// Weights (see gguf_weights.py): w[n, k] = d[n, s] * sc[n, g] * q[n, k] - dmin[n, s] * mn[n, g]
//   q: unsigned values stored in 2, 4, 6 or 8 bits (BITS: 4 for Q4_K, 6 for Q6_K and Q5_0, 8 for Q8_0; 2 for a draft
//   re-quantized to fewer bits), g = k / G its group, s = g / S its super-group. Every GGUF type draftwise reads maps
//   onto this exactly (Q4_K, Q6_K, Q5_0, Q8_0, Q4_1).
// Activations: each row quantized per group of G to int8 with its own scale, as llama.cpp does (Q8_K);
//   the integer dot products then run on AVX512-VNNI (64 multiply-adds an instruction), AVX-VNNI or AVX2 (32).
//
// One source, a library per instruction set (qgemm.py builds each with its own flags and -DDW_ISA, and picks one
// from the CPU's flags or DRAFTWISE_KERNEL_ISA): avx512 (AVX512-VNNI), avxvnni (AVX2 + FMA + AVX-VNNI's 256-bit
// vpdpbusd), avx2 (AVX2 + FMA alone), scalar (plain C). They give the same bits: the integer dot products are exact
// on every path, and every float operation around them (the activations' scale and rounding, the weights' scales,
// the accumulation over groups, attention's lanes, reductions and exp) is the same operation in the same order,
// fused where the others fuse. See docs/kernel-isa.md.
//
// Batch invariance: a row's result depends only on that row and the weights. The instruction sequence that
// computes y[m, n] is the same whatever M is, whichever chunk of rows m falls in, and whichever thread runs
// its tile (tiles are never split over threads): a row's logits are bit-identical alone or in any batch.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DW_SCALAR 0
#define DW_AVX2 1
#define DW_AVXVNNI 2
#define DW_AVX512 3
#ifndef DW_ISA  // (qgemm.py always says which; a build by hand takes the best the flags allow)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DW_ISA DW_AVX512
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__)
#define DW_ISA DW_AVXVNNI
#elif defined(__AVX2__) && defined(__FMA__)
#define DW_ISA DW_AVX2
#else
#define DW_ISA DW_SCALAR
#endif
#endif
#if DW_ISA == DW_AVX512 && !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__))
#error "DW_ISA=3 (avx512) needs -mavx512vnni -mavx512bw -mavx512vl"
#elif DW_ISA == DW_AVXVNNI && !(defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__))
#error "DW_ISA=2 (avxvnni) needs -mavxvnni -mavx2 -mfma"
#elif DW_ISA == DW_AVX2 && !(defined(__AVX2__) && defined(__FMA__))
#error "DW_ISA=1 (avx2) needs -mavx2 -mfma"
#endif
#define DW_VNNI (DW_ISA == DW_AVX512)  // 512-bit registers: 16 channels in one
#define DW_AVX (DW_ISA == DW_AVX2 || DW_ISA == DW_AVXVNNI)  // 256-bit registers: 16 channels in two halves of 8
#if DW_ISA != DW_SCALAR
#include <immintrin.h>
#endif
// A test-only build (-DDW_TEST_OTHER_ORDER) sums in another order on the 256-bit path: the control that shows the
// cross-path tests can see a change of order (tests/test_kernel_isa.py). Never built by qgemm.py.
#ifndef DW_TEST_OTHER_ORDER
#define DW_TEST_OTHER_ORDER 0
#endif

#define TILE 16  // output channels per tile: one float32 lane each
// Groups ahead whose weights are prefetched: the hardware prefetcher alone left the unpacking and the multiply-adds
// waiting on memory, so a pass over 4 to 8 rows cost the weight read plus the arithmetic, not the larger of them.
// DW_PREFETCH_L2 (qgemm.py sets it on Intel's CPUs and AMD's from Zen 5): into the L2, further ahead. A pass is held
// back by what one core streams, not by the memory (on a 2-core Xeon one thread read 12 GB/s and two 23), and there a
// one-row pass ran 10% faster prefetching 12 groups ahead into the L2 than 8 ahead into the L1 (more or fewer groups,
// or both levels, were slower; passes of 4 to 16 rows took the same); on a Zen 5 one row ran 1.5-5% faster. Zen 4 is
// reported to drop PREFETCHT1 at times, so elsewhere the prefetch stays as it was measured there: into the L1.
#if DW_PREFETCH_L2
#define PREFETCH_GROUPS 12
#define PREFETCH_HINT _MM_HINT_T1
#else
#define PREFETCH_GROUPS 8
#define PREFETCH_HINT _MM_HINT_T0
#endif
#define MAX_ROWS 16  // rows per pass over a tile: one accumulator register each
#if DW_ISA != DW_SCALAR
// A tile's group j of blocks, scales and minima into the cache, PREFETCH_GROUPS ahead of the one being read (every
// vector path reads groups in the same order).
static inline __attribute__((always_inline)) void prefetch_group(const uint8_t *q, const int8_t *sc, const int8_t *mn,
                                                                  int j, int G, int BITS) {
    const char *ahead = (const char *)(q + (size_t)j * TILE * G * BITS / 8);
    for (int line = 0; line < TILE * G * BITS / 8; line += 64) _mm_prefetch(ahead + line, PREFETCH_HINT);
    _mm_prefetch((const char *)(sc + (size_t)j * TILE), PREFETCH_HINT);
    _mm_prefetch((const char *)(mn + (size_t)j * TILE), PREFETCH_HINT);
}
#endif

// One group of g values (a multiple of 16) to int8 with its scale (largest magnitude -> 127) and the float sum of
// what it stands for. The vector and scalar forms give the same bits: a maximum does not depend on order, each
// value is rounded on its own (to nearest even), and the integer sum is exact.
static inline void quantize_group(const float *v, int g, int8_t *out, float *scale, float *sum) {
    float amax = 0.0f;
#if DW_VNNI
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < g; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
    amax = _mm512_reduce_max_ps(top);
#elif DW_AVX
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 top = _mm256_setzero_ps();
    for (int i = 0; i < g; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude));
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
#else
    for (int i = 0; i < g; i++) amax = fmaxf(amax, fabsf(v[i]));
#endif
    const float s = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int total = 0;
#if DW_VNNI
    const __m512 iv = _mm512_set1_ps(inv);
    __m512i count = _mm512_setzero_si512();
    for (int i = 0; i < g; i += 16) {
        const __m512i qv = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + i), iv));
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(qv));
        count = _mm512_add_epi32(count, qv);
    }
    total = _mm512_reduce_add_epi32(count);
#elif DW_AVX
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i count = _mm256_setzero_si256();
    for (int i = 0; i < g; i += 8) {
        const __m256i qv = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), iv));
        // |qv| <= 127, so the saturating packs to int16 and int8 keep every value as it is (as vpmovdb does)
        const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(qv), _mm256_extracti128_si256(qv, 1));
        _mm_storel_epi64((__m128i *)(out + i), _mm_packs_epi16(halves, halves));
        count = _mm256_add_epi32(count, qv);
    }
    int32_t counts[8];
    _mm256_storeu_si256((__m256i *)counts, count);
    for (int l = 0; l < 8; l++) total += counts[l];
#else
    for (int i = 0; i < g; i++) {
        const int qv = (int)nearbyintf(v[i] * inv);
        out[i] = (int8_t)qv;
        total += qv;
    }
#endif
    *scale = s;
    *sum = s * (float)total;
}

// Quantize each row of x [rows, k] to int8 per group of g: xq [rows, k], scale and float sum per group.
void dw_quantize_rows(const float *x, int rows, int k, int g, int8_t *xq, float *scale, float *sum) {
    const int groups = k / g;
#pragma omp parallel for schedule(static) if (rows * k > 65536)
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < groups; j++) {
            const size_t at = (size_t)r * k + (size_t)j * g;
            quantize_group(x + at, g, xq + at, scale + (size_t)r * groups + j, sum + (size_t)r * groups + j);
        }
}

// The bench's read rate (bench/bandwidth.py): threads sum their shares of words [n] with nothing else to do, so the
// loop runs as fast as the memory feeds loads; the sum is returned so that no read can be left out.
long long dw_stream_sum(const long long *words, long n, int threads) {
    long long total = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (long i = 0; i < n; i++) total += words[i];
    return total;
}

int dw_vectorized(void) { return DW_ISA != DW_SCALAR; }
int dw_isa(void) { return DW_ISA; }  // which path this library was built as (qgemm.py checks it at load)

#if DW_VNNI
// One tile of 16 channels over R rows. G: group size (16 or 32); BITS: 2 (four registers' values to a byte, register
// i + b * vecs / 4 in bits 2b and 2b + 1), 4 (two values a byte), 6 (a nibble plane, then a plane of 2-bit high
// parts, four registers' to a byte) or 8.
static inline __attribute__((always_inline)) void tile_rows(
    const int R, const int G, const int BITS, int k, int S, const uint8_t *q, const int8_t *sc, const int8_t *mn,
    const float *d, const float *dmin, const int8_t *xq, const float *xs, const float *xsum, float *y, int ldy) {
    const int groups = k / G;
    const int vecs = G / 4;  // registers of 16 channels x 4 values per group
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    __m512 dv = _mm512_setzero_ps(), dmv = _mm512_setzero_ps();
    for (int j = 0; j < groups; j++) {
        if (j % S == 0) {
            dv = _mm512_loadu_ps(d + (size_t)(j / S) * TILE);
            dmv = _mm512_loadu_ps(dmin + (size_t)(j / S) * TILE);
        }
        const __m512 ws = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                _mm_loadu_si128((const __m128i *)(sc + (size_t)j * TILE)))));
        const __m512 wm = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                 _mm_loadu_si128((const __m128i *)(mn + (size_t)j * TILE)))));
        __m512i w[8];
        prefetch_group(q, sc, mn, j + PREFETCH_GROUPS, G, BITS);
        const uint8_t *p = q + (size_t)j * TILE * G * BITS / 8;
        if (BITS == 2) {
            const __m512i three = _mm512_set1_epi8(0x03);
            for (int i = 0; i < vecs / 4; i++) {
                const __m512i packed = _mm512_loadu_si512(p + 64 * i);
                for (int b = 0; b < 4; b++)
                    w[i + b * (vecs / 4)] = _mm512_and_si512(_mm512_srli_epi16(packed, 2 * b), three);
            }
        } else if (BITS < 8) {
            for (int i = 0; i < vecs / 2; i++) {
                const __m512i packed = _mm512_loadu_si512(p + 64 * i);
                w[i] = _mm512_and_si512(packed, low);
                w[i + vecs / 2] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            }
            if (BITS == 6) {
                const __m512i two = _mm512_set1_epi8(0x03);
                for (int h = 0; h < vecs / 4; h++) {
                    const __m512i high = _mm512_loadu_si512(p + 64 * (vecs / 2) + 64 * h);
                    for (int b = 0; b < 4; b++) {
                        const __m512i part = _mm512_and_si512(_mm512_srli_epi16(high, 2 * b), two);
                        w[4 * h + b] = _mm512_or_si512(w[4 * h + b], _mm512_slli_epi16(part, 4));
                    }
                }
            }
        } else {
            for (int i = 0; i < vecs; i++) w[i] = _mm512_loadu_si512(p + 64 * i);
        }
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + (size_t)r * k + (size_t)j * G;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains: half the latency
            for (int i = 0; i < vecs; i += 2) {
                int32_t a, b;
                memcpy(&a, xr + 4 * i, 4);
                memcpy(&b, xr + 4 * i + 4, 4);
                s0 = _mm512_dpbusd_epi32(s0, w[i], _mm512_set1_epi32(a));
                s1 = _mm512_dpbusd_epi32(s1, w[i + 1], _mm512_set1_epi32(b));
            }
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            const size_t at = (size_t)r * groups + j;
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws, _mm512_set1_ps(xs[at])), acc[r]);
            acc[r] = _mm512_fnmadd_ps(wm, _mm512_set1_ps(xsum[at]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (size_t)r * ldy, acc[r]);
}

#elif DW_AVX
// The AVX-512 path's tile on 256-bit registers: each of its 64-byte registers of 16 channels x 4 values is two here,
// w[2 * i + h] holding channels 8h to 8h + 7 (the packed layout is the same bytes, read 32 at a time).
//
// The integer dot of a channel over a group is exact on every path, so it is the same number. AVX-VNNI's vpdpbusd
// (u8 x s8, four products summed into int32) never saturates. AVX2 has no such instruction: vpmaddubsw sums a pair of
// u8 x s8 products into an int16 that saturates at +-32767. It cannot here: an activation is an int8 (|x| <= 128; the
// quantizer gives |x| <= 127) and a 4-bit value is at most 15, so a pair is at most 2 * 15 * 128 = 3840 and the eight
// pairs a channel gets from a 32-group's 8 registers at most 30720, summed in int16 (vpaddw, exact below 32768)
// before vpmaddwd widens them to int32; a 6-bit value is at most 63, a pair at most 16128, two of them 32256. An
// 8-bit value (up to 255) would overflow a pair (65280), so it is split into its nibbles, hi * 16 + lo, each summed as
// a 4-bit value is and weighted 16 and 1 by vpmaddwd: exact again.
// The dot of one half's 8 channels with one row over a group: w[stride * i] (and wh[stride * i]) hold the half's
// values 4i to 4i + 3, xb[i] the row's, in every lane.
static inline __attribute__((always_inline)) __m256i dot_half(const int BITS, const int vecs, const __m256i *w,
                                                              const __m256i *wh, const int stride, const __m256i *xb) {
#if DW_ISA == DW_AVXVNNI
    (void)BITS;
    (void)wh;
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();  // two chains: half the latency
    for (int i = 0; i < vecs; i += 2) {
        s0 = _mm256_dpbusd_avx_epi32(s0, w[stride * i], xb[i]);
        s1 = _mm256_dpbusd_avx_epi32(s1, w[stride * (i + 1)], xb[i + 1]);
    }
    return _mm256_add_epi32(s0, s1);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (BITS == 6) {  // two registers' pairs at a time in int16
        __m256i s = _mm256_setzero_si256();
        for (int i = 0; i < vecs; i += 2) {
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w[stride * i], xb[i]),
                                               _mm256_maddubs_epi16(w[stride * (i + 1)], xb[i + 1]));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
        }
        return s;
    }
    __m256i p = _mm256_maddubs_epi16(w[0], xb[0]);  // 4 bits, or an 8-bit value's low nibbles: all in int16
    for (int i = 1; i < vecs; i++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[stride * i], xb[i]));
    __m256i s = _mm256_madd_epi16(p, ones);
    if (BITS == 8) {
        __m256i ph = _mm256_maddubs_epi16(wh[0], xb[0]);
        for (int i = 1; i < vecs; i++) ph = _mm256_add_epi16(ph, _mm256_maddubs_epi16(wh[stride * i], xb[i]));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(ph, _mm256_set1_epi16(16)));
    }
    return s;
#endif
}

// Half h (channels 8h to 8h + 7) of a group's packed values p into w[stride * i], i < vecs: the half's values 4i to
// 4i + 3 (on AVX2 an 8-bit value's low nibbles, its high ones into wh; see dot_half).
static inline __attribute__((always_inline)) void unpack_half(const int BITS, const int vecs, const uint8_t *p,
                                                              const int h, __m256i *w, __m256i *wh, const int stride) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (BITS == 2) {
        const __m256i three = _mm256_set1_epi8(0x03);
        for (int i = 0; i < vecs / 4; i++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(p + 64 * i + 32 * h));
            for (int b = 0; b < 4; b++)
                w[stride * (i + b * (vecs / 4))] = _mm256_and_si256(_mm256_srli_epi16(packed, 2 * b), three);
        }
    } else if (BITS < 8) {
        for (int i = 0; i < vecs / 2; i++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(p + 64 * i + 32 * h));
            w[stride * i] = _mm256_and_si256(packed, low);
            w[stride * (i + vecs / 2)] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        }
        if (BITS == 6) {
            const __m256i two = _mm256_set1_epi8(0x03);
            for (int hh = 0; hh < vecs / 4; hh++) {
                const __m256i high = _mm256_loadu_si256((const __m256i *)(p + 64 * (vecs / 2) + 64 * hh + 32 * h));
                for (int b = 0; b < 4; b++) {
                    const __m256i part = _mm256_and_si256(_mm256_srli_epi16(high, 2 * b), two);
                    w[stride * (4 * hh + b)] = _mm256_or_si256(w[stride * (4 * hh + b)], _mm256_slli_epi16(part, 4));
                }
            }
        }
    } else {
        for (int i = 0; i < vecs; i++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(p + 64 * i + 32 * h));
#if DW_ISA == DW_AVX2
            wh[stride * i] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            w[stride * i] = _mm256_and_si256(packed, low);
#else
            (void)wh;
            (void)low;
            w[stride * i] = packed;
#endif
        }
    }
}

// A row's values 4i to 4i + 3 of a group, in every lane.
static inline __attribute__((always_inline)) void spread_row(const int vecs, const int8_t *xr, __m256i *xb) {
    for (int i = 0; i < vecs; i++) {
        int32_t a;
        memcpy(&a, xr + 4 * i, 4);
        xb[i] = _mm256_set1_epi32(a);
    }
}

// acc (8 channels of one row) += its dot over a group, scaled: the AVX-512 path's two steps on a half.
static inline __attribute__((always_inline)) void add_group(__m256 *acc, __m256i dot, __m256 ws, __m256 wm, float xs,
                                                            float xsum) {
    const __m256 dotf = _mm256_cvtepi32_ps(dot);
#if DW_TEST_OTHER_ORDER  // (the control: the minimum's term first)
    *acc = _mm256_fnmadd_ps(wm, _mm256_set1_ps(xsum), *acc);
    *acc = _mm256_fmadd_ps(dotf, _mm256_mul_ps(ws, _mm256_set1_ps(xs)), *acc);
#else
    *acc = _mm256_fmadd_ps(dotf, _mm256_mul_ps(ws, _mm256_set1_ps(xs)), *acc);
    *acc = _mm256_fnmadd_ps(wm, _mm256_set1_ps(xsum), *acc);
#endif
}

// Up to 2 rows, both halves' values stay in registers and a row's spread values serve both. From 3 rows that spills
// (16 registers of values and 8 of the row's), so each half is unpacked on its own and its rows run in a loop that
// holds 8 registers of values and keeps the accumulators in the L1: at 4 to 8 rows a group took 8-15% less time on
// AVX2 and 17-35% on AVX-VNNI (a Zen 5; docs/experiments/avx2-halves-zen5).
// Either way each accumulator takes the same steps in the same order.
static inline __attribute__((always_inline)) void tile_rows(
    const int R, const int G, const int BITS, int k, int S, const uint8_t *q, const int8_t *sc, const int8_t *mn,
    const float *d, const float *dmin, const int8_t *xq, const float *xs, const float *xsum, float *y, int ldy) {
    const int groups = k / G;
    const int vecs = G / 4;  // the AVX-512 path's registers of 16 channels x 4 values per group
    __m256 few[2][2], many[MAX_ROWS][2];  // accumulators: in registers up to 2 rows, else in memory
    __m256(*acc)[2] = R <= 2 ? few : many;
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    __m256 dv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dmv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < groups; j++) {
        __m256 ws[2], wm[2];
        for (int h = 0; h < 2; h++) {
            if (j % S == 0) {
                dv[h] = _mm256_loadu_ps(d + (size_t)(j / S) * TILE + 8 * h);
                dmv[h] = _mm256_loadu_ps(dmin + (size_t)(j / S) * TILE + 8 * h);
            }
            ws[h] = _mm256_mul_ps(dv[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                             _mm_loadl_epi64((const __m128i *)(sc + (size_t)j * TILE + 8 * h)))));
            wm[h] = _mm256_mul_ps(dmv[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                              _mm_loadl_epi64((const __m128i *)(mn + (size_t)j * TILE + 8 * h)))));
        }
        prefetch_group(q, sc, mn, j + PREFETCH_GROUPS, G, BITS);
        const uint8_t *p = q + (size_t)j * TILE * G * BITS / 8;
        __m256i w[16], wh[16], xb[8];
        if (R <= 2) {
            for (int h = 0; h < 2; h++) unpack_half(BITS, vecs, p, h, w + h, wh + h, 2);
            for (int r = 0; r < R; r++) {
                const size_t at = (size_t)r * groups + j;
                spread_row(vecs, xq + (size_t)r * k + (size_t)j * G, xb);
                for (int h = 0; h < 2; h++)
                    add_group(&acc[r][h], dot_half(BITS, vecs, w + h, wh + h, 2, xb), ws[h], wm[h], xs[at],
                              xsum[at]);
            }
        } else {
            for (int h = 0; h < 2; h++) {
                unpack_half(BITS, vecs, p, h, w, wh, 1);
#pragma GCC unroll 1
                for (int r = 0; r < R; r++) {
                    const size_t at = (size_t)r * groups + j;
                    spread_row(vecs, xq + (size_t)r * k + (size_t)j * G, xb);
                    add_group(&acc[r][h], dot_half(BITS, vecs, w, wh, 1, xb), ws[h], wm[h], xs[at], xsum[at]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + (size_t)r * ldy, acc[r][0]);
        _mm256_storeu_ps(y + (size_t)r * ldy + 8, acc[r][1]);
    }
}

#else
// Without vector instructions: the same arithmetic one lane at a time (integer dots are exact; the float steps are the
// same operations in the same order, fused where the vector code fuses), so results are bit-identical, slowly.
static inline int value_at(const uint8_t *p, int G, int BITS, int c, int kk) {
    const int vec = kk / 4, r = kk % 4;
    if (BITS == 8) return p[64 * vec + 4 * c + r];
    if (BITS == 2) {
        const int quarter = G / 16;
        return (p[64 * (vec % quarter) + 4 * c + r] >> (2 * (vec / quarter))) & 0x03;
    }
    const int half = G / 8;
    const int low = vec < half ? p[64 * vec + 4 * c + r] & 0x0F : p[64 * (vec - half) + 4 * c + r] >> 4;
    if (BITS == 4) return low;
    return low | ((p[64 * half + 64 * (vec / 4) + 4 * c + r] >> (2 * (vec % 4))) & 0x03) << 4;
}

static void tile_rows(int R, int G, int BITS, int k, int S, const uint8_t *q, const int8_t *sc, const int8_t *mn,
                      const float *d, const float *dmin, const int8_t *xq, const float *xs, const float *xsum,
                      float *y, int ldy) {
    const int groups = k / G;
    float acc[MAX_ROWS][TILE];
    memset(acc, 0, sizeof(acc));
    int16_t w[TILE][32];  // the group's values, unpacked once for every row (loops over them vectorize)
    for (int j = 0; j < groups; j++) {
        const uint8_t *p = q + (size_t)j * TILE * G * BITS / 8;
        for (int c = 0; c < TILE; c++)
            for (int kk = 0; kk < G; kk++) w[c][kk] = (int16_t)value_at(p, G, BITS, c, kk);
        for (int c = 0; c < TILE; c++) {
            const size_t at_s = (size_t)(j / S) * TILE + c, at_g = (size_t)j * TILE + c;
            const float ws = d[at_s] * (float)sc[at_g], wm = dmin[at_s] * (float)mn[at_g];
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + (size_t)r * k + (size_t)j * G;
                int dot = 0;
                for (int kk = 0; kk < G; kk++) dot += w[c][kk] * xr[kk];
                const size_t at = (size_t)r * groups + j;
                acc[r][c] = fmaf((float)dot, ws * xs[at], acc[r][c]);
                acc[r][c] = fmaf(-wm, xsum[at], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++) memcpy(y + (size_t)r * ldy, acc[r], sizeof(acc[r]));
}
#define ALL_ROWS(G, BITS) tile_rows(R, G, BITS, k, S, q, sc, mn, d, dmin, xq, xs, xsum, y, ldy);
#endif
#if DW_ISA != DW_SCALAR  // every R its own unrolled copy
#define ROWS_CASE(R, G, BITS)                                                                            \
    case R:                                                                                              \
        tile_rows(R, G, BITS, k, S, q, sc, mn, d, dmin, xq, xs, xsum, y, ldy);                            \
        break;
#define ALL_ROWS(G, BITS)                                                                                \
    switch (R) {                                                                                         \
        ROWS_CASE(1, G, BITS) ROWS_CASE(2, G, BITS) ROWS_CASE(3, G, BITS) ROWS_CASE(4, G, BITS)              \
        ROWS_CASE(5, G, BITS) ROWS_CASE(6, G, BITS) ROWS_CASE(7, G, BITS) ROWS_CASE(8, G, BITS)              \
        ROWS_CASE(9, G, BITS) ROWS_CASE(10, G, BITS) ROWS_CASE(11, G, BITS) ROWS_CASE(12, G, BITS)           \
        ROWS_CASE(13, G, BITS) ROWS_CASE(14, G, BITS) ROWS_CASE(15, G, BITS) ROWS_CASE(16, G, BITS)          \
    }

#endif

static void tile_dispatch(int R, int G, int bits, int k, int S, const uint8_t *q, const int8_t *sc,
                          const int8_t *mn, const float *d, const float *dmin, const int8_t *xq, const float *xs,
                          const float *xsum, float *y, int ldy) {
    if (G == 32 && bits == 4) {
        ALL_ROWS(32, 4)
    } else if (G == 32 && bits == 2) {
        ALL_ROWS(32, 2)
    } else if (G == 32 && bits == 6) {
        ALL_ROWS(32, 6)
    } else if (G == 32) {
        ALL_ROWS(32, 8)
    } else if (bits == 4) {
        ALL_ROWS(16, 4)
    } else if (bits == 2) {
        ALL_ROWS(16, 2)
    } else if (bits == 6) {
        ALL_ROWS(16, 6)
    } else {
        ALL_ROWS(16, 8)
    }
}

typedef struct {  // one quantized weight, as QuantLinear keeps it
    int n, k, g, s, bits;
    const uint8_t *q;
    const int8_t *sc, *mn;
    const float *d, *dmin;
} dw_weight;

// Whether the kernel takes w's shape: n a multiple of 16, k of g * s (g 16 or 32), bits 2, 4, 6 or 8.
static int weight_takes(const dw_weight *w) {
    return !(w->n % TILE) && (w->g == 16 || w->g == 32) && !(w->k % (w->g * w->s)) &&
           (w->bits == 2 || w->bits == 4 || w->bits == 6 || w->bits == 8);
}

// Tile t of w over every row of the quantized rows into y [rows, w->n].
static void weight_tile(const dw_weight *w, int t, const int8_t *xq, const float *xs, const float *xsum, int rows,
                        float *y) {
    const int groups = w->k / w->g;
    const size_t q_tile = (size_t)groups * TILE * w->g * w->bits / 8;
    const size_t m_tile = (size_t)groups * TILE, d_tile = (size_t)(groups / w->s) * TILE;
    for (int r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int R = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
        tile_dispatch(R, w->g, w->bits, w->k, w->s, w->q + t * q_tile, w->sc + t * m_tile, w->mn + t * m_tile,
                      w->d + t * d_tile, w->dmin + t * d_tile, xq + (size_t)r0 * w->k, xs + (size_t)r0 * groups,
                      xsum + (size_t)r0 * groups, y + (size_t)r0 * w->n + (size_t)t * TILE, w->n);
    }
}

// y [rows, n] = quantized rows . W^T. n: a multiple of 16; k: a multiple of g (16 or 32); bits: 2, 4, 6 or 8.
// Layouts, tile t = n / 16 outermost: q [t][k/g][16 * g (/ 2)], sc and mn [t][k/g][16], d and dmin
// [t][k/(g*s)][16]. Returns 0, or -1 for a shape it does not take.
int dw_qgemm(const int8_t *xq, const float *xs, const float *xsum, int rows, int n, int k, int g, int s,
             int bits, const uint8_t *q, const int8_t *sc, const int8_t *mn, const float *d, const float *dmin,
             float *y) {
    const dw_weight w = {n, k, g, s, bits, q, sc, mn, d, dmin};
    if (!weight_takes(&w)) return -1;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n / TILE; t++) weight_tile(&w, t, xq, xs, xsum, rows, y);
    return 0;
}

// x [rows, k] float32 -> y [rows, n]: quantize the rows, then multiply (one call from Python, not two).
int dw_linear(const float *x, int rows, int n, int k, int g, int s, int bits, const uint8_t *q, const int8_t *sc,
              const int8_t *mn, const float *d, const float *dmin, float *y) {
    if (k % g) return -1;
    int8_t *xq = malloc((size_t)rows * k);
    float *xs = malloc(sizeof(float) * (size_t)rows * (k / g)), *xsum = malloc(sizeof(float) * (size_t)rows * (k / g));
    int status = -2;
    if (xq && xs && xsum) {
        dw_quantize_rows(x, rows, k, g, xq, xs, xsum);
        status = dw_qgemm(xq, xs, xsum, rows, n, k, g, s, bits, q, sc, mn, d, dmin, y);
    }
    free(xq);
    free(xs);
    free(xsum);
    return status;
}

// Attention for a few queries, each row on its own: out [B, n, H, d] from q [B, H, n, d], k and v [B, Hkv, L, d]
// (strides in floats; the last dimension contiguous) and visible [B, n, L] (1: the query sees that key).
// Why not a library's: their kernels block keys and queries by the call's shape, so a query's result changes
// with how many others share the call and with the cache's length; here a query's scores, softmax and weighted
// sum visit exactly its visible keys in key order, in fixed 16-lane partial sums, whatever the call holds.
#define LANES 16
// sum of a[i] * b[i] in 16 lanes (lane i % 16 fused-multiply-adds its elements in order), then the lanes added
// pairwise (8 + 8, 4 + 4, 2 + 2, 1 + 1): the vector and scalar paths below give the same bits.
static inline float dot_lanes(const float *a, const float *b, int d) {
    float part[LANES];
#if DW_VNNI
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + LANES <= d; i += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < d) {
        const __mmask16 m = (__mmask16)((1u << (d - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    _mm512_storeu_ps(part, acc);
#elif DW_AVX
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0 to 7 and 8 to 15
    int i = 0;
    for (; i + LANES <= d; i += LANES) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    if (i < d) {  // the lanes past d add fma(0, 0, lane), as the masked loads of the AVX-512 path do
        const __m256i left = _mm256_set1_epi32(d - i), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i m0 = _mm256_cmpgt_epi32(left, lane);
        const __m256i m1 = _mm256_cmpgt_epi32(left, _mm256_add_epi32(lane, _mm256_set1_epi32(8)));
        lo = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m0), _mm256_maskload_ps(b + i, m0), lo);
        hi = _mm256_fmadd_ps(_mm256_maskload_ps(a + i + 8, m1), _mm256_maskload_ps(b + i + 8, m1), hi);
    }
    _mm256_storeu_ps(part, lo);
    _mm256_storeu_ps(part + 8, hi);
#if DW_TEST_OTHER_ORDER  // (the control: the lanes added one after another)
    for (int l = 1; l < LANES; l++) part[0] += part[l];
    return part[0];
#endif
#else
    for (int l = 0; l < LANES; l++) part[l] = 0.0f;
    int i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] = fmaf(a[i + l], b[i + l], part[l]);
    if (i < d)
        for (int l = 0; l < LANES; l++) part[l] = i + l < d ? fmaf(a[i + l], b[i + l], part[l]) : fmaf(0.0f, 0.0f, part[l]);
#endif
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) part[l] += part[l + w];
    return part[0];
}

// o[i] += p * v[i], fused, for i < d.
static inline void add_scaled(float *o, float p, const float *v, int d) {
    int i = 0;
#if DW_VNNI
    const __m512 pv = _mm512_set1_ps(p);
    for (; i + LANES <= d; i += LANES)
        _mm512_storeu_ps(o + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + i), _mm512_loadu_ps(o + i)));
#elif DW_AVX
    const __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
#endif
    for (; i < d; i++) o[i] = fmaf(p, v[i], o[i]);
}

// exp(x) by a fixed polynomial: the same bits on every path, and loops of it vectorize (libm's expf is a call).
// 2^f's Taylor coefficients, highest power first: one table, so that every path's polynomial is the same one.
static const float EXP_POLY[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                  5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

static inline float exp_fixed(float x) {
    x = fminf(fmaxf(x, -87.0f), 88.0f);
    const float t = x * 1.44269504088896341f;
    const float n = nearbyintf(t);
    const float f = t - n;  // [-0.5, 0.5]: 2^f by its Taylor polynomial, 2^n by the exponent bits
    float p = EXP_POLY[0];
    for (int i = 1; i < 7; i++) p = p * f + EXP_POLY[i];
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

#define MAX_GROUP 32  // query heads a key/value head serves

#define KEY_BLOCK 16  // keys scored together: one register of 16 partial sums each

#if DW_VNNI
// dot_lanes' pairwise tree over 16 keys' registers of lane sums (acc[j]: key j's 16 lanes), each level one add over
// two keys' registers, so the sixteen keys' reductions cost what one key's did: the sums, key j in element j, scaled.
static inline __attribute__((always_inline)) __m512 score_tree(const __m512 *acc, float scale) {
    // lane l + lane l + 8, two keys a register: [a 0-7 | b 0-7]
    __m512 r1[8];
    for (int p = 0; p < 8; p++)
        r1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // l + l + 4, four keys a register, one 128-bit lane each: [a 0-3 | b 0-3 | c 0-3 | d 0-3]
    __m512 r2[4];
    for (int p = 0; p < 4; p++)
        r2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[2 * p], r1[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(r1[2 * p], r1[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    // l + l + 2: 128-bit lane c holds keys c and c + 4 (of r2[0], r2[1]), or c + 8 and c + 12
    __m512 r3[2];
    for (int p = 0; p < 2; p++)
        r3[p] = _mm512_add_ps(_mm512_shuffle_ps(r2[2 * p], r2[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(r2[2 * p], r2[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // l + l + 1: element 4c + e is key c + 4e's sum; put each key in its place
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i place = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_mul_ps(_mm512_permutexvar_ps(place, sums), _mm512_set1_ps(scale));
}

// s[j] = dot_lanes(q, k + j * kt, d) * scale for the 16 keys j of a block (rows past count repeat the last one; their
// scores are not used): the same fused multiply-adds into 16 lanes per key, then score_tree.
static inline void score_block(const float *q, const float *k, long kt, int count, int d, float scale, float *s) {
    const float *row[KEY_BLOCK];
    for (int j = 0; j < KEY_BLOCK; j++) row[j] = k + (long)(j < count ? j : count - 1) * kt;
    __m512 acc[KEY_BLOCK];
    for (int j = 0; j < KEY_BLOCK; j++) acc[j] = _mm512_setzero_ps();
    int i = 0;
    for (; i + LANES <= d; i += LANES) {
        const __m512 qv = _mm512_loadu_ps(q + i);
        for (int j = 0; j < KEY_BLOCK; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(row[j] + i), acc[j]);
    }
    if (i < d) {
        const __mmask16 m = (__mmask16)((1u << (d - i)) - 1);
        const __m512 qv = _mm512_maskz_loadu_ps(m, q + i);
        for (int j = 0; j < KEY_BLOCK; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, row[j] + i), acc[j]);
    }
    _mm512_storeu_ps(s, score_tree(acc, scale));
}

// score_block over a whole block whose rows lie D floats apart (the cache's own layout, D a head size known here):
// each row's offset a constant, so no row pointer is held in a register or read back; the same operations.
static inline __attribute__((always_inline)) void score_packed(const int D, const float *q, const float *k,
                                                               float scale, float *s) {
    __m512 acc[KEY_BLOCK];
    for (int j = 0; j < KEY_BLOCK; j++) acc[j] = _mm512_setzero_ps();
    for (int i = 0; i < D; i += LANES) {
        const __m512 qv = _mm512_loadu_ps(q + i);
        for (int j = 0; j < KEY_BLOCK; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + j * D + i), acc[j]);
    }
    _mm512_storeu_ps(s, score_tree(acc, scale));
}
#define SCORE_PACKED 1

// exp_fixed on 16 lanes: each of its operations, in its order.
static inline __m512 exp_fixed16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(EXP_POLY[i]));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// which of 16 keys a query sees (seen's bytes nonzero)
static inline __mmask16 seen16(const uint8_t *seen) {
    return _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)seen)), _mm512_set1_epi32(0xFF));
}

#define VALUE_REGS 8  // registers of o held while the keys go by (128 floats)
// o [d] = the sum over the keys it sees of p[j] * v_j, as add_scaled's key by key (the same fused multiply-add on
// each element, keys in order), with o in registers rather than read and written back for every key.
static inline void weigh_values(float *o, const float *p, const uint8_t *sees, const float *v, long vt, int keys, int d) {
    for (int c0 = 0; c0 < d; c0 += VALUE_REGS * LANES) {
        const int regs = (d - c0 + LANES - 1) / LANES < VALUE_REGS ? (d - c0 + LANES - 1) / LANES : VALUE_REGS;
        const int tail = (d - c0) - (regs - 1) * LANES;  // lanes of the last register in use (1 to 16)
        const __mmask16 last = (__mmask16)(tail == LANES ? 0xFFFF : (1u << tail) - 1);
        __m512 acc[VALUE_REGS];
        for (int r = 0; r < VALUE_REGS; r++) acc[r] = _mm512_setzero_ps();
        if (regs == VALUE_REGS && tail == LANES) {  // (the common case, 128 floats: no mask in the loop)
            for (int j = 0; j < keys; j++) {
                if (!sees[j]) continue;
                const __m512 pv = _mm512_set1_ps(p[j]);
                const float *vj = v + (long)j * vt + c0;
                for (int r = 0; r < VALUE_REGS; r++) acc[r] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vj + r * LANES), acc[r]);
            }
        } else {
            for (int j = 0; j < keys; j++) {
                if (!sees[j]) continue;
                const __m512 pv = _mm512_set1_ps(p[j]);
                const float *vj = v + (long)j * vt + c0;
                for (int r = 0; r < regs; r++)
                    acc[r] = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(r < regs - 1 ? 0xFFFF : last, vj + r * LANES),
                                             acc[r]);
            }
        }
        for (int r = 0; r < regs; r++) _mm512_mask_storeu_ps(o + c0 + r * LANES, r < regs - 1 ? 0xFFFF : last, acc[r]);
    }
}
#elif DW_AVX && !DW_TEST_OTHER_ORDER
// The AVX-512 path's score_block on 256-bit registers, four keys at a time: each key's lanes 0-7 and 8-15 in two
// registers (dot_lanes' lo and hi), added (8 + 8), then the tree's last three levels across the four keys' registers.
static inline __attribute__((always_inline)) void score_four(const float *q, const float *const *row, int d,
                                                             float scale, float *s) {
    __m256 lo[4], hi[4];
    for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    int i = 0;
    for (; i + LANES <= d; i += LANES) {
        const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
        for (int j = 0; j < 4; j++) {
            lo[j] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(row[j] + i), lo[j]);
            hi[j] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(row[j] + i + 8), hi[j]);
        }
    }
    if (i < d) {  // as dot_lanes: the lanes past d add fma(0, 0, lane)
        const __m256i left = _mm256_set1_epi32(d - i), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i m0 = _mm256_cmpgt_epi32(left, lane);
        const __m256i m1 = _mm256_cmpgt_epi32(left, _mm256_add_epi32(lane, _mm256_set1_epi32(8)));
        const __m256 q0 = _mm256_maskload_ps(q + i, m0), q1 = _mm256_maskload_ps(q + i + 8, m1);
        for (int j = 0; j < 4; j++) {
            lo[j] = _mm256_fmadd_ps(q0, _mm256_maskload_ps(row[j] + i, m0), lo[j]);
            hi[j] = _mm256_fmadd_ps(q1, _mm256_maskload_ps(row[j] + i + 8, m1), hi[j]);
        }
    }
    __m256 r1[4];  // l + l + 8
    for (int j = 0; j < 4; j++) r1[j] = _mm256_add_ps(lo[j], hi[j]);
    // l + l + 4, two keys a register: [a 0-3 | b 0-3], [c 0-3 | d 0-3]
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(r1[0], r1[1], 0x20), _mm256_permute2f128_ps(r1[0], r1[1], 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(r1[2], r1[3], 0x20), _mm256_permute2f128_ps(r1[2], r1[3], 0x31));
    // l + l + 2: [a0 a1 c0 c1 | b0 b1 d0 d1]
    const __m256 r3 = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    // l + l + 1: [a c a c | b d b d]
    float sums[8];
    _mm256_storeu_ps(sums, _mm256_mul_ps(_mm256_hadd_ps(r3, r3), _mm256_set1_ps(scale)));
    s[0] = sums[0], s[1] = sums[4], s[2] = sums[1], s[3] = sums[5];
}

static inline void score_block(const float *q, const float *k, long kt, int count, int d, float scale, float *s) {
    for (int j0 = 0; j0 < count; j0 += 4) {
        const float *row[4];
        for (int j = 0; j < 4; j++) row[j] = k + (long)(j0 + j < count ? j0 + j : count - 1) * kt;
        float four[4];
        score_four(q, row, d, scale, four);
        for (int j = 0; j < 4 && j0 + j < count; j++) s[j0 + j] = four[j];
    }
}

// score_block over a whole block whose rows lie D floats apart (the cache's own layout, D a head size known here):
// the rows' addresses computed from one, the same operations.
static inline __attribute__((always_inline)) void score_packed(const int D, const float *q, const float *k,
                                                               float scale, float *s) {
    for (int j0 = 0; j0 < KEY_BLOCK; j0 += 4) {
        const float *row[4] = {k + j0 * D, k + (j0 + 1) * D, k + (j0 + 2) * D, k + (j0 + 3) * D};
        score_four(q, row, D, scale, s + j0);
    }
}
#define SCORE_PACKED 1

#define VALUE_REGS 8  // registers of o held while the keys go by (64 floats)
// as the AVX-512 path's: add_scaled key by key (8-lane fused multiply-adds, then fmaf for the elements past the last
// full register, which a masked register's lanes compute alike), o held in registers
static inline void weigh_values(float *o, const float *p, const uint8_t *sees, const float *v, long vt, int keys, int d) {
    const int whole = d / (VALUE_REGS * 8) * (VALUE_REGS * 8);
    for (int c0 = 0; c0 < whole; c0 += VALUE_REGS * 8) {
        __m256 acc[VALUE_REGS];
        for (int r = 0; r < VALUE_REGS; r++) acc[r] = _mm256_setzero_ps();
        for (int j = 0; j < keys; j++) {
            if (!sees[j]) continue;
            const __m256 pv = _mm256_set1_ps(p[j]);
            const float *vj = v + (long)j * vt + c0;
            for (int r = 0; r < VALUE_REGS; r++) acc[r] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + r * 8), acc[r]);
        }
        for (int r = 0; r < VALUE_REGS; r++) _mm256_storeu_ps(o + c0 + r * 8, acc[r]);
    }
    if (whole < d) {  // the rest key by key, as add_scaled does it
        for (int c = whole; c < d; c++) o[c] = 0.0f;
        for (int j = 0; j < keys; j++)
            if (sees[j]) add_scaled(o + whole, p[j], v + (long)j * vt + whole, d - whole);
    }
}
#endif
#if DW_AVX
// exp_fixed on 8 lanes: each of its operations, in its order (vroundps to nearest under the default rounding mode is
// nearbyintf).
static inline __m256 exp_fixed8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(EXP_POLY[i]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// which of 8 keys a query sees: all ones in the lanes whose seen byte is nonzero
static inline __m256 seen8(const uint8_t *seen) {
    int64_t bytes;
    memcpy(&bytes, seen, 8);
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpeq_epi32(wide, _mm256_setzero_si256()), _mm256_set1_epi32(-1)));
}
#endif
#if !(DW_VNNI || (DW_AVX && !DW_TEST_OTHER_ORDER))
static inline void score_block(const float *q, const float *k, long kt, int count, int d, float scale, float *s) {
    for (int j = 0; j < count; j++) s[j] = dot_lanes(q, k + (long)j * kt, d) * scale;
}

static inline void weigh_values(float *o, const float *p, const uint8_t *sees, const float *v, long vt, int keys, int d) {
    for (int c = 0; c < d; c++) o[c] = 0.0f;
    for (int j = 0; j < keys; j++)
        if (sees[j]) add_scaled(o, p[j], v + (long)j * vt, d);
}
#endif

// A token's query heads share what they see: weigh_group writes o [group, d] (query g's weights p + g * ps), reading
// each value row once for all of them rather than once a head. Each element is the same chain of fused multiply-adds
// over the visible keys in key order as weigh_values', so the bits are those of each query alone.
#if DW_VNNI
#define WEIGH_LANES LANES  // floats a register
#define WEIGH_MAX 8        // queries a pass: 2 registers of o each, 16 of the 32
typedef __m512 weigh_reg;
#define WEIGH_ZERO() _mm512_setzero_ps()
#define WEIGH_LOAD(p) _mm512_loadu_ps(p)
#define WEIGH_FMA(p, v, acc) _mm512_fmadd_ps(_mm512_set1_ps(p), v, acc)
#define WEIGH_STORE(o, r) _mm512_storeu_ps(o, r)
#elif DW_AVX && !DW_TEST_OTHER_ORDER
#define WEIGH_LANES 8
#define WEIGH_MAX 6  // 12 registers of o, 2 of values, 1 weight: 15 of the 16
typedef __m256 weigh_reg;
#define WEIGH_ZERO() _mm256_setzero_ps()
#define WEIGH_LOAD(p) _mm256_loadu_ps(p)
#define WEIGH_FMA(p, v, acc) _mm256_fmadd_ps(_mm256_set1_ps(p), v, acc)
#define WEIGH_STORE(o, r) _mm256_storeu_ps(o, r)
#endif
#ifdef WEIGH_LANES
#define WEIGH_CHUNK (2 * WEIGH_LANES)  // output columns a pass holds: two registers a query
#define WEIGH_SPAN_BYTES 16384  // value rows weighed for every token of a tile while they are in the L1 (d * 4 a row)
// QN queries (a constant in each inlined copy) over keys [j0, j1), d a multiple of WEIGH_CHUNK: each element's chain
// of fused multiply-adds goes on from what o holds when j0 > 0 (a float stored and read back is the same float).
static inline __attribute__((always_inline)) void weigh_pass(const int QN, float *o, const float *p, long ps,
                                                             const uint8_t *sees, const float *v, long vt, int j0,
                                                             int j1, int d) {
    for (int c0 = 0; c0 < d; c0 += WEIGH_CHUNK) {
        weigh_reg acc[2 * WEIGH_MAX];
        for (int g = 0; g < QN; g++) {
            acc[2 * g] = j0 ? WEIGH_LOAD(o + (long)g * d + c0) : WEIGH_ZERO();
            acc[2 * g + 1] = j0 ? WEIGH_LOAD(o + (long)g * d + c0 + WEIGH_LANES) : WEIGH_ZERO();
        }
        for (int j = j0; j < j1; j++) {
            if (!sees[j]) continue;
            const float *vj = v + (long)j * vt + c0;
            const weigh_reg v0 = WEIGH_LOAD(vj), v1 = WEIGH_LOAD(vj + WEIGH_LANES);
            for (int g = 0; g < QN; g++) {
                acc[2 * g] = WEIGH_FMA(p[g * ps + j], v0, acc[2 * g]);
                acc[2 * g + 1] = WEIGH_FMA(p[g * ps + j], v1, acc[2 * g + 1]);
            }
        }
        for (int g = 0; g < QN; g++) {
            WEIGH_STORE(o + (long)g * d + c0, acc[2 * g]);
            WEIGH_STORE(o + (long)g * d + c0 + WEIGH_LANES, acc[2 * g + 1]);
        }
    }
}

// weigh_pass for all group queries of a token over keys [j0, j1), as many at a time as the registers hold.
static void weigh_span(float *o, const float *p, long ps, const uint8_t *sees, const float *v, long vt, int j0, int j1,
                       int group, int d) {
    for (int g0 = 0; g0 < group;) {
        const int passes = (group - g0 + WEIGH_MAX - 1) / WEIGH_MAX;
        const int qn = (group - g0 + passes - 1) / passes;  // balanced: 7 on 6 a pass is 4 and 3, not 6 and 1
        float *og = o + (long)g0 * d;
        const float *pg = p + g0 * ps;
        switch (qn) {
#define WEIGH_CASE(N) \
    case N: weigh_pass(N, og, pg, ps, sees, v, vt, j0, j1, d); break;
            WEIGH_CASE(1) WEIGH_CASE(2) WEIGH_CASE(3) WEIGH_CASE(4) WEIGH_CASE(5) WEIGH_CASE(6)
#if WEIGH_MAX > 6
            WEIGH_CASE(7) WEIGH_CASE(8)
#endif
#undef WEIGH_CASE
        }
        g0 += qn;
    }
}
#endif

// The values weighed for a tile of tokens: token t's o [group, d] at out + t * ot, its weights p + t * group * ps
// (query g's at g * ps), its keys [0, ends[t]) as seen + t * keys shows them. Where the registers' path runs, the keys
// go by a span at a time, each span's rows read once from memory for every token and query of the tile (a
// verification pass's tokens would otherwise each stream the values again); elsewhere token by token, key by key.
// Either way each element is the same chain of fused multiply-adds over its visible keys in key order as
// weigh_values', so the bits are those of each query alone.
static void weigh_tile(float *out, long ot, const float *p, long ps, const uint8_t *seen, int keys, const int *ends,
                       int tokens, int reach, const float *v, long vt, int group, int d) {
#ifdef WEIGH_LANES
    if (d % WEIGH_CHUNK == 0) {
        const int span = d * 4 >= WEIGH_SPAN_BYTES ? 1 : WEIGH_SPAN_BYTES / (d * 4);
        for (int j0 = 0; j0 == 0 || j0 < reach; j0 += span)  // (j0 = 0 always: a token that sees nothing gets zeros)
            for (int t = 0; t < tokens; t++)
                if (j0 == 0 || j0 < ends[t])
                    weigh_span(out + (size_t)t * ot, p + (size_t)t * group * ps, ps, seen + (size_t)t * keys, v, vt,
                               j0, j0 + span < ends[t] ? j0 + span : ends[t], group, d);
        return;
    }
#endif
    (void)reach;
    for (int t = 0; t < tokens; t++)
        for (int g = 0; g < group; g++)
            weigh_values(out + (size_t)t * ot + (long)g * d, p + ((size_t)t * group + g) * ps, seen + (size_t)t * keys,
                         v, vt, ends[t], d);
}

// A query's weights over keys [0, end) in place: sg's scores become exp(score - their maximum) where it sees the
// key and an exact zero where it does not (their total: key_order_totals).
static void softmax_weights(float *sg, const uint8_t *sees, int end) {
    float top = -INFINITY;
    int j = 0;
#if DW_VNNI
    __m512 tops = _mm512_set1_ps(-INFINITY);  // (a maximum is the same in any order)
    for (; j + LANES <= end; j += LANES)
        tops = _mm512_mask_max_ps(tops, seen16(sees + j), tops, _mm512_loadu_ps(sg + j));
    top = _mm512_reduce_max_ps(tops);
#elif DW_AVX
    __m256 tops = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= end; j += 8)
        tops = _mm256_max_ps(tops, _mm256_blendv_ps(tops, _mm256_loadu_ps(sg + j), seen8(sees + j)));
    float eight[8];
    _mm256_storeu_ps(eight, tops);
    for (int l = 0; l < 8; l++) top = fmaxf(top, eight[l]);
#endif
    for (; j < end; j++)
        if (sees[j]) top = fmaxf(top, sg[j]);
    j = 0;
#if DW_VNNI
    for (; j + LANES <= end; j += LANES) {  // hidden keys weigh an exact zero
        const __m512 e = exp_fixed16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), _mm512_set1_ps(top)));
        _mm512_storeu_ps(sg + j, _mm512_maskz_mov_ps(seen16(sees + j), e));
    }
#elif DW_AVX
    for (; j + 8 <= end; j += 8) {
        const __m256 e = exp_fixed8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), _mm256_set1_ps(top)));
        _mm256_storeu_ps(sg + j, _mm256_and_ps(e, seen8(sees + j)));
    }
#endif
    for (; j < end; j++) sg[j] = sees[j] ? exp_fixed(sg[j] - top) : 0.0f;
}

// total[g] = the sum of row g of w [QN, end] (rows ws apart), added in key order from zero (a hidden key adds its
// exact zero). The rows' sums are independent chains, run side by side: one alone waits on every add.
static inline __attribute__((always_inline)) void totals_pass(const int QN, const float *w, long ws, int end,
                                                              float *total) {
    float t[8];
    for (int g = 0; g < QN; g++) t[g] = 0.0f;
    for (int j = 0; j < end; j++)
        for (int g = 0; g < QN; g++) t[g] += w[g * ws + j];
    for (int g = 0; g < QN; g++) total[g] = t[g];
}

static void key_order_totals(const float *w, long ws, int group, int end, float *total) {
    for (int g0 = 0; g0 < group; g0 += 8) {
        switch (group - g0 < 8 ? group - g0 : 8) {
#define TOTALS_CASE(N) \
    case N: totals_pass(N, w + g0 * ws, ws, end, total + g0); break;
            TOTALS_CASE(1) TOTALS_CASE(2) TOTALS_CASE(3) TOTALS_CASE(4) TOTALS_CASE(5) TOTALS_CASE(6) TOTALS_CASE(7)
            TOTALS_CASE(8)
#undef TOTALS_CASE
        }
    }
}

#define TOKEN_TILE 16  // query tokens scored together: their scores (16 x group x keys floats) stay in the caches

// One past the last key a row of seen [keys] shows: none at or past it is visible, so nothing there is computed.
static inline int visible_end(const uint8_t *sees, int keys) {
    int end = keys;
    while (end > 0 && !sees[end - 1]) end--;
    return end;
}

// One key head's queries over its keys: q [n, group, d] at strides (qt per token, qh per head), keys and values at
// kt and vt per position, seen [n, keys]; out [n, group, d] at ot per token. score: TOKEN_TILE x group x keys floats.
static void attend_group(const float *q, long qh, long qt, const float *k, long kt, const float *v, long vt,
                         const uint8_t *seen, int n, int group, int keys, int d, float scale, float *score, float *out,
                         long ot) {
    for (int t0 = 0; t0 < n; t0 += TOKEN_TILE) {
        const int tokens = n - t0 < TOKEN_TILE ? n - t0 : TOKEN_TILE;
        int ends[TOKEN_TILE], reach = 0;  // each token's visible_end; the tile's furthest
        for (int t = 0; t < tokens; t++) {
            ends[t] = visible_end(seen + (size_t)(t0 + t) * keys, keys);
            reach = ends[t] > reach ? ends[t] : reach;
        }
        for (int j0 = 0; j0 < reach; j0 += KEY_BLOCK) {  // the tile's scores, a block of keys at a time
            const int count = reach - j0 < KEY_BLOCK ? reach - j0 : KEY_BLOCK;
            const float *kb = k + (long)j0 * kt;
#ifdef SCORE_PACKED
            // a whole block in the cache's own layout, at a head size score_packed is built for: its size, else 0
            const int packed = count == KEY_BLOCK && kt == d && (d == 64 || d == 128) ? d : 0;
#endif
            float s[KEY_BLOCK];
            for (int t = 0; t < tokens; t++) {
                if (ends[t] <= j0) continue;  // (sees none of the block)
                for (int g = 0; g < group; g++) {
                    const float *qg = q + (t0 + t) * qt + g * qh;
                    float *to = score + ((size_t)t * group + g) * keys + j0;
#ifdef SCORE_PACKED
                    if (packed) {  // (a constant head size in each copy: the rows' offsets known)
                        if (packed == 64) score_packed(64, qg, kb, scale, to);
                        else score_packed(128, qg, kb, scale, to);
                        continue;
                    }
#endif
                    score_block(qg, kb, kt, count, d, scale, s);
                    memcpy(to, s, sizeof(float) * count);
                }
            }
        }
        float total[TOKEN_TILE][MAX_GROUP];
        for (int t = 0; t < tokens; t++) {
            const uint8_t *sees = seen + (size_t)(t0 + t) * keys;
            float *sg = score + (size_t)t * group * keys;  // [group, keys]
            for (int g = 0; g < group; g++) softmax_weights(sg + (size_t)g * keys, sees, ends[t]);
            key_order_totals(sg, keys, group, ends[t], total[t]);
        }
        weigh_tile(out + (size_t)t0 * ot, ot, score, keys, seen + (size_t)t0 * keys, keys, ends, tokens, reach, v, vt,
                   group, d);
        for (int t = 0; t < tokens; t++) {
            float *o = out + (size_t)(t0 + t) * ot;  // [group, d]
            for (int g = 0; g < group; g++) {
                const float inv = total[t][g] > 0.0f ? 1.0f / total[t][g] : 0.0f;  // sees nothing: zeros
                for (int c = 0; c < d; c++) o[(size_t)g * d + c] *= inv;
            }
        }
    }
}

// cache_rows [batch] (or NULL: b itself): which row of k and v batch row b reads, so a forward over slots that are not
// next to each other reads the cache in place.
//
// Each (sequence, key head) is one work item: its queries (a tile of tokens x the group's query heads) are scored
// against a block of KEY_BLOCK keys at a time, so a key's row is read from memory once for all of them, and a
// token's heads weigh the values together; keys past the last one a token sees are skipped (a causal prefill's
// upper triangle). The arithmetic per query is dot_lanes, exp_fixed and add_scaled's, in key order, whatever the
// loop around it: the same bits as one query alone.
static int attend(const float *q, long qb, long qh, long qt, const float *k, long kb, long kh, long kt, const float *v,
                  long vb, long vh, long vt, const int64_t *cache_rows, const uint8_t *visible, int batch, int heads,
                  int kv_heads, int n, int keys, int d, float scale, float *out) {
    if (heads % kv_heads || heads / kv_heads > MAX_GROUP) return -1;
    const int group = heads / kv_heads, tile = n < TOKEN_TILE ? n : TOKEN_TILE;
    int failed = 0;
#pragma omp parallel
    {
        float *score = malloc(sizeof(float) * (size_t)tile * group * (size_t)(keys > 0 ? keys : 1));
        if (!score) failed = 1;
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < batch; b++)
            for (int kvh = 0; kvh < kv_heads; kvh++) {
                if (!score) continue;
                const long row = cache_rows ? (long)cache_rows[b] : b;
                attend_group(q + b * qb + kvh * group * qh, qh, qt, k + row * kb + kvh * kh, kt, v + row * vb + kvh * vh,
                             vt, visible + (size_t)b * n * keys, n, group, keys, d, scale, score,
                             out + (size_t)b * n * heads * d + (size_t)kvh * group * d, heads * d);
            }
        free(score);
    }
    return failed ? -2 : 0;
}

int dw_attention(const float *q, long qb, long qh, long qt, const float *k, long kb, long kh, long kt, const float *v,
                 long vb, long vh, long vt, const uint8_t *visible, int batch, int heads, int kv_heads, int n, int keys,
                 int d, float scale, float *out) {
    return attend(q, qb, qh, qt, k, kb, kh, kt, v, vb, vh, vt, NULL, visible, batch, heads, kv_heads, n, keys, d, scale,
                  out);
}

// ---- a decoder layer's pieces in one call each: fewer trips through Python and PyTorch's dispatch, which at a
// few rows cost as much as the arithmetic. Each is row by row, so batch invariance holds as above.

static int weight_rows(const dw_weight *w, const float *x, int rows, float *y) {
    return dw_linear(x, rows, w->n, w->k, w->g, w->s, w->bits, w->q, w->sc, w->mn, w->d, w->dmin, y);
}

#define MAX_WEIGHTS 3
// y[i] [rows, w[i]->n] = x [rows, k] . w[i]^T for up to three weights of one input (q, k and v; gate and up): x
// quantized once per group size, every weight's tiles in one parallel loop, so the threads meet once, not once a
// weight. Each tile is computed as dw_linear computes it: the same bits.
static int weights_rows(const dw_weight *const *w, int count, const float *x, int rows, float *const *y) {
    if (count < 1 || count > MAX_WEIGHTS) return -1;
    const int k = w[0]->k;
    int tiles = 0, first[MAX_WEIGHTS + 1];
    for (int i = 0; i < count; i++) {
        if (w[i]->k != k || !weight_takes(w[i])) return -1;
        first[i] = tiles;
        tiles += w[i]->n / TILE;
    }
    first[count] = tiles;
    int8_t *xq[2] = {NULL, NULL};  // by group size: 16, 32
    float *xs[2] = {NULL, NULL}, *xsum[2] = {NULL, NULL};
    int status = 0;
    for (int i = 0; i < count && !status; i++) {
        const int at = w[i]->g == 32;
        if (xq[at]) continue;
        xq[at] = malloc((size_t)rows * k);
        xs[at] = malloc(sizeof(float) * (size_t)rows * (k / w[i]->g));
        xsum[at] = malloc(sizeof(float) * (size_t)rows * (k / w[i]->g));
        if (!xq[at] || !xs[at] || !xsum[at]) status = -2;
        else dw_quantize_rows(x, rows, k, w[i]->g, xq[at], xs[at], xsum[at]);
    }
    if (!status) {
#pragma omp parallel for schedule(static)
        for (int t = 0; t < tiles; t++) {
            int i = 0;
            while (t >= first[i + 1]) i++;
            const int at = w[i]->g == 32;
            weight_tile(w[i], t - first[i], xq[at], xs[at], xsum[at], rows, y[i]);
        }
    }
    for (int at = 0; at < 2; at++) {
        free(xq[at]);
        free(xs[at]);
        free(xsum[at]);
    }
    return status;
}

// y [rows, h] = weight * x * 1 / sqrt(mean(x^2) + eps), the sum of squares in fixed 16-lane partials.
void dw_rmsnorm(const float *x, int rows, int h, const float *weight, float eps, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *v = x + (size_t)r * h;
        const float mean = dot_lanes(v, v, h) / (float)h;
        const float inv = 1.0f / sqrtf(mean + eps);
        for (int i = 0; i < h; i++) y[(size_t)r * h + i] = weight[i] * (v[i] * inv);
    }
}

// a[i] = silu(a[i]) * b[i] = a[i] / (1 + exp_fixed(-a[i])) * b[i], on the widest registers the path has: each lane
// the scalar loop's operations in its order (a step of a 1.5B model spent 1 ms of its 40 in the scalar loop).
static void silu_mul(float *a, const float *b, size_t width) {
    size_t i = 0;
#if DW_VNNI
    const __m512i sign = _mm512_set1_epi32((int)0x80000000);
    for (; i + 16 <= width; i += 16) {
        const __m512 x = _mm512_loadu_ps(a + i);
        const __m512 e = exp_fixed16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign)));  // -x
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(s, _mm512_loadu_ps(b + i)));
    }
#elif DW_AVX
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= width; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        const __m256 e = exp_fixed8(_mm256_xor_ps(x, sign));  // -x
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(s, _mm256_loadu_ps(b + i)));
    }
#endif
    for (; i < width; i++) a[i] = a[i] / (1.0f + exp_fixed(-a[i])) * b[i];
}

// y [rows, hidden] = down(silu(gate(x)) * up(x)), x [rows, hidden].
int dw_mlp(const float *x, int rows, const dw_weight *gate, const dw_weight *up, const dw_weight *down, float *y) {
    const size_t width = (size_t)rows * gate->n;
    float *a = malloc(sizeof(float) * width), *b = malloc(sizeof(float) * width);
    int status = -2;
    const dw_weight *both[2] = {gate, up};
    float *into[2] = {a, b};
    if (a && b && !(status = weights_rows(both, 2, x, rows, into))) {
        silu_mul(a, b, width);
        status = weight_rows(down, a, rows, y);
    }
    free(a);
    free(b);
    return status;
}

// Rotary embedding in place on x [rows, heads, d] (rotate-half form), cos and sin [rows, d].
static void rope(float *x, int rows, int heads, int d, const float *cos, const float *sin) {
    const int half = d / 2;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            float *v = x + ((size_t)r * heads + h) * d;
            const float *c = cos + (size_t)r * d, *s = sin + (size_t)r * d;
            for (int i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                const float lo = a * c[i] - b * s[i], hi = b * c[i + half] + a * s[i + half];
                v[i] = lo;
                v[i + half] = hi;
            }
        }
}

// q [rows, heads*d], k and v [rows, kv_heads*d] from x [rows, hidden]: the projections, their biases (or NULL),
// and the rotary embedding on q and k.
int dw_qkv(const float *x, int rows, const dw_weight *wq, const dw_weight *wk, const dw_weight *wv, const float *bq,
           const float *bk, const float *bv, const float *cos, const float *sin, int d, float *q, float *k,
           float *v) {
    const dw_weight *w[3] = {wq, wk, wv};
    const float *bias[3] = {bq, bk, bv};
    float *out[3] = {q, k, v};
    const int status = weights_rows(w, 3, x, rows, out);
    if (status) return status;
    for (int i = 0; i < 3; i++) {
        if (bias[i])
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < w[i]->n; j++) out[i][(size_t)r * w[i]->n + j] += bias[i][j];
    }
    rope(q, rows, wq->n / d, d, cos, sin);
    rope(k, rows, wk->n / d, d, cos, sin);
    return 0;
}

// ---- a whole decoder layer in one call (Llama/Qwen2 shape): what a step of a small model spends between kernels
// (a dozen Python calls and tensor operations a layer) is as much as a few layers' weight reads.

typedef struct {  // one decoder layer's weights (quant_layers.OneCallLayer builds it)
    const dw_weight *q, *k, *v, *o, *gate, *up, *down;
    const float *bq, *bk, *bv;  // the projections' biases, or NULL
    const float *norm1, *norm2;  // the RMS norms' weights before attention and before the MLP
    float eps1, eps2, scale;
    int heads, kv_heads, d;
} dw_layer;

// out [rows, h] = the layer applied to x [rows, h] (rows = batch * n; x is left as it is): the same operations in the
// same order as the parts called one by one, so the same bits. The new keys and values are written into this layer's
// cache, kc and vc [cache rows, kv_heads, capacity, d] (strides rs, hs, ps in floats, d contiguous): batch row b's
// position t at cache row cache_rows[b], position write_at[b * n + t]. cos, sin [rows, d]: the rotary tables;
// visible [batch, n, keys]: which of the first `keys` cache positions each query sees (written ones included).
int dw_decoder_layer(const dw_layer *L, const float *x, int batch, int n, const float *cos, const float *sin, float *kc,
                     float *vc, long rs, long hs, long ps, const int64_t *cache_rows, const int64_t *write_at,
                     const uint8_t *visible, int keys, float *out) {
    const int rows = batch * n, h = L->q->k, d = L->d, qw = L->heads * d, kw = L->kv_heads * d;
    if (L->o->n != h || L->down->n != h || L->q->n != qw || L->k->n != kw || L->v->n != kw) return -1;
    float *normed = malloc(sizeof(float) * (size_t)rows * h), *part = malloc(sizeof(float) * (size_t)rows * h);
    float *q = malloc(sizeof(float) * (size_t)rows * qw), *att = malloc(sizeof(float) * (size_t)rows * qw);
    float *k = malloc(sizeof(float) * (size_t)rows * kw), *v = malloc(sizeof(float) * (size_t)rows * kw);
    int status = -2;
    if (!(normed && part && q && att && k && v)) goto done;
    dw_rmsnorm(x, rows, h, L->norm1, L->eps1, normed);
    if ((status = dw_qkv(normed, rows, L->q, L->k, L->v, L->bq, L->bk, L->bv, cos, sin, d, q, k, v))) goto done;
    for (int b = 0; b < batch; b++)
        for (int t = 0; t < n; t++)
            for (int head = 0; head < L->kv_heads; head++) {
                const size_t at = (size_t)cache_rows[b] * rs + (size_t)head * hs + (size_t)write_at[b * n + t] * ps;
                const size_t from = ((size_t)(b * n + t) * L->kv_heads + head) * d;
                memcpy(kc + at, k + from, sizeof(float) * d);
                memcpy(vc + at, v + from, sizeof(float) * d);
            }
    // q read as [batch, heads, n, d]; att written [batch, n, heads, d], i.e. [rows, heads * d]
    if ((status = attend(q, (long)n * qw, d, qw, kc, rs, hs, ps, vc, rs, hs, ps, cache_rows, visible, batch, L->heads,
                         L->kv_heads, n, keys, d, L->scale, att)))
        goto done;
    if ((status = weight_rows(L->o, att, rows, part))) goto done;
    for (size_t i = 0; i < (size_t)rows * h; i++) out[i] = x[i] + part[i];
    dw_rmsnorm(out, rows, h, L->norm2, L->eps2, normed);
    if ((status = dw_mlp(normed, rows, L->gate, L->up, L->down, part))) goto done;
    for (size_t i = 0; i < (size_t)rows * h; i++) out[i] = out[i] + part[i];
done:
    free(normed);
    free(part);
    free(q);
    free(att);
    free(k);
    free(v);
    return status;
}

// A pass's decoder layers back to back (quant_stack.py): layer i reads one of two buffers and writes the other, its
// cache is kc[i], vc[i] (every layer's with the same strides), and the last layer's output ends in out. The same
// dw_decoder_layer calls, in the same order, on the same values as a caller's loop over them: the same bits, without
// a return to Python between layers (where everything the weights' streaming pushed out of the caches is read back).
int dw_decoder_stack(const dw_layer *const *layers, int count, const float *x, int batch, int n, const float *cos,
                     const float *sin, float *const *kc, float *const *vc, long rs, long hs, long ps,
                     const int64_t *cache_rows, const int64_t *write_at, const uint8_t *visible, int keys, float *out,
                     float *spare) {
    for (int i = 0; i < count; i++) {
        float *to = (count - i) % 2 ? out : spare;  // (the last layer writes out)
        int status = dw_decoder_layer(layers[i], x, batch, n, cos, sin, kc[i], vc[i], rs, hs, ps, cache_rows,
                                      write_at, visible, keys, to);
        if (status) return status;
        x = to;
    }
    return 0;
}
