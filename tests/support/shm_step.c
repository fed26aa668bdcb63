/* Shared-memory steps for tests (shm_step.h). */
#include "shm_step.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* dc_test_layer_make numbers layers with static counters; the concurrent
 * tests build steps on several threads. */
static pthread_mutex_t g_make_mu = PTHREAD_MUTEX_INITIALIZER;

dpclip_dtype dc_shm_dtype(dc_dtype t) { return (dpclip_dtype)t; }

static size_t tensor_bytes(const dc_tensor *t) {
    return (size_t)dc_test_tensor_numel(t) * dc_dtype_size(t->dtype);
}

/* Copies t's data into the buffer (64-byte aligned) and points t there. */
static int place(dc_shm_step *s, dc_tensor *t) {
    size_t off = (s->used + 63) & ~(size_t)63, n;
    void *old = t->data;
    if (!old) return 0;
    n = tensor_bytes(t);
    if (off + n > s->size) {
        fprintf(stderr, "harness: shared buffer of %zu bytes is too small\n", s->size);
        return -1;
    }
    memcpy(s->base + off, old, n);
    t->data = s->base + off;
    s->used = off + n;
    return 0;
}

static dpclip_tensor wire(const dc_shm_step *s, const dc_tensor *t) {
    dpclip_tensor w;
    memset(&w, 0, sizeof w);
    if (!t->data) return w;
    w.buffer = s->wire_id ? s->wire_id : s->buf_id;
    w.offset = (uint64_t)((const uint8_t *)t->data - s->base);
    w.dtype = dc_shm_dtype(t->dtype);
    w.ndim = t->ndim;
    for (int i = 0; i < t->ndim; i++) w.shape[i] = t->shape[i];
    return w;
}

/* t's samples [b0, b0 + nb) (dimension 0 is the sample); nb 0: all of t. */
static dpclip_tensor wire_slice(const dc_shm_step *s, const dc_tensor *t, uint32_t b0,
                                uint32_t nb) {
    dpclip_tensor w = wire(s, t);
    uint64_t row = (uint64_t)dc_dtype_size(t->dtype);
    if (!nb || !t->data) return w;
    for (int i = 1; i < t->ndim; i++) row *= (uint64_t)t->shape[i];
    w.offset += b0 * row;
    w.shape[0] = nb;
    return w;
}

/* Adds ref layer i to a wire step (with its outputs or without), its inputs
 * cut to samples [b0, b0 + nb) (nb 0: all). */
static int add_wire_cut(dc_shm_step *s, dpclip_step *dst, size_t i, int outputs, uint32_t b0,
                        uint32_t nb) {
    const dc_layer *l = &s->ref.layers[i];
    const dc_tensor none = {0};
    const dc_tensor *wo = outputs ? &l->weight_grad_out : &none;
    const dc_tensor *bo = outputs ? &l->bias_grad_out : &none;
    switch (l->kind) {
    case DC_LAYER_LINEAR: {
        dpclip_linear x;
        memset(&x, 0, sizeof x);
        x.name = l->name;
        x.activations = wire_slice(s, &l->input, b0, nb);
        x.output_grad = wire_slice(s, &l->grad, b0, nb);
        x.has_bias = l->has_bias;
        x.algo = (dpclip_algo)l->algo;
        x.weight_grad_out = wire(s, wo);
        x.bias_grad_out = wire(s, bo);
        x.max_grad_norm = l->max_grad_norm;
        return dpclip_step_add_linear(dst, &x);
    }
    case DC_LAYER_EMBEDDING: {
        dpclip_embedding x;
        memset(&x, 0, sizeof x);
        x.name = l->name;
        x.indices = wire_slice(s, &l->input, b0, nb);
        x.output_grad = wire_slice(s, &l->grad, b0, nb);
        x.num_embeddings = (uint64_t)l->vocab;
        x.has_padding_idx = l->has_padding_idx;
        x.padding_idx = l->padding_idx;
        x.weight_grad_out = wire(s, wo);
        x.max_grad_norm = l->max_grad_norm;
        return dpclip_step_add_embedding(dst, &x);
    }
    case DC_LAYER_LAYERNORM:
    case DC_LAYER_RMSNORM: {
        dpclip_norm_layer x;
        memset(&x, 0, sizeof x);
        x.name = l->name;
        x.input = wire_slice(s, &l->input, b0, nb);
        x.output_grad = wire_slice(s, &l->grad, b0, nb);
        x.eps = l->eps;
        x.has_bias = l->has_bias;
        x.weight_grad_out = wire(s, wo);
        x.bias_grad_out = wire(s, bo);
        x.max_grad_norm = l->max_grad_norm;
        return l->kind == DC_LAYER_LAYERNORM ? dpclip_step_add_layernorm(dst, &x)
                                             : dpclip_step_add_rmsnorm(dst, &x);
    }
    }
    return DPCLIP_EARG;
}

