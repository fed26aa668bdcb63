/* Per-sample squared gradient norms on the CPU (docs/design.md).
 * Products run through OpenBLAS in f32; every sum that spans a whole
 * per-sample gradient is accumulated in double. */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu.h"

/* Bytes of a per-sample gradient G_b computed per sgemm in the direct path:
 * a quarter of L2, so the tile stays in cache (next to the GEMM's packed
 * panels) while it is squared and summed. Measured on a 2 MiB-L2 Xeon,
 * 512 KiB tiles ran ~25% faster than 64 KiB ones and ~8% faster than 8 MiB
 * ones (bench_norms). */
static size_t direct_tile_bytes(void) {
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE); /* glibc: from cpuid, cheap */
    size_t t = l2 > 0 ? (size_t)l2 / 4 : 256u * 1024u;
    if (t < 128u * 1024u) t = 128u * 1024u;
    if (t > 1024u * 1024u) t = 1024u * 1024u;
    return t;
}

/* The squared-sum loops run over every element of every per-sample tile;
 * the build targets baseline x86-64, so let GCC also emit AVX2 / AVX-512
 * versions picked at load time (ifunc). Elsewhere it is a plain function. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define DC_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DC_MULTIVERSION
#endif

/* sum x[i]^2 in double; 8 independent partial sums so the loop vectorizes. */
DC_MULTIVERSION static double sumsq(const float *x, size_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += (double)x[i + k] * (double)x[i + k];
    for (; i < n; i++) acc[0] += (double)x[i] * (double)x[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static double sumsq_d(const double *x, size_t n) {
    double a0 = 0, a1 = 0;
    size_t i = 0;
    for (; i + 2 <= n; i += 2) {
        a0 += x[i] * x[i];
        a1 += x[i + 1] * x[i + 1];
    }
    if (i < n) a0 += x[i] * x[i];
    return a0 + a1;
}

/* acc[j] += x[j] for a row of n floats. */
static void add_row(double *acc, const float *x, size_t n) {
    for (size_t j = 0; j < n; j++) acc[j] += (double)x[j];
}

/* ||sum_t g_t||^2 per sample: the bias part. */
static int bias_sqnorms(dc_cpu_scratch *s, const float *g, uint32_t B, int64_t T, int64_t p,
                        double *n2) {
    double *acc = dc_cpu_buf_reserve(&s->work2, (size_t)p * sizeof(double));
    if (!acc) return DC_ENOSPACE;
    for (uint32_t b = 0; b < B; b++) {
        memset(acc, 0, (size_t)p * sizeof(double));
        for (int64_t t = 0; t < T; t++) add_row(acc, g + ((size_t)b * T + t) * p, (size_t)p);
        n2[b] += sumsq_d(acc, (size_t)p);
    }
    return 0;
}

/* Far from 1, the f32 products of a sample's rows leave f32's range (the
 * ghost form's Gram a a^T overflows for |a| ~ 1e19, where the exact norm is
 * finite): such a sample is scaled by powers of two, exact in binary
 * floating point, and the squared norm scaled back in double. Samples whose
 * largest magnitude lies in [2^-SCALE_EXP, 2^SCALE_EXP] are used as they
 * are, so normal data costs one max scan. */
#define SCALE_EXP 30

/* The binary exponent of max |x| (max = f * 2^e, f in [0.5, 1)) when it lies
 * outside the safe range, else 0. */
static int range_exp(const float *x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    if (m == 0.0f || !(m <= FLT_MAX)) return 0; /* zeros; non-finite is caught later */
    int e;
    (void)frexpf(m, &e);
    return e > SCALE_EXP || e < -SCALE_EXP ? e : 0;
}

/* A sample's a [T, d] and g [T, p], scaled into scratch when either needs
 * it; *e receives the exponent to add back (squared norm * 4^e). */
typedef struct scaled_sample {
    const float *a, *g;
    int e;
} scaled_sample;

static int scale_sample(dc_cpu_scratch *s, const float *a, const float *g, size_t na, size_t ng,
                        scaled_sample *out) {
    int ea = range_exp(a, na), eg = range_exp(g, ng);
    out->a = a;
    out->g = g;
    out->e = ea + eg;
    if (!ea && !eg) return 0;
    float *buf = dc_cpu_buf_reserve(&s->scaled, (na + ng) * sizeof(float));
    if (!buf) return DC_ENOSPACE;
    if (ea) {
        for (size_t i = 0; i < na; i++) buf[i] = ldexpf(a[i], -ea);
        out->a = buf;
    }
    if (eg) {
        for (size_t i = 0; i < ng; i++) buf[na + i] = ldexpf(g[i], -eg);
        out->g = buf + na;
    }
    return 0;
}

/* Direct: G_b = g_b^T a_b (p x d) formed tile by tile (rows p0..p0+pt) with
 * one sgemm each and squared while the tile is hot in cache. */
static int linear_direct(dc_cpu_scratch *s, const float *a, const float *g, uint32_t B, int64_t T,
                         int64_t d, int64_t p, double *n2) {
    size_t pt = direct_tile_bytes() / (sizeof(float) * (size_t)d);
    if (pt >= 16) pt &= ~(size_t)15; /* whole register blocks for the GEMM kernel */
    if (pt < 1) pt = 1;
    if (pt > (size_t)p) pt = (size_t)p;
    float *tile = dc_cpu_buf_reserve(&s->work, pt * (size_t)d * sizeof(float));
    if (!tile) return DC_ENOSPACE;
    for (uint32_t b = 0; b < B; b++) {
        scaled_sample x;
        if (scale_sample(s, a + (size_t)b * T * d, g + (size_t)b * T * p, (size_t)(T * d),
                         (size_t)(T * p), &x))
            return DC_ENOSPACE;
        const float *ab = x.a, *gb = x.g;
        double acc = 0.0;
        for (size_t p0 = 0; p0 < (size_t)p; p0 += pt) {
            size_t rows = (size_t)p - p0 < pt ? (size_t)p - p0 : pt;
            /* tile[rows x d] = (g_b[:, p0:p0+rows])^T a_b, K = T */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)rows, (int)d, (int)T, 1.0f,
                        gb + p0, (int)p, ab, (int)d, 0.0f, tile, (int)d);
            acc += sumsq(tile, rows * (size_t)d);
        }
        n2[b] = ldexp(acc, 2 * x.e);
    }
    return 0;
}

