/* Kept stores: a norm group member's per-sample gradients, from its norm
 * phase (run_norms) to its clip phase (run_clip). The two are separate
 * tasks with the group's reduction between them, and other steps on this
 * GPU may run meanwhile (a pipeline stage's next micro-batch), reusing the
 * workspace: so what the norm phase keeps goes into a store of its own,
 * and its clip phase sums those layers from there instead of computing
 * their clipped sums again from the client's tensors (a second GEMM over
 * every sample's rows, and a second read of the data to check its seal).
 *
 * A store is one device block. Stores given back stay with the instance
 * for the next norm phase (a pipeline's micro-batches repeat one layout);
 * their bytes, given back or held, count against gpu.sample_grads_max.
 * Reuse is ordered by the stream: every use of a store is work on this
 * instance's one stream, and each call that uses one waits for its work
 * before it returns. */
#include <string.h>

#include "backend_int.h"

namespace dcb {

namespace {

/* The stores given back, freed, but those in use (caller: the worker). */
void trim(cuda_backend *cb) {
    pthread_mutex_lock(&cb->kept_mu);
    cuda_kept *k = cb->kept_free;
    cb->kept_free = NULL;
    pthread_mutex_unlock(&cb->kept_mu);
    while (k) {
        cuda_kept *next = k->next;
        cudaFree(k->mem);
        (void)cudaGetLastError();
        cb->kept_bytes -= k->cap;
        free(k->pub.layer);
        free(k->off);
        free(k);
        k = next;
    }
}

/* Whether `bytes` more device memory for a store leaves the GPU a tenth of
 * its memory (as keep_fits: the trainers on it may still need to grow). */
bool fits(size_t bytes) {
    size_t avail = 0, total = 0;
    if (cudaMemGetInfo(&avail, &total) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return avail > bytes && avail - bytes >= total / 10;
}

bool marks(cuda_kept *k, size_t L) {
    if (L <= k->lay_cap) return true;
    uint8_t *layer = (uint8_t *)realloc(k->pub.layer, L);
    if (!layer) return false;
    k->pub.layer = layer;
    size_t *off = (size_t *)realloc(k->off, L * sizeof *off);
    if (!off) return false;
    k->off = off;
    k->lay_cap = L;
    return true;
}

} // namespace

cuda_kept *kept_take(cuda_backend *cb, size_t bytes, size_t L) {
    cuda_kept *k = NULL, **best = NULL;
    pthread_mutex_lock(&cb->kept_mu);
    for (cuda_kept **p = &cb->kept_free; *p; p = &(*p)->next)
        if ((*p)->cap >= bytes && (!best || (*p)->cap < (*best)->cap)) best = p;
    if (best) {
        k = *best;
        *best = k->next;
    }
    pthread_mutex_unlock(&cb->kept_mu);
    if (!k) {
        /* none fits: the ones given back go first, so that a larger layout
         * replaces a smaller one within the cap */
        const size_t cap = (bytes + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
        if (cb->kept_bytes + cap > cb->sg_max) trim(cb);
        if (cb->kept_bytes + cap > cb->sg_max || !fits(cap)) return NULL;
        if (!(k = (cuda_kept *)calloc(1, sizeof *k))) return NULL;
        if (cudaMalloc((void **)&k->mem, cap) != cudaSuccess) {
            (void)cudaGetLastError();
            free(k);
            return NULL;
        }
        k->cap = cap;
        cb->kept_bytes += cap;
    }
    k->next = NULL;
    if (!marks(k, L)) {
        kept_give(&cb->base, &k->pub);
        return NULL;
    }
    k->pub.n_layers = L;
    memset(k->pub.layer, 0, L);
    return k;
}

void kept_give(dc_backend *be, dc_kept *pub) {
    cuda_backend *cb = (cuda_backend *)be;
    cuda_kept *k = (cuda_kept *)pub; /* pub is its first member */
    pthread_mutex_lock(&cb->kept_mu);
    k->next = cb->kept_free;
    cb->kept_free = k;
    pthread_mutex_unlock(&cb->kept_mu);
}

void kept_destroy(cuda_backend *cb) { trim(cb); }

/* Whether a step names any output (a norm pass names none). */
bool names_outputs(const dc_step *s) {
    for (size_t l = 0; l < s->n_layers; l++)
        if (want_out(&s->layers[l], 0) || want_out(&s->layers[l], 1)) return true;
    return false;
}

/* A clip phase: its kept layers where its norm phase left them (the plan
 * made without keeping: nothing of them in the workspace); *n how many.
 * A group member's own (at NULL) must sum every kept layer from the store,
 * which its seal left out; a pass's sums step (at: each layer's index in
 * the pass) takes those whose weight sum it wants (all stay sealed). */
int kept_apply(cuda_backend *cb, const dc_step *s, const dc_kept *pub, const size_t *at, size_t *n,
               dc_err *err) {
    const cuda_kept *k = (const cuda_kept *)pub;
    *n = 0;
    if (!at && pub->n_layers != s->n_layers)
        return dc_err_set(err, DC_EINTERNAL, "clip_step",
                          "a kept store of %zu layers for a step of %zu", pub->n_layers,
                          s->n_layers);
    for (size_t l = 0; l < s->n_layers; l++) {
        const size_t i = at ? at[l] : l;
        const dc_layer *ly = &s->layers[l];
        if (i >= pub->n_layers)
            return dc_err_set(err, DC_EINTERNAL, "clip_step",
                              "layer %zu: index %zu in a kept store of %zu layers", l, i,
                              pub->n_layers);
        const bool use = pub->layer[i] && want_out(ly, 0) && !ly->tie;
        if (pub->layer[i] && !use && !at)
            return dc_err_set(err, DC_EINTERNAL, "clip_step",
                              "layer %zu ('%s') was kept but its weight sum is not asked for", l,
                              ly->name);
        cb->sg_off[l] = use ? k->off[i] : SIZE_MAX;
        *n += use;
    }
    return 0;
}

/* A norm phase's end: the layers it kept in its store (grouped_norms may
 * have kept none after all) into *out, or the store back. */
void kept_leave(cuda_backend *cb, cuda_kept *k, size_t L, dc_kept **out) {
    size_t n = 0;
    for (size_t l = 0; l < L; l++) {
        k->off[l] = cb->sg_off[l];
        k->pub.layer[l] = cb->sg_off[l] != SIZE_MAX;
        n += k->pub.layer[l];
    }
    if (n) *out = &k->pub;
    else kept_give(&cb->base, &k->pub);
}

} // namespace dcb