static int add_wire_to(dc_shm_step *s, dpclip_step *dst, size_t i, int outputs) {
    return add_wire_cut(s, dst, i, outputs, 0, 0);
}

static int add_wire_layer(dc_shm_step *s, size_t i) { return add_wire_to(s, s->step, i, 1); }

int dc_shm_step_wire_layers_cut(dc_shm_step *s, dpclip_step *dst, const size_t *layers, size_t n,
                                int outputs, uint32_t b0, uint32_t nb) {
    int rc;
    if (nb == 0 || b0 + nb > s->ref.batch) return DPCLIP_EARG;
    for (size_t k = 0; k < n; k++)
        if (layers[k] >= s->ref.n_layers) return DPCLIP_EARG;
        else if ((rc = add_wire_cut(s, dst, layers[k], outputs, b0, nb))) return rc;
    return 0;
}

int dc_shm_step_wire_slice(dc_shm_step *s, dpclip_step *dst, uint32_t b0, uint32_t nb) {
    int rc;
    if (nb == 0 || b0 + nb > s->ref.batch) return DPCLIP_EARG;
    for (size_t i = 0; i < s->ref.n_layers; i++)
        if ((rc = add_wire_cut(s, dst, i, 1, b0, nb))) return rc;
    return 0;
}

int dc_shm_step_wire_layers(dc_shm_step *s, dpclip_step *dst, const size_t *layers, size_t n,
                            int outputs) {
    int rc;
    for (size_t k = 0; k < n; k++)
        if (layers[k] >= s->ref.n_layers) return DPCLIP_EARG;
        else if ((rc = add_wire_to(s, dst, layers[k], outputs))) return rc;
    return 0;
}

int dc_shm_step_init(dc_shm_step *s, dpclip_client *c, size_t capacity, uint32_t B,
                     const dpclip_clip_config *cfg) {
    void *base;
    int rc;

    memset(s, 0, sizeof *s);
    s->c = c;
    s->size = capacity ? capacity : (16u << 20);
    if ((rc = dpclip_buffer_alloc(c, s->size, &s->buf_id, &base))) {
        fprintf(stderr, "harness: dpclip_buffer_alloc: %s\n", dpclip_errmsg(c));
        return rc;
    }
    s->base = base;
    s->ref.batch = B;
    s->ref.device = -1;
    return dc_shm_step_set_config(s, cfg);
}

static void apply_config(dc_shm_step *s, const dpclip_clip_config *cfg) {
    uint32_t B = s->ref.batch;
    s->cfg = *cfg;
    s->ref.mode = cfg->mode == DPCLIP_PER_LAYER ? DC_CLIP_PER_LAYER : DC_CLIP_FLAT;
    s->ref.max_grad_norm = cfg->max_grad_norm;
    s->ref.reduction = cfg->reduction == DPCLIP_MEAN ? DC_REDUCTION_MEAN : DC_REDUCTION_SUM;
    s->ref.expected_batch = cfg->expected_batch_size ? cfg->expected_batch_size : B;
    s->ref.noise_multiplier = cfg->noise_multiplier;
}

static int wire_outputs(dc_shm_step *s) {
    dpclip_tensor wn = wire(s, &s->ref.norms_out), wc = wire(s, &s->ref.coefs_out);
    return dpclip_step_set_outputs(s->step, s->ref.norms_out.data ? &wn : NULL,
                                   s->ref.coefs_out.data ? &wc : NULL);
}

int dc_shm_step_set_config(dc_shm_step *s, const dpclip_clip_config *cfg) {
    int rc;
    apply_config(s, cfg);
    if (s->step) dpclip_step_free(s->step);
    if (!(s->step = dpclip_step_new(s->ref.batch, cfg))) return DPCLIP_ENOMEM;
    for (size_t i = 0; i < s->ref.n_layers; i++)
        if ((rc = add_wire_layer(s, i))) return rc;
    dpclip_step_want_layer_norms(s->step, s->ref.want_layer_norms);
    return wire_outputs(s);
}

