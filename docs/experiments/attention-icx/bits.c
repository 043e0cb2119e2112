// Bitwise: dw_attention of several builds on the same inputs, many shapes, ragged masks; every output must be equal.
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <dlfcn.h>
typedef int (*att_fn)(const float *, long, long, long, const float *, long, long, long, const float *, long, long, long,
                      const uint8_t *, int, int, int, int, int, int, float, float *);
static float rnd(void) { return ((rand() & 0xffffff) / 16777216.0f - 0.5f) * 4.0f; }
int main(int argc, char **argv) {
    int nl = argc - 1; att_fn f[8];
    for (int i = 0; i < nl; i++) { void *h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL); if (!h) { printf("%s\n", dlerror()); return 1; } f[i] = (att_fn)dlsym(h, "dw_attention"); }
    int dims[] = {16, 40, 64, 96, 128, 256}, bad = 0, cases = 0;
    srand(7);
    for (int di = 0; di < 6; di++)
        for (int trial = 0; trial < 12; trial++) {
            int d = dims[di], kv = 1 + rand() % 2, group = 1 + rand() % 9, heads = kv * group, batch = 1 + rand() % 2;
            int n = (int[]){1, 1, 2, 3, 4, 5, 8, 16, 17, 21, 1, 4}[trial], keys = n + rand() % 700;
            int pad = rand() % 2 ? 0 : 8;  // a key stride wider than d (rows not packed)
            long kt = d + pad, kh = kt * keys, kb = kh * kv;
            float *q = malloc(sizeof(float) * batch * heads * n * d), *k = malloc(sizeof(float) * batch * kb), *v = malloc(sizeof(float) * batch * kb);
            for (long i = 0; i < (long)batch * heads * n * d; i++) q[i] = rnd();
            for (long i = 0; i < batch * kb; i++) { k[i] = rnd(); v[i] = rnd(); }
            uint8_t *vis = malloc(batch * n * keys);
            for (int b = 0; b < batch; b++) for (int t = 0; t < n; t++) for (int j = 0; j < keys; j++) {
                int causal = j <= keys - n + t; int r = rand() % 10;
                vis[(b * n + t) * keys + j] = trial % 3 == 0 ? causal : (causal && r != 0) || (trial % 3 == 2 && r == 1 && j < keys / 2);
            }
            if (trial == 5) memset(vis, 0, n * keys);  // a row that sees nothing
            float *out[8];
            for (int i = 0; i < nl; i++) {
                out[i] = malloc(sizeof(float) * batch * n * heads * d);
                memset(out[i], 0x7f, sizeof(float) * batch * n * heads * d);
                int st = f[i](q, (long)heads * n * d, (long)n * d, d, k, kb, kh, kt, v, kb, kh, kt, vis, batch, heads, kv, n, keys, d, 0.11f, out[i]);
                if (st) { printf("status %d\n", st); bad++; }
                if (i && memcmp(out[i], out[0], sizeof(float) * batch * n * heads * d)) {
                    printf("DIFFER: %s vs %s at d %d group %d kv %d n %d keys %d batch %d pad %d trial %d\n", argv[1 + i], argv[1], d, group, kv, n, keys, batch, pad, trial); bad++;
                }
            }
            cases++;
            for (int i = 0; i < nl; i++) free(out[i]);
            free(q); free(k); free(v); free(vis);
        }
    printf("%d cases, %d differences\n", cases, bad);
    return bad != 0;
}
