// The 256-bit tile's loop over rows alone (AVX2, 4-bit values): per group, each half's 8 registers of values
// unpacked, then its rows (not unrolled: 8 broadcasts, 8 vpmaddubsw summed in int16, one vpmaddwd, an int32 sum in
// memory). Cycles a row's half-group at 4.19 GHz (the machine's clock; change it below).
//   gcc -O3 -mavx2 -mfma -DR=4 [-DUNROLL2] row_loop.c -o row_loop && taskset -c 1 ./row_loop
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#ifndef R
#define R 8
#endif
__attribute__((noinline)) void loop(const uint8_t *q, const int8_t *xq, __m256i (*dots)[2], __m256i scale, long groups) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (long j = 0; j < groups; j++) {
    const uint8_t *p = q + (j & 15) * 256;
    for (int h = 0; h < 2; h++) {
      __m256i w[8];
      for (int i = 0; i < 4; i++) { __m256i packed = _mm256_loadu_si256((const __m256i *)(p + 64 * i + 32 * h));
        w[i] = _mm256_and_si256(packed, low); w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low); }
#ifdef UNROLL2
#pragma GCC unroll 2
#else
#pragma GCC unroll 1
#endif
      for (int r = 0; r < R; r++) {
        const int8_t *xr = xq + r * 64 + (j & 1) * 32;
        __m256i m[8];
        for (int i = 0; i < 8; i++) {
            int32_t a;
            memcpy(&a, xr + 4 * i, 4);
            m[i] = _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(a));
        }
        __m256i pp = m[0];  // a chain, as qgemm.c sums
        for (int i = 1; i < 8; i++) pp = _mm256_add_epi16(pp, m[i]);
        dots[r][h] = _mm256_add_epi32(dots[r][h], _mm256_madd_epi16(pp, scale));
      }
    }
  }
}
int main(){ static int8_t xq[R*64]; static uint8_t q[16*256]; for(int i=0;i<R*64;i++) xq[i]=i*7; for(int i=0;i<16*256;i++) q[i]=i*13;
  static __m256i dots[R][2]; long g=10000000; double t=now(); loop(q,xq,dots,_mm256_set1_epi16(3),g); t=now()-t;
  int32_t o[8]; _mm256_storeu_si256((__m256i*)o,dots[R - 1][1]); printf("R=%d: %.2f cycles per row-half (%d)\n", R, t*4.19e9/(g*R*2), o[0]); }