/* Ghost: ||g_b^T a_b||^2 = <a_b a_b^T, g_b g_b^T>. Both T x T Grams come
 * from ssyrk (upper triangle only, half the flops of a GEMM); the inner
 * product counts off-diagonal entries twice. */
static int linear_ghost(dc_cpu_scratch *s, const float *a, const float *g, uint32_t B, int64_t T,
                        int64_t d, int64_t p, double *n2) {
    size_t tt = (size_t)T * (size_t)T;
    float *ga = dc_cpu_buf_reserve(&s->work, tt * sizeof(float));
    float *gg = dc_cpu_buf_reserve(&s->work2, tt * sizeof(float));
    if (!ga || !gg) return DC_ENOSPACE;
    for (uint32_t b = 0; b < B; b++) {
        scaled_sample x;
        if (scale_sample(s, a + (size_t)b * T * d, g + (size_t)b * T * p, (size_t)(T * d),
                         (size_t)(T * p), &x))
            return DC_ENOSPACE;
        cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, (int)T, (int)d, 1.0f, x.a, (int)d,
                    0.0f, ga, (int)T);
        cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, (int)T, (int)p, 1.0f, x.g, (int)p,
                    0.0f, gg, (int)T);
        double diag = 0.0, off = 0.0;
        for (int64_t i = 0; i < T; i++) {
            const float *ra = ga + (size_t)i * T, *rg = gg + (size_t)i * T;
            diag += (double)ra[i] * (double)rg[i];
            double o0 = 0.0, o1 = 0.0;
            int64_t j = i + 1;
            for (; j + 2 <= T; j += 2) {
                o0 += (double)ra[j] * (double)rg[j];
                o1 += (double)ra[j + 1] * (double)rg[j + 1];
            }
            if (j < T) o0 += (double)ra[j] * (double)rg[j];
            off += o0 + o1;
        }
        n2[b] = ldexp(diag + 2.0 * off, 2 * x.e);
    }
    return 0;
}

int dc_cpu_linear_sqnorms(dc_cpu_scratch *s, const float *a, const float *g, uint32_t B, int64_t T,
                          int64_t d, int64_t p, bool has_bias, dc_algo algo, double *n2) {
    int rc;
    if (algo == DC_ALGO_AUTO) {
        dc_layer tmp = {.T = T, .d = d, .p = p, .algo = DC_ALGO_AUTO};
        algo = dc_linear_pick(&tmp);
    }
    if (T == 1) {
        /* Both forms collapse here: the per-sample gradient is the outer
         * product g_b a_b^T, whose squared Frobenius norm is exactly
         * ||a_b||^2 ||g_b||^2 (forming it would only cost memory traffic). */
        for (uint32_t b = 0; b < B; b++)
            n2[b] = sumsq(a + (size_t)b * d, (size_t)d) * sumsq(g + (size_t)b * p, (size_t)p);
        rc = 0;
    } else {
        rc = algo == DC_ALGO_DIRECT ? linear_direct(s, a, g, B, T, d, p, n2)
                                    : linear_ghost(s, a, g, B, T, d, p, n2);
    }
    if (rc == 0 && has_bias) rc = bias_sqnorms(s, g, B, T, p, n2);
    return rc;
}

