/* Linear per-sample norms on the CPU backend against the GEMM they
 * generalise: for each shape, the direct (per-sample sgemm tiles), ghost
 * (Gram matrices) and auto paths, and one cblas_sgemm of g^T a over all B*T
 * rows (the same 2*B*T*d*p flops as direct). Prints one JSON line per shape;
 * the ratios compare timings from the same run. BLAS threads come from
 * OPENBLAS_NUM_THREADS.
 *
 * usage: bench_norms [reps]   (median of reps, default 7, after a warm-up) */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu.h"

typedef struct shape {
    uint32_t B;
    int64_t T, d, p;
} shape;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Roughly N(0, s^2) from a 64-bit LCG (sum of uniforms): good enough data. */
static void fill(float *x, size_t n, float s, uint64_t *st) {
    for (size_t i = 0; i < n; i++) {
        double u = 0.0;
        for (int k = 0; k < 4; k++) {
            *st = *st * 6364136223846793005ull + 1442695040888963407ull;
            u += (double)(*st >> 11) * (1.0 / 9007199254740992.0);
        }
        x[i] = (float)((u - 2.0) * 1.7320508 * s);
    }
}

typedef struct ctx {
    dc_cpu_scratch s;
    const shape *sh;
    float *a, *g, *w;
    double *n2;
} ctx;

static int run(ctx *c, int which) {
    const shape *sh = c->sh;
    if (which == 3) {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)sh->p, (int)sh->d,
                    (int)(sh->B * sh->T), 1.0f, c->g, (int)sh->p, c->a, (int)sh->d, 0.0f, c->w,
                    (int)sh->d);
        return 0;
    }
    static const dc_algo algo[3] = {DC_ALGO_DIRECT, DC_ALGO_GHOST, DC_ALGO_AUTO};
    return dc_cpu_linear_sqnorms(&c->s, c->a, c->g, sh->B, sh->T, sh->d, sh->p, false, algo[which],
                                 c->n2);
}

static double median_ms(ctx *c, int which, int reps) {
    double t[64];
    if (reps > 64) reps = 64;
    if (run(c, which)) return NAN; /* warm-up: scratch allocation, BLAS buffers */
    for (int r = 0; r < reps; r++) {
        double t0 = now_ms();
        run(c, which);
        t[r] = now_ms() - t0;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    return t[reps / 2];
}

int main(int argc, char **argv) {
    static const shape shapes[] = {
        {8, 128, 256, 256},   {4, 512, 512, 512},   {16, 64, 1024, 1024},
        {2, 1024, 256, 1024}, {256, 1, 1024, 1024},
    };
    int reps = argc > 1 ? atoi(argv[1]) : 7;
    if (reps < 1) reps = 1;
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        const shape *sh = &shapes[i];
        size_t rows = (size_t)sh->B * (size_t)sh->T;
        ctx c;
        uint64_t st = 12345 + i;
        memset(&c, 0, sizeof c);
        c.sh = sh;
        c.a = malloc(rows * (size_t)sh->d * sizeof(float));
        c.g = malloc(rows * (size_t)sh->p * sizeof(float));
        c.w = malloc((size_t)sh->p * (size_t)sh->d * sizeof(float));
        c.n2 = malloc(sh->B * sizeof(double));
        double *ref = malloc(sh->B * sizeof(double));
        if (!c.a || !c.g || !c.w || !c.n2 || !ref) {
            fprintf(stderr, "bench_norms: out of memory\n");
            return 1;
        }
        fill(c.a, rows * (size_t)sh->d, 1.0f, &st);
        fill(c.g, rows * (size_t)sh->p, 0.1f, &st);

        double direct = median_ms(&c, 0, reps);
        memcpy(ref, c.n2, sh->B * sizeof(double));
        double ghost = median_ms(&c, 1, reps);
        double agree = 0.0; /* direct and ghost must give the same norms */
        for (uint32_t b = 0; b < sh->B; b++) agree = fmax(agree, fabs(c.n2[b] - ref[b]) / ref[b]);
        double autom = median_ms(&c, 2, reps);
        double sgemm = median_ms(&c, 3, reps);
        printf("{\"bench\":\"norms_cpu\",\"B\":%u,\"T\":%lld,\"d\":%lld,\"p\":%lld,"
               "\"direct_ms\":%.3f,\"ghost_ms\":%.3f,\"auto_ms\":%.3f,\"sgemm_ms\":%.3f,"
               "\"direct_over_sgemm\":%.3f,\"auto_over_sgemm\":%.3f,\"threads\":%d,"
               "\"direct_ghost_reldiff\":%.2e}\n",
               sh->B, (long long)sh->T, (long long)sh->d, (long long)sh->p, direct, ghost, autom,
               sgemm, direct / sgemm, autom / sgemm, openblas_get_num_threads(), agree);
        fflush(stdout);
        dc_cpu_scratch_free(&c.s);
        free(c.a);
        free(c.g);
        free(c.w);
        free(c.n2);
        free(ref);
    }
    return 0;
}