int dc_shm_step_wire_buffer(dc_shm_step *s, uint64_t id) {
    s->wire_id = id;
    return dc_shm_step_set_config(s, &s->cfg);
}

void dc_shm_step_want_layer_norms(dc_shm_step *s, int yes) {
    s->ref.want_layer_norms = yes != 0;
    dpclip_step_want_layer_norms(s->step, yes);
}

/* Multiplies each sample's output gradients (all layers) by its own factor
 * spread over ~2 orders of magnitude, so that a batch has both clipped and
 * unclipped samples; re-rounds to the dtype so the data stays exact. */
static void spread_samples(dc_shm_step *s, size_t first, dc_test_rng *r) {
    uint32_t B = s->ref.batch;
    for (uint32_t b = 0; b < B; b++) {
        float f = (float)exp(1.2 * dc_test_normal(r));
        for (size_t i = first; i < s->ref.n_layers; i++) {
            dc_tensor *g = &s->ref.layers[i].grad;
            size_t per = (size_t)(dc_test_tensor_numel(g) / B);
            for (size_t j = (size_t)b * per; j < (size_t)(b + 1) * per; j++)
                dc_store_f32(g->data, g->dtype, j, f * dc_load_f32(g->data, g->dtype, j));
        }
    }
}

int dc_shm_step_add(dc_shm_step *s, const dc_test_layer_spec *spec, dc_test_rng *r,
                    float max_grad_norm) {
    dc_layer heap, l;
    size_t i = s->ref.n_layers;

    if (spec->B != s->ref.batch) return -1;
    if (s->ref.n_layers == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        dc_layer *nl = realloc(s->ref.layers, cap * sizeof *nl);
        if (!nl) return -1;
        s->ref.layers = nl;
        s->cap = cap;
    }
    pthread_mutex_lock(&g_make_mu);
    dc_test_layer_make(&heap, spec, r);
    pthread_mutex_unlock(&g_make_mu);
    l = heap;
    if (place(s, &l.input) || place(s, &l.grad) || place(s, &l.weight_grad_out) ||
        place(s, &l.bias_grad_out)) {
        dc_test_layer_free(&heap);
        return -1;
    }
    dc_test_layer_free(&heap);
    l.max_grad_norm = max_grad_norm;
    s->ref.layers[i] = l;
    s->ref.n_layers++;
    spread_samples(s, i, r);
    if (add_wire_layer(s, i) != 0) return -1;
    return (int)i;
}

int dc_shm_step_add_layer(dc_shm_step *s, const dc_layer *src) {
    dc_layer l = *src;
    size_t i = s->ref.n_layers;
    if (s->ref.n_layers == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        dc_layer *nl = realloc(s->ref.layers, cap * sizeof *nl);
        if (!nl) return -1;
        s->ref.layers = nl;
        s->cap = cap;
    }
    /* place() copies from t->data into the buffer and repoints t */
    if (place(s, &l.input) || place(s, &l.grad) || place(s, &l.weight_grad_out) ||
        place(s, &l.bias_grad_out))
        return -1;
    s->ref.layers[i] = l;
    s->ref.n_layers++;
    if (add_wire_layer(s, i) != 0) return -1;
    return (int)i;
}

int dc_shm_step_add_outputs(dc_shm_step *s, int norms, int coefs) {
    uint32_t B = s->ref.batch;
    if (norms) {
        s->ref.norms_out = dc_test_tensor_new(DC_F32, 1, B, 0, 0);
        void *heap = s->ref.norms_out.data;
        if (place(s, &s->ref.norms_out)) return -1;
        free(heap);
    }
    if (coefs) {
        s->ref.coefs_out = dc_test_tensor_new(DC_F32, 1, B, 0, 0);
        void *heap = s->ref.coefs_out.data;
        if (place(s, &s->ref.coefs_out)) return -1;
        free(heap);
    }
    return wire_outputs(s);
}

void dc_shm_step_refill(dc_shm_step *s, dc_test_rng *r) {
    for (size_t i = 0; i < s->ref.n_layers; i++) {
        dc_layer *l = &s->ref.layers[i];
        /* Indices keep their pattern of repeats (and padding); floats change. */
        if (dc_dtype_is_float(l->input.dtype)) dc_test_tensor_fill(&l->input, r, 1.0);
        dc_test_tensor_fill(&l->grad, r, 0.1);
    }
    spread_samples(s, 0, r);
}

