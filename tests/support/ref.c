/* The naive reference (ref.h): every per-sample gradient is formed
 * explicitly in double and summed or squared from there. Deliberately
 * simple and slow; it shares nothing with the backends but step.h and the
 * dtype conversions. */
#include "ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- random data -------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void dc_test_rng_seed(dc_test_rng *r, uint64_t seed) {
    r->s[0] = splitmix64(&seed);
    r->s[1] = splitmix64(&seed);
    if (!r->s[0] && !r->s[1]) r->s[1] = 1; /* xoroshiro must not be all zero */
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoroshiro128++ */
uint64_t dc_test_next(dc_test_rng *r) {
    uint64_t s0 = r->s[0], s1 = r->s[1];
    uint64_t out = rotl(s0 + s1, 17) + s0;
    s1 ^= s0;
    r->s[0] = rotl(s0, 49) ^ s1 ^ (s1 << 21);
    r->s[1] = rotl(s1, 28);
    return out;
}

double dc_test_uniform(dc_test_rng *r) {
    return (double)(dc_test_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

double dc_test_normal(dc_test_rng *r) {
    double u1 = 1.0 - dc_test_uniform(r); /* (0, 1] */
    double u2 = dc_test_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

int64_t dc_test_range(dc_test_rng *r, int64_t lo, int64_t hi) {
    if (hi <= lo) return lo;
    uint64_t span = (uint64_t)(hi - lo) + 1;
    return lo + (int64_t)(span ? dc_test_next(r) % span : dc_test_next(r));
}

dc_tensor dc_test_tensor_new(dc_dtype dtype, int ndim, int64_t s0, int64_t s1, int64_t s2) {
    dc_tensor t;
    int64_t s[3] = {s0, s1, s2};
    memset(&t, 0, sizeof t);
    t.dtype = dtype;
    t.ndim = ndim;
    for (int i = 0; i < ndim; i++) t.shape[i] = s[i];
    size_t n = (size_t)dc_test_tensor_numel(&t);
    t.data = calloc(n ? n : 1, dc_dtype_size(dtype));
    if (!t.data) {
        fprintf(stderr, "dc_test_tensor_new: out of memory\n");
        abort();
    }
    return t;
}

void dc_test_tensor_free(dc_tensor *t) {
    free(t->data);
    t->data = NULL;
}

int64_t dc_test_tensor_numel(const dc_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

void dc_test_tensor_fill(dc_tensor *t, dc_test_rng *r, double scale) {
    int64_t n = dc_test_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        if (dc_dtype_is_float(t->dtype)) {
            dc_store_f32(t->data, t->dtype, (size_t)i, (float)(scale * dc_test_normal(r)));
        } else {
            int64_t v = dc_test_range(r, 0, (int64_t)scale - 1);
            if (t->dtype == DC_I32) ((int32_t *)t->data)[i] = (int32_t)v;
            else ((int64_t *)t->data)[i] = v;
        }
    }
}

static void set_index(dc_tensor *t, size_t i, int64_t v) {
    if (t->dtype == DC_I32) ((int32_t *)t->data)[i] = (int32_t)v;
    else ((int64_t *)t->data)[i] = v;
}

static int64_t get_index(const dc_tensor *t, size_t i) {
    return t->dtype == DC_I32 ? ((const int32_t *)t->data)[i] : ((const int64_t *)t->data)[i];
}

/* A [B,T,w] tensor, or [B,w] when T == 0 (2D input). */
static dc_tensor seq_tensor(dc_dtype dt, uint32_t B, int64_t T, int64_t w) {
    return T ? dc_test_tensor_new(dt, 3, B, T, w) : dc_test_tensor_new(dt, 2, B, w, 0);
}

static void make_indices(dc_layer *l, const dc_test_layer_spec *sp, dc_test_rng *r) {
    uint32_t B = sp->B;
    int64_t T = l->T, V = l->vocab;
    /* i32 or i64 at random, so that a few seeds cover both index types */
    dc_dtype it = (dc_test_next(r) & 1) ? DC_I32 : DC_I64;
    l->input = sp->T ? dc_test_tensor_new(it, 2, B, T, 0) : dc_test_tensor_new(it, 1, B, 0, 0);
    l->has_padding_idx = (dc_test_next(r) & 1) != 0;
    l->padding_idx = l->has_padding_idx ? dc_test_range(r, 0, V - 1) : 0;
    if (sp->distinct_indices && T <= V) {
        /* partial Fisher-Yates per sample: T distinct values of [0, V) */
        int64_t *perm = malloc((size_t)V * sizeof *perm);
        if (!perm) abort();
        for (uint32_t b = 0; b < B; b++) {
            for (int64_t v = 0; v < V; v++) perm[v] = v;
            for (int64_t t = 0; t < T; t++) {
                int64_t j = dc_test_range(r, t, V - 1);
                int64_t x = perm[t];
                perm[t] = perm[j];
                perm[j] = x;
                set_index(&l->input, (size_t)b * T + t, perm[t]);
            }
        }
        free(perm);
        return;
    }
    /* Repeats: each sample draws from a small pool of values; about one
     * position in five is padding when there is a padding index. */
    int64_t k = T / 3 + 1;
    if (k > V) k = V;
    int64_t *pool = malloc((size_t)k * sizeof *pool);
    if (!pool) abort();
    for (uint32_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < k; i++) pool[i] = dc_test_range(r, 0, V - 1);
        for (int64_t t = 0; t < T; t++) {
            int64_t v = pool[dc_test_range(r, 0, k - 1)];
            if (l->has_padding_idx && dc_test_uniform(r) < 0.2) v = l->padding_idx;
            set_index(&l->input, (size_t)b * T + t, v);
        }
    }
    free(pool);
}

void dc_test_layer_make(dc_layer *l, const dc_test_layer_spec *sp, dc_test_rng *r) {
    static unsigned serial[5]; /* names lin0, emb0, ln0, rms0, ... (tests are single-threaded) */
    static const char *const prefix[5] = {"layer", "lin", "emb", "ln", "rms"};
    uint32_t B = sp->B;
    int k = (int)sp->kind >= 1 && (int)sp->kind <= 4 ? (int)sp->kind : 0;

    memset(l, 0, sizeof *l);
    l->kind = sp->kind;
    snprintf(l->name, sizeof l->name, "%s%u", prefix[k], serial[k]++);
    l->T = sp->T ? sp->T : 1;
    l->d = sp->d;
    l->max_grad_norm = 1.0f;
    switch (sp->kind) {
    case DC_LAYER_LINEAR:
        l->p = sp->p;
        l->input = seq_tensor(sp->dtype, B, sp->T, l->d);
        l->grad = seq_tensor(sp->dtype, B, sp->T, l->p);
        dc_test_tensor_fill(&l->input, r, 1.0);
        dc_test_tensor_fill(&l->grad, r, 0.1);
        l->has_bias = sp->has_bias != 0;
        l->algo = sp->algo;
        if (sp->with_outputs) {
            l->weight_grad_out = dc_test_tensor_new(DC_F32, 2, l->p, l->d, 0);
            if (l->has_bias) l->bias_grad_out = dc_test_tensor_new(DC_F32, 1, l->p, 0, 0);
        }
        break;
    case DC_LAYER_EMBEDDING:
        l->vocab = sp->p;
        make_indices(l, sp, r);
        l->grad = seq_tensor(sp->dtype, B, sp->T, l->d);
        dc_test_tensor_fill(&l->grad, r, 0.1);
        if (sp->with_outputs) l->weight_grad_out = dc_test_tensor_new(DC_F32, 2, l->vocab, l->d, 0);
        break;
    case DC_LAYER_LAYERNORM:
    case DC_LAYER_RMSNORM: {
        l->input = seq_tensor(sp->dtype, B, sp->T, l->d);
        l->grad = seq_tensor(sp->dtype, B, sp->T, l->d);
        /* rows with their own offset and spread, so mean and variance matter */
        for (int64_t row = 0; row < (int64_t)B * l->T; row++) {
            double mu = 0.5 * dc_test_normal(r), sd = 0.5 + 1.5 * dc_test_uniform(r);
            for (int64_t j = 0; j < l->d; j++)
                dc_store_f32(l->input.data, sp->dtype, (size_t)(row * l->d + j),
                             (float)(mu + sd * dc_test_normal(r)));
        }
        dc_test_tensor_fill(&l->grad, r, 0.1);
        l->eps = 1e-5f;
        l->has_bias = sp->kind == DC_LAYER_LAYERNORM && sp->has_bias;
        if (sp->with_outputs) {
            l->weight_grad_out = dc_test_tensor_new(DC_F32, 1, l->d, 0, 0);
            if (l->has_bias) l->bias_grad_out = dc_test_tensor_new(DC_F32, 1, l->d, 0, 0);
        }
        break;
    }
    }
}

void dc_test_layer_free(dc_layer *l) {
    dc_test_tensor_free(&l->input);
    dc_test_tensor_free(&l->grad);
    dc_test_tensor_free(&l->weight_grad_out);
    dc_test_tensor_free(&l->bias_grad_out);
}

void dc_test_tied_pair(dc_layer *ls, size_t at, uint32_t B, int64_t Te, int64_t Tl, int64_t d,
                       int64_t V, dc_dtype dt, int has_bias, int embedding_first, dc_test_rng *r) {
    dc_test_layer_spec e = {DC_LAYER_EMBEDDING, B, Te, d, V, dt, 0, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec n = {DC_LAYER_LINEAR, B, Tl, d, V, dt, has_bias, DC_ALGO_AUTO, 1, 0};
    dc_layer *le = &ls[embedding_first ? 0 : 1], *ln = &ls[embedding_first ? 1 : 0];
    dc_test_layer_make(le, &e, r);
    dc_test_layer_make(ln, &n, r);
    dc_test_tensor_free(&ls[1].weight_grad_out);
    memset(&ls[1].weight_grad_out, 0, sizeof ls[1].weight_grad_out);
    ls[0].tie = (uint32_t)at + 2;
    ls[0].tie_owner = true;
    ls[1].tie = (uint32_t)at + 1;
    ls[1].tie_owner = false;
}

/* --- the reference -------------------------------------------------------- */

static size_t weight_numel(const dc_layer *l) {
    switch (l->kind) {
    case DC_LAYER_LINEAR: return (size_t)l->p * (size_t)l->d;
    case DC_LAYER_EMBEDDING: return (size_t)l->vocab * (size_t)l->d;
    default: return (size_t)l->d;
    }
}

static size_t bias_numel(const dc_layer *l) {
    if (!l->has_bias) return 0;
    if (l->kind == DC_LAYER_LINEAR) return (size_t)l->p;
    if (l->kind == DC_LAYER_LAYERNORM) return (size_t)l->d;
    return 0;
}

static double ld(const dc_tensor *t, size_t i) { return (double)dc_load_f32(t->data, t->dtype, i); }

/* Sample b's full per-sample gradient, output grads times scale: gw
 * [weight_numel], gb [bias_numel] (may be NULL when there is no bias). */
void dc_ref_layer_sample_grad(const dc_layer *l, uint32_t b, double scale, double *gw, double *gb) {
    size_t T = (size_t)l->T, d = (size_t)l->d, nb = bias_numel(l);
    memset(gw, 0, weight_numel(l) * sizeof *gw);
    if (gb) memset(gb, 0, (nb ? nb : 1) * sizeof *gb);
    for (size_t t = 0; t < T; t++) {
        size_t row = (size_t)b * T + t;
        switch (l->kind) {
        case DC_LAYER_LINEAR: {
            size_t p = (size_t)l->p;
            for (size_t i = 0; i < p; i++) {
                double gi = scale * ld(&l->grad, row * p + i);
                for (size_t j = 0; j < d; j++) gw[i * d + j] += gi * ld(&l->input, row * d + j);
                if (gb && nb) gb[i] += gi;
            }
            break;
        }
        case DC_LAYER_EMBEDDING: {
            int64_t v = get_index(&l->input, row);
            if (v < 0 || v >= l->vocab) break; /* the backend rejects these */
            if (l->has_padding_idx && v == l->padding_idx) break;
            for (size_t j = 0; j < d; j++)
                gw[(size_t)v * d + j] += scale * ld(&l->grad, row * d + j);
            break;
        }
        case DC_LAYER_LAYERNORM:
        case DC_LAYER_RMSNORM: {
            double mean = 0.0, var = 0.0;
            if (l->kind == DC_LAYER_LAYERNORM) {
                for (size_t j = 0; j < d; j++) mean += ld(&l->input, row * d + j);
                mean /= (double)d;
            }
            for (size_t j = 0; j < d; j++) {
                double c = ld(&l->input, row * d + j) - mean;
                var += c * c;
            }
            var /= (double)d;
            double rstd = 1.0 / sqrt(var + (double)l->eps);
            for (size_t j = 0; j < d; j++) {
                double g = scale * ld(&l->grad, row * d + j);
                gw[j] += g * (ld(&l->input, row * d + j) - mean) * rstd;
                if (gb && nb) gb[j] += g;
            }
            break;
        }
        }
    }
}

static void *xcalloc(size_t n, size_t sz) {
    void *p = calloc(n ? n : 1, sz);
    if (!p) {
        fprintf(stderr, "ref: out of memory\n");
        abort();
    }
    return p;
}

void dc_ref_layer_sqnorms(const dc_layer *l, uint32_t B, double scale, double *out) {
    size_t nw = weight_numel(l), nb = bias_numel(l);
    double *gw = xcalloc(nw, sizeof *gw), *gb = xcalloc(nb, sizeof *gb);
    for (uint32_t b = 0; b < B; b++) {
        dc_ref_layer_sample_grad(l, b, scale, gw, gb);
        double s = 0.0;
        for (size_t i = 0; i < nw; i++) s += gw[i] * gw[i];
        for (size_t i = 0; i < nb; i++) s += gb[i] * gb[i];
        out[b] = s;
    }
    free(gw);
    free(gb);
}

void dc_ref_layer_clipped_sum(const dc_layer *l, uint32_t B, double scale, const double *coef,
                              double *w_out, double *b_out) {
    size_t nw = weight_numel(l), nb = bias_numel(l);
    double *gw = xcalloc(nw, sizeof *gw), *gb = xcalloc(nb, sizeof *gb);
    if (w_out) memset(w_out, 0, nw * sizeof *w_out);
    if (b_out && nb) memset(b_out, 0, nb * sizeof *b_out);
    for (uint32_t b = 0; b < B; b++) {
        dc_ref_layer_sample_grad(l, b, scale, gw, gb);
        if (w_out)
            for (size_t i = 0; i < nw; i++) w_out[i] += coef[b] * gw[i];
        if (b_out)
            for (size_t i = 0; i < nb; i++) b_out[i] += coef[b] * gb[i];
    }
    free(gw);
    free(gb);
}

void dc_ref_step(const dc_step *s, double *norms, double *coefs, double *layer_sq,
                 double *layer_coefs, double **w_exp, double **b_exp) {
    uint32_t B = s->batch;
    size_t L = s->n_layers;
    double scale = s->reduction == DC_REDUCTION_MEAN ? (double)B : 1.0;
    double div = s->reduction == DC_REDUCTION_MEAN
                     ? (double)(s->expected_batch ? s->expected_batch : B)
                     : 1.0;
    bool per_layer = s->mode == DC_CLIP_PER_LAYER;
    double *lsq = layer_sq ? layer_sq : xcalloc(L * B, sizeof *lsq);
    double *lc = per_layer ? (layer_coefs ? layer_coefs : xcalloc(L * B, sizeof *lc)) : NULL;
    double *c = xcalloc(B, sizeof *c);

    for (size_t l = 0; l < L; l++) dc_ref_layer_sqnorms(&s->layers[l], B, scale, lsq + l * B);
    /* tied pairs: the owner's norm is the shared weight's, both uses'
     * per-sample gradients summed explicitly; the later layer's, its bias's */
    for (size_t l = 0; l < L; l++) {
        const dc_layer *t = &s->layers[l];
        if (!t->tie || t->tie_owner) continue;
        const dc_layer *o = &s->layers[t->tie - 1];
        size_t nw = weight_numel(o), nbo = bias_numel(o), nbt = bias_numel(t);
        double *go = xcalloc(nw, sizeof *go), *gt = xcalloc(nw, sizeof *gt);
        double *bo = xcalloc(nbo, sizeof *bo), *bt = xcalloc(nbt, sizeof *bt);
        for (uint32_t b = 0; b < B; b++) {
            double so = 0.0, st = 0.0;
            dc_ref_layer_sample_grad(o, b, scale, go, bo);
            dc_ref_layer_sample_grad(t, b, scale, gt, bt);
            for (size_t i = 0; i < nw; i++) so += (go[i] + gt[i]) * (go[i] + gt[i]);
            for (size_t i = 0; i < nbo; i++) so += bo[i] * bo[i];
            for (size_t i = 0; i < nbt; i++) st += bt[i] * bt[i];
            lsq[(t->tie - 1) * B + b] = so;
            lsq[l * B + b] = st;
        }
        free(go);
        free(gt);
        free(bo);
        free(bt);
    }
    for (uint32_t b = 0; b < B; b++) {
        double tot = 0.0;
        for (size_t l = 0; l < L; l++) tot += lsq[l * B + b];
        double n = sqrt(tot);
        double cf = per_layer ? 1.0 : fmin(1.0, (double)s->max_grad_norm / (n + 1e-6));
        if (norms) norms[b] = n;
        if (coefs) coefs[b] = cf;
        c[b] = cf;
    }
    if (per_layer)
        for (size_t l = 0; l < L; l++)
            for (uint32_t b = 0; b < B; b++)
                lc[l * B + b] = fmin(1.0, (double)s->layers[l].max_grad_norm /
                                              (sqrt(lsq[l * B + b]) + 1e-6));
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &s->layers[l];
        double *w = w_exp && ly->weight_grad_out.data ? w_exp[l] : NULL;
        double *bo = b_exp && ly->bias_grad_out.data && bias_numel(ly) ? b_exp[l] : NULL;
        if (!w && !bo) continue;
        dc_ref_layer_clipped_sum(ly, B, scale, per_layer ? lc + l * B : c, w, bo);
        if (w && ly->tie_owner) { /* the other use of the shared weight */
            const dc_layer *t = &s->layers[ly->tie - 1];
            double *w2 = xcalloc(weight_numel(t), sizeof *w2);
            dc_ref_layer_clipped_sum(t, B, scale, c, w2, NULL);
            for (size_t i = 0; i < weight_numel(ly); i++) w[i] += w2[i];
            free(w2);
        }
        if (w)
            for (size_t i = 0; i < weight_numel(ly); i++) w[i] /= div;
        if (bo)
            for (size_t i = 0; i < bias_numel(ly); i++) bo[i] /= div;
    }
    if (!layer_sq) free(lsq);
    if (per_layer && !layer_coefs) free(lc);
    free(c);
}

double dc_test_max_relerr_f(const float *got, const double *want, int64_t n, double rtol,
                            double atol) {
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]) / (atol + rtol * fabs(want[i]));
        if (isnan(e)) return INFINITY;
        if (e > worst) worst = e;
    }
    return worst;
}

double dc_test_rtol(dc_dtype t) { return t == DC_F32 ? 1e-4 : 1e-3; }