/* --- embedding ------------------------------------------------------------ */

typedef struct pos_key {
    int64_t index;
    int64_t t;
} pos_key;

static int cmp_pos(const void *x, const void *y) {
    const pos_key *a = x, *b = y;
    if (a->index != b->index) return a->index < b->index ? -1 : 1;
    return (a->t > b->t) - (a->t < b->t);
}

/* ||G_b||^2 = sum over distinct indices v of ||sum_{t: i_t = v} g_t||^2:
 * sort the positions by index, sum g within each run of equal indices. Rows
 * of padding_idx get no gradient and are skipped. */
static int embedding_sqnorms(dc_cpu_scratch *s, const dc_layer *l, const float *g, uint32_t B,
                             double *n2) {
    int64_t T = l->T, d = l->d;
    pos_key *keys = dc_cpu_buf_reserve(&s->order, (size_t)T * sizeof *keys);
    double *acc = dc_cpu_buf_reserve(&s->work2, (size_t)d * sizeof(double));
    if (!keys || !acc) return DC_ENOSPACE;
    for (uint32_t b = 0; b < B; b++) {
        size_t n = 0;
        for (int64_t t = 0; t < T; t++) {
            int64_t v = dc_cpu_index(&l->input, (size_t)b * T + t);
            if (l->has_padding_idx && v == l->padding_idx) continue;
            keys[n].index = v;
            keys[n].t = t;
            n++;
        }
        qsort(keys, n, sizeof *keys, cmp_pos);
        double sum = 0.0;
        for (size_t i = 0; i < n;) {
            size_t j = i + 1;
            while (j < n && keys[j].index == keys[i].index) j++;
            const float *gi = g + ((size_t)b * T + keys[i].t) * d;
            if (j == i + 1) {
                sum += sumsq(gi, (size_t)d); /* a token seen once: no collision */
            } else {
                memset(acc, 0, (size_t)d * sizeof(double));
                for (size_t k = i; k < j; k++)
                    add_row(acc, g + ((size_t)b * T + keys[k].t) * d, (size_t)d);
                sum += sumsq_d(acc, (size_t)d);
            }
            i = j;
        }
        n2[b] = sum;
    }
    return 0;
}

/* --- LayerNorm / RMSNorm ---------------------------------------------------- */

void dc_cpu_norm_sample(const dc_layer *l, const float *x, const float *g, uint32_t b, double *wg,
                        double *bg) {
    int64_t T = l->T, d = l->d;
    memset(wg, 0, (size_t)d * sizeof(double));
    if (bg) memset(bg, 0, (size_t)d * sizeof(double));
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + ((size_t)b * T + t) * d, *gr = g + ((size_t)b * T + t) * d;
        double mean = 0.0, var = 0.0;
        if (l->kind == DC_LAYER_LAYERNORM) {
            for (int64_t j = 0; j < d; j++) mean += xr[j];
            mean /= (double)d;
            for (int64_t j = 0; j < d; j++) var += ((double)xr[j] - mean) * ((double)xr[j] - mean);
        } else {
            for (int64_t j = 0; j < d; j++) var += (double)xr[j] * (double)xr[j];
        }
        var /= (double)d; /* biased variance, or mean(x^2) for RMSNorm */
        double rstd = 1.0 / sqrt(var + (double)l->eps);
        for (int64_t j = 0; j < d; j++) wg[j] += (double)gr[j] * (((double)xr[j] - mean) * rstd);
        if (bg) add_row(bg, gr, (size_t)d);
    }
}

static int norm_sqnorms(dc_cpu_scratch *s, const dc_layer *l, const float *x, const float *g,
                        uint32_t B, double *n2) {
    bool bias = l->kind == DC_LAYER_LAYERNORM && l->has_bias;
    size_t d = (size_t)l->d;
    double *wg = dc_cpu_buf_reserve(&s->work2, 2 * d * sizeof(double));
    if (!wg) return DC_ENOSPACE;
    for (uint32_t b = 0; b < B; b++) {
        dc_cpu_norm_sample(l, x, g, b, wg, bias ? wg + d : NULL);
        n2[b] = sumsq_d(wg, d) + (bias ? sumsq_d(wg + d, d) : 0.0);
    }
    return 0;
}

