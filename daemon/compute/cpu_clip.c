/* Book-keeping on the CPU: the clipped gradient sums sum_b c_b G_b without
 * forming any per-sample gradient (docs/design.md: one GEMM for a Linear). */
#include <cblas.h>
#include <limits.h>
#include <string.h>

#include "cpu.h"

/* Linear: W = (diag(c) g)^T a over all B*T rows (c broadcast over each
 * sample's T rows): scale the g rows into scratch, then one sgemm with
 * K = B*T (beta 1 adds to w: a tied weight's second use). Bias: sum_b c_b
 * sum_t g_t, accumulated in double. */
static int linear_sum(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, const float *c,
                      const float *a, const float *g, float *w, float *bias, float beta) {
    size_t T = (size_t)l->T, p = (size_t)l->p, d = (size_t)l->d, rows = (size_t)B * T;
    if (w) {
        float *gs = dc_cpu_buf_reserve(&s->work, rows * p * sizeof(float));
        if (!gs) return DC_ENOSPACE;
        for (size_t r = 0; r < rows; r++) {
            float cb = c[r / T];
            const float *src = g + r * p;
            float *dst = gs + r * p;
            for (size_t j = 0; j < p; j++) dst[j] = cb * src[j];
        }
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)p, (int)d, (int)rows, 1.0f, gs,
                    (int)p, a, (int)d, beta, w, (int)d);
    }
    if (bias) {
        double *acc = dc_cpu_buf_reserve(&s->work2, p * sizeof(double));
        if (!acc) return DC_ENOSPACE;
        memset(acc, 0, p * sizeof(double));
        for (size_t r = 0; r < rows; r++) {
            double cb = c[r / T];
            const float *src = g + r * p;
            for (size_t j = 0; j < p; j++) acc[j] += cb * (double)src[j];
        }
        for (size_t j = 0; j < p; j++) bias[j] = (float)acc[j];
    }
    return 0;
}

/* Embedding: scatter-add c_b g_t into row i_t (into w as it is with add:
 * a tied weight's second use); padding rows get nothing. */
static void embedding_sum(const dc_layer *l, uint32_t B, const float *c, const float *g, float *w,
                          bool add) {
    size_t T = (size_t)l->T, d = (size_t)l->d;
    if (!add) memset(w, 0, (size_t)l->vocab * d * sizeof(float));
    for (size_t r = 0; r < (size_t)B * T; r++) {
        int64_t v = dc_cpu_index(&l->input, r);
        if (l->has_padding_idx && v == l->padding_idx) continue;
        float cb = c[r / T];
        const float *src = g + r * d;
        float *dst = w + (size_t)v * d;
        for (size_t j = 0; j < d; j++) dst[j] += cb * src[j];
    }
}

/* LayerNorm / RMSNorm: the per-sample vectors are O(T*d) to rebuild, so they
 * are recomputed here rather than kept from the norm pass. */
static int norm_sum(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, const float *c,
                    const float *x, const float *g, float *w, float *bias) {
    size_t d = (size_t)l->d;
    bool has_b = l->kind == DC_LAYER_LAYERNORM && l->has_bias;
    double *buf = dc_cpu_buf_reserve(&s->work2, 4 * d * sizeof(double));
    if (!buf) return DC_ENOSPACE;
    double *wg = buf, *bg = buf + d, *wacc = buf + 2 * d, *bacc = buf + 3 * d;
    memset(wacc, 0, 2 * d * sizeof(double));
    for (uint32_t b = 0; b < B; b++) {
        dc_cpu_norm_sample(l, x, g, b, wg, has_b ? bg : NULL);
        for (size_t j = 0; j < d; j++) wacc[j] += (double)c[b] * wg[j];
        if (has_b)
            for (size_t j = 0; j < d; j++) bacc[j] += (double)c[b] * bg[j];
    }
    if (w)
        for (size_t j = 0; j < d; j++) w[j] = (float)wacc[j];
    if (bias && has_b)
        for (size_t j = 0; j < d; j++) bias[j] = (float)bacc[j];
    return 0;
}

/* w (and bias) = layer l's clipped sums; add: w += its weight's (bias is
 * then NULL). */
static int clipped(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, const float *c, float *w,
                   float *bias, bool add, dc_err *err) {
    size_t rows = (size_t)B * (size_t)l->T;
    const float *x, *g;
    int rc = 0;

    if (dc_cpu_layer_f32(s, l, B, &x, &g)) goto oom;
    switch (l->kind) {
    case DC_LAYER_LINEAR:
        if (rows > INT_MAX)
            return dc_err_set(err, DC_EINVAL, l->name,
                              "batch * sequence length %zu is too large for the CPU backend", rows);
        rc = linear_sum(s, l, B, c, x, g, w, bias, add ? 1.0f : 0.0f);
        break;
    case DC_LAYER_EMBEDDING:
        if (w) embedding_sum(l, B, c, g, w, add);
        break;
    case DC_LAYER_LAYERNORM:
    case DC_LAYER_RMSNORM: rc = norm_sum(s, l, B, c, x, g, w, bias); break;
    default: return dc_err_set(err, DC_EINVAL, l->name, "unknown layer kind %d", (int)l->kind);
    }
    if (rc) goto oom;
    return 0;

oom:
    return dc_err_set(err, DC_ENOSPACE, l->name, "out of memory for the CPU backend's scratch");
}

int dc_cpu_layer_clipped_sum(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, const float *c,
                             float *w, float *bias, dc_err *err) {
    return clipped(s, l, B, c, w, bias, false, err);
}

int dc_cpu_layer_clipped_add(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, const float *c,
                             float *w, dc_err *err) {
    return clipped(s, l, B, c, w, NULL, true, err);
}
