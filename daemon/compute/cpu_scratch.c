/* The CPU backend's scratch (cpu.h): buffers a worker keeps between steps,
 * grown and trimmed here, and a layer's inputs read as f32 into them. The
 * backend (backend_cpu.c) and its stages (cpu_norms.c, cpu_clip.c) build on
 * it; it calls none of them. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "dc_dtype.h"

void *dc_cpu_buf_reserve(dc_cpu_buf *b, size_t bytes) {
    if (bytes > b->used) b->used = bytes;
    if (bytes <= b->cap && b->p) return b->p;
    /* Grow by at least half again so slowly increasing shapes do not
     * reallocate every step; 64-byte alignment suits AVX-512 loads. */
    size_t want = bytes + bytes / 2;
    if (want < bytes) want = bytes;
    want = (want + 63) & ~(size_t)63;
    if (want < bytes) return NULL;
    void *p = aligned_alloc(64, want ? want : 64);
    if (!p) return NULL;
    free(b->p);
    b->p = p;
    b->cap = want;
    return p;
}

void dc_cpu_buf_free(dc_cpu_buf *b) {
    free(b->p);
    b->p = NULL;
    b->cap = 0;
    b->used = 0;
}

void dc_cpu_scratch_free(dc_cpu_scratch *s) {
    dc_cpu_buf_free(&s->in);
    dc_cpu_buf_free(&s->grad);
    dc_cpu_buf_free(&s->work);
    dc_cpu_buf_free(&s->work2);
    dc_cpu_buf_free(&s->order);
    dc_cpu_buf_free(&s->out);
    dc_cpu_buf_free(&s->stats);
    dc_cpu_buf_free(&s->layers);
    dc_cpu_buf_free(&s->idx);
    dc_cpu_buf_free(&s->scaled);
    dc_cpu_buf_free(&s->tie);
}

/* Scratch a worker keeps between steps whatever they needed. */
#define SCRATCH_KEEP ((size_t)16 << 20)

/* After a step: a buffer over SCRATCH_KEEP that this step used less than
 * half of goes back to the system, so one outlier step does not leave an
 * idle worker holding its peak; steady large steps keep theirs. */
void dc_cpu_scratch_trim(dc_cpu_scratch *s) {
    dc_cpu_buf *all[] = {&s->in,    &s->grad,   &s->work, &s->work2,  &s->order, &s->out,
                         &s->stats, &s->layers, &s->idx,  &s->scaled, &s->tie};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        dc_cpu_buf *b = all[i];
        if (b->cap > SCRATCH_KEEP && b->used < b->cap / 2) dc_cpu_buf_free(b);
        b->used = 0;
    }
}

size_t dc_cpu_scratch_bytes(const dc_cpu_scratch *s) {
    const dc_cpu_buf *all[] = {&s->in,    &s->grad,   &s->work, &s->work2,  &s->order, &s->out,
                               &s->stats, &s->layers, &s->idx,  &s->scaled, &s->tie};
    size_t n = 0;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) n += all[i]->cap;
    return n;
}

size_t dc_cpu_numel(const dc_tensor *t) {
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

int dc_cpu_layer_f32(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, const float **x,
                     const float **g) {
    size_t rows = (size_t)B * (size_t)l->T;
    *x = NULL;
    if (l->kind != DC_LAYER_EMBEDDING &&
        !(*x = dc_cpu_as_f32(&s->in, &l->input, rows * (size_t)l->d)))
        return -1;
    *g = dc_cpu_as_f32(&s->grad, &l->grad,
                       rows * (size_t)(l->kind == DC_LAYER_LINEAR ? l->p : l->d));
    return *g ? 0 : -1;
}

const float *dc_cpu_as_f32(dc_cpu_buf *buf, const dc_tensor *t, size_t n) {
    if (t->dtype == DC_F32) return t->data;
    float *out = dc_cpu_buf_reserve(buf, n * sizeof(float));
    if (!out) return NULL;
    const uint16_t *h = t->data;
    if (t->dtype == DC_BF16)
        for (size_t i = 0; i < n; i++) out[i] = dc_bf16_to_f32(h[i]);
    else
        for (size_t i = 0; i < n; i++) out[i] = dc_f16_to_f32(h[i]);
    return out;
}