int dc_cpu_layer_sqnorms(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, float scale, double *n2,
                         dc_err *err) {
    const float *x, *g;
    int rc;

    if (dc_cpu_layer_f32(s, l, B, &x, &g)) goto oom;
    switch (l->kind) {
    case DC_LAYER_LINEAR:
        rc = dc_cpu_linear_sqnorms(s, x, g, B, l->T, l->d, l->p, dc_layer_norm_bias(l),
                                   dc_linear_pick(l), n2);
        break;
    case DC_LAYER_EMBEDDING: rc = embedding_sqnorms(s, l, g, B, n2); break;
    case DC_LAYER_LAYERNORM:
    case DC_LAYER_RMSNORM: rc = norm_sqnorms(s, l, x, g, B, n2); break;
    default: return dc_err_set(err, DC_EINVAL, l->name, "unknown layer kind %d", (int)l->kind);
    }
    if (rc) goto oom;
    /* Norms are of the gradient with output grads times scale. */
    double s2 = (double)scale * (double)scale;
    for (uint32_t b = 0; b < B; b++) n2[b] *= s2;
    return 0;

oom:
    return dc_err_set(err, DC_ENOSPACE, l->name, "out of memory for the CPU backend's scratch");
}

/* --- tied parameters ------------------------------------------------------ */

/* The shared weight's norm of a tied pair, sample by sample: no[b] (the
 * owner's, its own use's norm so far) += nl[b] (the later layer's use's)
 * + s2 * 2 <G_emb,b, G_lin,b>. G_emb,b has row i_t += e_t at each
 * non-padding position t and G_lin,b = g_b^T a_b, so the inner product is
 * sum_t sum_s g_b[s, i_t] (e_t . a_s): the Gram M = E_b A_b^T [Te x Tl] in one
 * sgemm, then its entries weighted by the linear layer's output grads at the
 * embedding's indices. e and a are range-scaled like the linear norms. */
static int tie_combine(dc_cpu_scratch *s, const dc_layer *emb, const dc_layer *lin, const float *e,
                       const float *a, const float *g, uint32_t B, double s2, double *no,
                       const double *nl) {
    size_t Te = (size_t)emb->T, Tl = (size_t)lin->T, d = (size_t)lin->d, V = (size_t)lin->p;
    float *M = dc_cpu_buf_reserve(&s->work, Te * Tl * sizeof(float));
    if (!M) return DC_ENOSPACE;
    for (uint32_t b = 0; b < B; b++) {
        scaled_sample x;
        if (scale_sample(s, e + (size_t)b * Te * d, a + (size_t)b * Tl * d, Te * d, Tl * d, &x))
            return DC_ENOSPACE;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)Te, (int)Tl, (int)d, 1.0f, x.a,
                    (int)d, x.g, (int)d, 0.0f, M, (int)Tl);
        const float *gb = g + (size_t)b * Tl * V;
        double acc = 0.0;
        for (size_t t = 0; t < Te; t++) {
            int64_t v = dc_cpu_index(&emb->input, (size_t)b * Te + t);
            if (emb->has_padding_idx && v == emb->padding_idx) continue;
            const float *Mt = M + t * Tl;
            double r = 0.0;
            for (size_t q = 0; q < Tl; q++) r += (double)Mt[q] * (double)gb[q * V + (size_t)v];
            acc += r;
        }
        /* |G_o + G_l|^2 = |G_o|^2 + |G_l|^2 + 2 <G_o, G_l>; rounding may take
         * a near-cancellation below 0 (a NaN stays NaN: check_norms fails it) */
        double w = no[b] + nl[b] + s2 * 2.0 * ldexp(acc, x.e);
        no[b] = w < 0.0 ? 0.0 : w;
    }
    return 0;
}

int dc_cpu_tie_sqnorms(dc_cpu_scratch *s, const dc_layer *lay, size_t later, uint32_t B,
                       float scale, double *n2, dc_err *err) {
    const dc_layer *l = &lay[later], *o = &lay[l->tie - 1];
    const dc_layer *emb = l->kind == DC_LAYER_EMBEDDING ? l : o;
    const dc_layer *lin = l->kind == DC_LAYER_LINEAR ? l : o;
    double *no = n2 + (size_t)(l->tie - 1) * B, *nl = n2 + later * B;
    double s2 = (double)scale * (double)scale;
    size_t rows_e = (size_t)B * (size_t)emb->T, rows_l = (size_t)B * (size_t)lin->T;
    const float *e = dc_cpu_as_f32(&s->tie, &emb->grad, rows_e * (size_t)emb->d);
    const float *a = dc_cpu_as_f32(&s->in, &lin->input, rows_l * (size_t)lin->d);
    const float *g = dc_cpu_as_f32(&s->grad, &lin->grad, rows_l * (size_t)lin->p);
    if (!e || !a || !g || tie_combine(s, emb, lin, e, a, g, B, s2, no, nl)) goto oom;
    /* the later layer's own norm: its bias, if it is the linear one */
    memset(nl, 0, B * sizeof *nl);
    if (l->kind == DC_LAYER_LINEAR && l->has_bias) {
        if (bias_sqnorms(s, g, B, l->T, l->p, nl)) goto oom;
        for (uint32_t b = 0; b < B; b++) nl[b] *= s2;
    }
    return 0;

oom:
    return dc_err_set(err, DC_ENOSPACE, l->name, "out of memory for the CPU backend's scratch");
}
