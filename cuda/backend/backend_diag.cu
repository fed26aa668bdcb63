/* Failure diagnosis of the CUDA backend: what a failed step's status word
 * and per-sample flags point at, found on the host after the step's one
 * synchronisation (with extra synchronisations on this path only), and
 * reported exactly as the CPU backend words it. */
#include <math.h>
#include <string.h>

#include "backend_int.h"

namespace dcb {

namespace {

float load_one(cuda_backend *cb, const void *p, dc_dtype t, uint64_t i) {
    unsigned char raw[8] = {0};
    size_t sz = dc_dtype_size(t);
    if (cudaMemcpy(raw, (const char *)p + i * sz, sz, cudaMemcpyDeviceToHost) != cudaSuccess)
        return NAN;
    return dc_load_f32(raw, t, 0);
}

int64_t load_index(const void *p, dc_dtype t, uint64_t i) {
    if (t == DC_I32) {
        int32_t v = 0;
        cudaMemcpy(&v, (const int32_t *)p + i, 4, cudaMemcpyDeviceToHost);
        return v;
    }
    int64_t v = 0;
    cudaMemcpy(&v, (const int64_t *)p + i, 8, cudaMemcpyDeviceToHost);
    return v;
}

/* First bad element of a tensor, or -1 (or -2 on a CUDA error). */
int64_t find_bad(cuda_backend *cb, const void *p, dc_dtype t, uint64_t n, int64_t vocab) {
    unsigned long long *first = (unsigned long long *)(cb->ws + 8), h = ~0ull;
    if (cudaMemsetAsync(first, 0xff, 8, cb->stream) != cudaSuccess ||
        dcc_find_bad(p, t, n, vocab, first, cb->stream) != cudaSuccess ||
        cudaMemcpyAsync(&h, first, 8, cudaMemcpyDeviceToHost, cb->stream) != cudaSuccess ||
        cudaStreamSynchronize(cb->stream) != cudaSuccess)
        return -2;
    return h == ~0ull ? -1 : (int64_t)h;
}

int report_floats(cuda_backend *cb, const dc_layer *l, const dc_tensor *t, const char *what,
                  uint32_t B, int64_t w, dc_err *err) {
    uint64_t n = (uint64_t)B * (uint64_t)l->T * (uint64_t)w;
    int64_t i = find_bad(cb, t->data, t->dtype, n, 0);
    char f[128];
    if (i == -1) return 0;
    if (i < 0) return cuda_fail(cb, err, cudaGetLastError(), "the non-finite scan");
    int64_t row = i / w, col = i % w;
    snprintf(f, sizeof f, "%s.%s", l->name, what);
    return dc_err_set(err, DC_ENONFINITE, f,
                      "non-finite value %g in %s of sample %lld (position %lld, feature %lld)",
                      (double)load_one(cb, t->data, t->dtype, (uint64_t)i), what,
                      (long long)(row / l->T), (long long)(row % l->T), (long long)col);
}

int diagnose_layer(cuda_backend *cb, const dc_layer *l, uint32_t B, dc_err *err) {
    int rc;
    switch (l->kind) {
    case DC_LAYER_LINEAR:
        if ((rc = report_floats(cb, l, &l->input, "activations", B, l->d, err))) return rc;
        return report_floats(cb, l, &l->grad, "output_grad", B, l->p, err);
    case DC_LAYER_EMBEDDING: {
        uint64_t n = (uint64_t)B * (uint64_t)l->T;
        int64_t i = find_bad(cb, l->input.data, l->input.dtype, n, l->vocab);
        if (i >= 0) {
            char f[128];
            snprintf(f, sizeof f, "%s.indices", l->name);
            return dc_err_set(err, DC_EINVAL, f,
                              "index %lld of sample %lld (position %lld) is outside [0, %lld)",
                              (long long)load_index(l->input.data, l->input.dtype, (uint64_t)i),
                              (long long)(i / l->T), (long long)(i % l->T), (long long)l->vocab);
        }
        if (i < -1) return cuda_fail(cb, err, cudaGetLastError(), "the index scan");
        return report_floats(cb, l, &l->grad, "output_grad", B, l->d, err);
    }
    case DC_LAYER_LAYERNORM:
    case DC_LAYER_RMSNORM:
        if ((rc = report_floats(cb, l, &l->input, "input", B, l->d, err))) return rc;
        return report_floats(cb, l, &l->grad, "output_grad", B, l->d, err);
    }
    return 0;
}

} // namespace

int diagnose(cuda_backend *cb, const dc_step *s, const layout *Lo, dc_step_result *res,
             dc_err *err) {
    const char *h = cb->host;
    uint32_t status;
    unsigned long long bad;
    const uint32_t B = s->batch;
    memcpy(&status, h + Lo->status, 4);
    memcpy(&bad, h + Lo->bad, 8);
    const float *n2 = (const float *)(h + Lo->n2);
    const uint32_t *flags = (const uint32_t *)(h + Lo->flags);
    if (status & DCC_STATUS_INPUT) {
        for (size_t l = 0; l < s->n_layers; l++) {
            int64_t first = -1;
            for (uint32_t b = 0; b < B && first < 0; b++)
                if (flags[l * B + b] || !isfinite(n2[l * B + b])) first = b;
            if (first < 0) continue;
            int rc = diagnose_layer(cb, &s->layers[l], B, err);
            if (rc) return rc;
            return dc_err_set(err, DC_ENONFINITE, s->layers[l].name,
                              "the squared gradient norm of sample %lld is not finite "
                              "(overflow); nothing was written",
                              (long long)first);
        }
    }
    /* an output not finite in its dtype */
    int oi = (int)(bad >> 40), k = 0;
    uint64_t i = bad & (((uint64_t)1 << 40) - 1);
    const dcc_out *outs = (const dcc_out *)(h + al(Lo->dl_bytes) + Lo->outs);
    size_t l = 0;
    for (int seen = 0; l < s->n_layers; l++) {
        for (k = 0; k < 2; k++)
            if (want_out(&s->layers[l], k) && seen++ == oi) goto found;
    }
    return dc_err_set(err, DC_EINTERNAL, "", "step failed on the GPU (status %u)", status);
found : {
    char f[128];
    const dc_layer *ly = &s->layers[l];
    /* Whether and where it failed depends on the noise: the step released
     * something and is charged (dc_step_result.released). The value itself
     * is noised and not quoted. */
    res->released = true;
    snprintf(f, sizeof f, "%s.%s", ly->name, k ? "bias_grad_out" : "weight_grad_out");
    return dc_err_set(err, DC_ENONFINITE, f,
                      "clipped sum element %lld is not finite as %s (overflow); nothing was "
                      "written",
                      (long long)i, dc_dtype_name((dc_dtype)outs[oi].dtype));
}
}

int cuda_fail(cuda_backend *cb, dc_err *err, cudaError_t e, const char *what) {
    (void)cudaGetLastError(); /* clears a non-sticky error */
    if (cudaStreamSynchronize(cb->stream) != cudaSuccess) {
        cb->broken = true;
        snprintf(cb->broken_msg, sizeof cb->broken_msg, "%s: %s", what, cudaGetErrorString(e));
    }
    return dc_err_set(err, DC_EINTERNAL, "", "CUDA error in %s on cuda:%d: %s (%s)%s", what,
                      cb->device, cudaGetErrorString(e), cudaGetErrorName(e),
                      cb->broken ? "; the GPU context is unusable" : "");
}

/* A LINEAR layer's f32 copy of one tensor on the host (malloc'd), or NULL. */
static float *host_f32(const dc_tensor *t, size_t n) {
    size_t esz = dc_dtype_size(t->dtype);
    void *raw = malloc(n * esz + 1);
    float *out = (float *)malloc(n * sizeof(float) + 1);
    if (!raw || !out || cudaMemcpy(raw, t->data, n * esz, cudaMemcpyDeviceToHost) != cudaSuccess) {
        (void)cudaGetLastError();
        free(raw);
        free(out);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) out[i] = dc_load_f32(raw, t->dtype, i);
    free(raw);
    return out;
}

bool rescue_overflow(cuda_backend *cb, const dc_step *s, const layout *Lo, float grad_scale) {
    const char *h = cb->host;
    const uint32_t B = s->batch;
    const size_t L = s->n_layers;
    const float *n2 = (const float *)(h + Lo->n2);
    const uint32_t *flags = (const uint32_t *)(h + Lo->flags);
    uint32_t status;
    bool any = false;
    memcpy(&status, h + Lo->status, 4);
    if (status != DCC_STATUS_INPUT) return false; /* an output failed too: not this */
    if (L * B > cb->ovr_cap) {
        float *a = (float *)realloc(cb->ovr_n2, L * B * sizeof *a);
        if (a) cb->ovr_n2 = a;
        bool *m = a ? (bool *)realloc(cb->ovr, L * sizeof *m) : NULL;
        if (m) cb->ovr = m;
        if (!m) return false;
        cb->ovr_cap = L * B;
    }
    memset(cb->ovr, 0, L * sizeof *cb->ovr);
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &s->layers[l];
        bool bad = false;
        dc_err e;
        for (uint32_t b = 0; b < B; b++) {
            if (flags[l * B + b]) return false; /* a flagged input: a real failure */
            bad |= !isfinite(n2[l * B + b]);
        }
        if (!bad) continue;
        /* a tied pair's norms are not one layer's: no rescue */
        if (ly->kind != DC_LAYER_LINEAR || ly->tie || diagnose_layer(cb, ly, B, &e) != 0)
            return false;
        size_t rows = (size_t)B * (size_t)ly->T;
        float *a = host_f32(&ly->input, rows * (size_t)ly->d);
        float *g = a ? host_f32(&ly->grad, rows * (size_t)ly->p) : NULL;
        double *d2 = (double *)malloc(B * sizeof *d2);
        dc_cpu_scratch sc;
        memset(&sc, 0, sizeof sc);
        int rc = a && g && d2 ? dc_cpu_linear_sqnorms(&sc, a, g, B, ly->T, ly->d, ly->p,
                                                      ly->has_bias, dc_linear_pick(ly), d2)
                              : DC_ENOSPACE;
        for (uint32_t b = 0; rc == 0 && b < B; b++) {
            double v = d2[b] * (double)grad_scale * (double)grad_scale;
            if (!(v <= 3.4e38)) rc = DC_ENONFINITE; /* past f32 itself: no rescue */
            cb->ovr_n2[l * B + b] = (float)v;
        }
        dc_cpu_scratch_free(&sc);
        free(a);
        free(g);
        free(d2);
        if (rc) return false;
        cb->ovr[l] = any = true;
    }
    return any;
}

} // namespace dcb