static void fill_f32(dc_tensor *t, float v) {
    if (!t->data) return;
    for (int64_t i = 0; i < dc_test_tensor_numel(t); i++) ((float *)t->data)[i] = v;
}

void dc_shm_step_fill_outputs(dc_shm_step *s, float v) {
    for (size_t i = 0; i < s->ref.n_layers; i++) {
        fill_f32(&s->ref.layers[i].weight_grad_out, v);
        fill_f32(&s->ref.layers[i].bias_grad_out, v);
    }
    fill_f32(&s->ref.norms_out, v);
    fill_f32(&s->ref.coefs_out, v);
}

int64_t dc_shm_step_outputs(const dc_shm_step *s, float *out) {
    int64_t n = 0;
    for (size_t i = 0; i < s->ref.n_layers; i++) {
        const dc_tensor *ts[2] = {&s->ref.layers[i].weight_grad_out,
                                  &s->ref.layers[i].bias_grad_out};
        for (int k = 0; k < 2; k++) {
            int64_t m;
            if (!ts[k]->data) continue;
            m = dc_test_tensor_numel(ts[k]);
            if (out) memcpy(out + n, ts[k]->data, (size_t)m * sizeof(float));
            n += m;
        }
    }
    return n;
}

/* Runs dc_ref_step into s->norms etc. and into per-layer expected outputs
 * (w_exp/b_exp, caller frees via free_exp). */
static int run_ref(dc_shm_step *s, double ***w_exp, double ***b_exp) {
    size_t L = s->ref.n_layers, B = s->ref.batch;
    double **w, **b;

    free(s->norms);
    free(s->coefs);
    free(s->layer_sq);
    free(s->layer_coefs);
    s->norms = calloc(B, sizeof(double));
    s->coefs = calloc(B, sizeof(double));
    s->layer_sq = calloc(L * B, sizeof(double));
    s->layer_coefs = calloc(L * B, sizeof(double));
    w = calloc(L, sizeof *w);
    b = calloc(L, sizeof *b);
    if (!s->norms || !s->coefs || !s->layer_sq || !s->layer_coefs || !w || !b) abort();
    for (size_t i = 0; i < L; i++) {
        const dc_layer *l = &s->ref.layers[i];
        if (l->weight_grad_out.data)
            w[i] = calloc((size_t)dc_test_tensor_numel(&l->weight_grad_out), sizeof(double));
        if (l->bias_grad_out.data)
            b[i] = calloc((size_t)dc_test_tensor_numel(&l->bias_grad_out), sizeof(double));
    }
    dc_ref_step(&s->ref, s->norms, s->coefs, s->layer_sq,
                s->ref.mode == DC_CLIP_PER_LAYER ? s->layer_coefs : NULL, w, b);
    *w_exp = w;
    *b_exp = b;
    return 0;
}

static void free_exp(size_t L, double **w, double **b) {
    for (size_t i = 0; i < L; i++) {
        free(w[i]);
        free(b[i]);
    }
    free(w);
    free(b);
}

