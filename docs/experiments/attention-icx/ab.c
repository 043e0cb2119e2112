// Interleaved A/B of dw_attention builds: each rep runs every lib once over all layers, order rotated; min and median.
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <dlfcn.h>
typedef int (*att_fn)(const float *, long, long, long, const float *, long, long, long, const float *, long, long, long,
                      const uint8_t *, int, int, int, int, int, int, float, float *);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    int L = atoi(argv[1]), H = atoi(argv[2]), KV = atoi(argv[3]), D = atoi(argv[4]), keys = atoi(argv[5]), n = atoi(argv[6]), reps = atoi(argv[7]);
    int nl = argc - 8; att_fn f[8];
    for (int i = 0; i < nl; i++) { void *h = dlopen(argv[8 + i], RTLD_NOW | RTLD_LOCAL); if (!h) { printf("%s\n", dlerror()); return 1; } f[i] = (att_fn)dlsym(h, "dw_attention"); }
    int cap = 256; while (cap < keys) cap *= 2;
    float **K = malloc(sizeof(float*) * L), **V = malloc(sizeof(float*) * L);
    srand(1);
    for (int l = 0; l < L; l++) {
        K[l] = malloc(sizeof(float) * KV * cap * D); V[l] = malloc(sizeof(float) * KV * cap * D);
        for (long i = 0; i < (long)KV * cap * D; i++) { K[l][i] = (rand() & 0xffff) / 65536.0f - 0.5f; V[l][i] = (rand() & 0xffff) / 65536.0f - 0.5f; }
    }
    float *q = malloc(sizeof(float) * H * n * D), *out = malloc(sizeof(float) * H * n * D);
    for (int i = 0; i < H * n * D; i++) q[i] = (rand() & 0xffff) / 65536.0f - 0.5f;
    uint8_t *vis = malloc(n * keys);
    for (int t = 0; t < n; t++) for (int j = 0; j < keys; j++) vis[t * keys + j] = j <= keys - n + t;
    size_t flushn = 64 << 20; char *flush = malloc(flushn);
    double *ts = malloc(sizeof(double) * reps * nl); double check[8];
    for (int r = 0; r < reps; r++)
        for (int s = 0; s < nl; s++) {
            int i = (r + s) % nl;
            for (size_t b = 0; b < flushn; b += 64) flush[b]++;
            double t0 = now();
            for (int l = 0; l < L; l++)
                f[i](q, (long)H * n * D, (long)n * D, D, K[l], (long)KV * cap * D, (long)cap * D, D, V[l], (long)KV * cap * D, (long)cap * D, D,
                     vis, 1, H, KV, n, keys, D, 0.125f, out);
            ts[i * reps + r] = now() - t0;
            double c = 0; for (int e = 0; e < H * n * D; e++) c += out[e] * (e % 7 + 1); check[i] = c;
        }
    for (int i = 0; i < nl; i++) {
        qsort(ts + i * reps, reps, sizeof(double), cmp);
        printf("%-14s min %.3f  median %.3f ms  (vs first %.3f)  check %.9g\n", argv[8 + i], ts[i * reps] * 1e3, ts[i * reps + reps / 2] * 1e3,
               ts[i * reps + reps / 2] / ts[reps / 2], check[i]);
    }
}
