// One thread, the kernel's tile alone: ns a group of 16 channels over 1, 2, 3, 4 and 8 rows, best of 5, for a Q4_K,
// Q6_K or Q8_0-shaped weight [16 T x 1536] (groups of G values, S a super-group: 32 and 8 unless given). T = 1 keeps it in the L1 (the arithmetic alone); T = 20000 (about 250
// MB of 4-bit blocks) streams it from memory, as a pass does. The checksum shows two builds give the same bits.
//
//   gcc -I. -O3 -ffp-contract=off -mavx2 -mfma -mtune=native -DDW_PREFETCH_L2=1 -DDW_ISA=1 \
//       -DSRC='"draftwise/backends/qgemm.c"' docs/experiments/avx2-halves-zen5/tile_time.c -o tile_time -lm
//   taskset -c 1 ./tile_time BITS T [G S]    # from the repository's root; BITS 4, 6 or 8; -DDW_ISA=2 -mavxvnni: AVX-VNNI
// (-DXSUM_T=int16_t: a kernel that takes each group's activation sum as an integer, docs/experiments/act-super-zen5)
#include SRC
#ifndef XSUM_T
#define XSUM_T float
#endif
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 3) return fprintf(stderr, "usage: %s BITS TILES [G S]\n", argv[0]), 2;
    const int k = 1536, G = argc > 3 ? atoi(argv[3]) : 32, S = argc > 4 ? atoi(argv[4]) : 8;
    const int BITS = atoi(argv[1]), T = atoi(argv[2]), groups = k / G;
    const size_t qt = (size_t)groups * TILE * G * BITS / 8, mt = (size_t)groups * TILE, dt = (size_t)groups / S * TILE;
    uint8_t *q = aligned_alloc(64, qt * T);
    int8_t *sc = malloc(mt * T), *mn = malloc(mt * T), *xq = malloc(MAX_ROWS * k);
    float *d = malloc(dt * T * 4), *dmin = malloc(dt * T * 4), *y = malloc(MAX_ROWS * TILE * 4);
    float *xs = malloc(MAX_ROWS * groups * 4);
    XSUM_T *xsum = malloc(MAX_ROWS * groups * 4);
    srand(1);
    for (size_t i = 0; i < qt * T; i++) q[i] = rand();
    for (size_t i = 0; i < mt * T; i++) sc[i] = rand() % 64, mn[i] = rand() % 64;
    for (size_t i = 0; i < dt * T; i++) d[i] = 0.01f, dmin[i] = 0.02f;
    for (int i = 0; i < MAX_ROWS * k; i++) xq[i] = rand() % 255 - 127;
    for (int i = 0; i < MAX_ROWS * groups; i++) xs[i] = 0.1f, xsum[i] = 1.0f;
    const int rows[] = {1, 2, 3, 4, 8};
    long iters = (long)2e7 / ((long)T * groups);
    if (iters < 3) iters = 3;
    for (int ri = 0; ri < 5; ri++) {
        const int R = rows[ri];
        double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            double t = now();
            for (long it = 0; it < iters; it++)
                for (int u = 0; u < T; u++)
                    tile_dispatch(R, G, BITS, k, S, q + u * qt, sc + u * mt, mn + u * mt, d + u * dt, dmin + u * dt,
                                  xq, xs, xsum, y, TILE);
            t = now() - t;
            if (t < best) best = t;
        }
        printf("%d rows %.2f ns | ", R, best / iters / T / groups * 1e9);
    }
    double check = 0;
    for (int i = 0; i < 8 * TILE; i++) check += y[i];
    printf("checksum %.6f\n", check);
    return 0;
}