void dc_shm_step_ref_norms(dc_shm_step *s, double *out) {
    double **w, **b;
    run_ref(s, &w, &b);
    memcpy(out, s->norms, s->ref.batch * sizeof(double));
    free_exp(s->ref.n_layers, w, b);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double dc_shm_step_median_norm(dc_shm_step *s) {
    uint32_t B = s->ref.batch;
    double *n = malloc(B * sizeof *n), m;
    if (!n) abort();
    dc_shm_step_ref_norms(s, n);
    qsort(n, B, sizeof *n, cmp_double);
    m = B % 2 ? n[B / 2] : 0.5 * (n[B / 2 - 1] + n[B / 2]);
    free(n);
    return m;
}

void dc_shm_step_ref_outputs(dc_shm_step *s, double *out) {
    double **w, **b;
    int64_t n = 0;
    run_ref(s, &w, &b);
    for (size_t i = 0; i < s->ref.n_layers; i++) {
        const dc_layer *l = &s->ref.layers[i];
        if (w[i]) {
            int64_t m = dc_test_tensor_numel(&l->weight_grad_out);
            memcpy(out + n, w[i], (size_t)m * sizeof(double));
            n += m;
        }
        if (b[i]) {
            int64_t m = dc_test_tensor_numel(&l->bias_grad_out);
            memcpy(out + n, b[i], (size_t)m * sizeof(double));
            n += m;
        }
    }
    free_exp(s->ref.n_layers, w, b);
}

/* Compares n floats with the reference. Norms and coefficients are sums of
 * squares (no cancellation): plain relative error. Gradient sums (`scaled`)
 * have entries that cancel to near zero, whose relative error means
 * nothing: there atol grows with the array's magnitude. Prints and returns
 * the error measure. */
static double cmp(const char *what, size_t layer, const float *got, const double *want, int64_t n,
                  double rtol, double atol, int scaled) {
    double mx = 0.0, e;
    for (int64_t i = 0; i < n; i++)
        if (fabs(want[i]) > mx) mx = fabs(want[i]);
    e = dc_test_max_relerr_f(got, want, n, rtol, atol + (scaled ? rtol * mx : 0.0));
    if (e > 1.0 || isnan(e)) {
        int64_t worst = 0;
        double we = -1.0;
        for (int64_t i = 0; i < n; i++) {
            double d = fabs((double)got[i] - want[i]);
            if (d > we || isnan(d)) {
                we = d;
                worst = i;
            }
        }
        fprintf(stderr, "harness: %s (layer %zu): error %.3g; worst [%lld] got %.9g want %.9g\n",
                what, layer, e, (long long)worst, (double)got[worst], want[worst]);
        if (isnan(e)) e = INFINITY;
    }
    return e;
}

static double max2(double a, double b) { return a > b ? a : b; }

double dc_shm_step_check(dc_shm_step *s, const dpclip_result *res, double rtol, double atol) {
    size_t L = s->ref.n_layers, B = s->ref.batch;
    double **w, **b, worst = 0.0;
    double *tmp;

    if (res->batch != B) {
        fprintf(stderr, "harness: result batch %u, expected %zu\n", res->batch, B);
        return INFINITY;
    }
    run_ref(s, &w, &b);
    worst = max2(worst, cmp("norms", 0, res->norms, s->norms, (int64_t)B, rtol, atol, 0));
    worst = max2(worst, cmp("coefs", 0, res->coefs, s->coefs, (int64_t)B, rtol, atol, 0));
    tmp = malloc(L * B * sizeof *tmp);
    if (!tmp) abort();
    if (res->layer_norms) {
        for (size_t i = 0; i < L * B; i++) tmp[i] = sqrt(s->layer_sq[i]);
        worst = max2(worst,
                     cmp("layer_norms", 0, res->layer_norms, tmp, (int64_t)(L * B), rtol, atol, 0));
    } else if (s->ref.mode == DC_CLIP_PER_LAYER || s->ref.want_layer_norms) {
        fprintf(stderr, "harness: layer norms missing from the result\n");
        worst = INFINITY;
    }
    if (s->ref.mode == DC_CLIP_PER_LAYER) {
        if (!res->layer_coefs) {
            fprintf(stderr, "harness: layer coefficients missing from the result\n");
            worst = INFINITY;
        } else {
            worst = max2(worst, cmp("layer_coefs", 0, res->layer_coefs, s->layer_coefs,
                                    (int64_t)(L * B), rtol, atol, 0));
        }
    }
    free(tmp);
    for (size_t i = 0; i < L; i++) {
        const dc_layer *l = &s->ref.layers[i];
        if (w[i])
            worst = max2(worst, cmp("weight_grad_out", i, l->weight_grad_out.data, w[i],
                                    dc_test_tensor_numel(&l->weight_grad_out), rtol, atol, 1));
        if (b[i])
            worst = max2(worst, cmp("bias_grad_out", i, l->bias_grad_out.data, b[i],
                                    dc_test_tensor_numel(&l->bias_grad_out), rtol, atol, 1));
    }
    if (s->ref.norms_out.data)
        worst = max2(worst, cmp("norms_out", 0, s->ref.norms_out.data, s->norms, (int64_t)B, rtol,
                                atol, 0));
    if (s->ref.coefs_out.data)
        worst = max2(worst, cmp("coefs_out", 0, s->ref.coefs_out.data, s->coefs, (int64_t)B, rtol,
                                atol, 0));
    free_exp(L, w, b);
    return worst;
}

void dc_shm_step_free(dc_shm_step *s) {
    if (s->step) dpclip_step_free(s->step);
    if (s->c && s->buf_id) dpclip_buffer_release(s->c, s->buf_id);
    free(s->ref.layers);
    free(s->norms);
    free(s->coefs);
    free(s->layer_sq);
    free(s->layer_coefs);
    memset(s, 0, sizeof *s);
}
