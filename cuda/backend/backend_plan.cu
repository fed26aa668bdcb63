/* The CUDA backend's workspace: where a step's parts go in it (plan_step,
 * the layout of backend_int.h), whether keeping per-sample gradients
 * leaves the GPU enough memory (keep_fits), and the device workspace and
 * pinned host block grown for the step (reserve, ws_alloc); between tasks
 * the workspace back to its preallocation (cuda_release). */
#include <stdlib.h>
#include <string.h>

#include "backend_int.h"

using namespace dcb;

int dcb::ws_alloc(cuda_backend *cb, size_t want, dc_err *err) {
    (void)cudaStreamSynchronize(cb->stream);
    if (cb->ws) cudaFree(cb->ws);
    cb->ws = NULL;
    cb->ws_cap = 0;
    if (want == 0) return 0;
    if (cudaMalloc((void **)&cb->ws, want) != cudaSuccess) {
        (void)cudaGetLastError();
        cb->ws = NULL;
        return dc_err_set(err, DC_ENOSPACE, "", "cannot allocate %zu bytes of workspace on cuda:%d",
                          want, cb->device);
    }
    cb->ws_cap = want;
    return 0;
}

void dcb::cuda_release(dc_backend *be) {
    cuda_backend *cb = (cuda_backend *)be;
    if (cudaSetDevice(cb->device) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    kept_destroy(cb); /* the stores given back; those in use stay */
    if (cb->ws_cap <= cb->ws_pre) return;
    dc_err err;
    /* a failed allocation (or none preallocated) leaves ws NULL, ws_cap 0,
     * which the next step grows again */
    (void)ws_alloc(cb, cb->ws_pre, &err);
}

namespace {

/* Bytes of workspace that keep layer l's per-sample gradients (al()-ed),
 * or 0 where they are not kept: a LINEAR layer of the grouped norm kernel
 * whose clipped sum the grouped book-keeping kernel would make (so the
 * output check's plan for it holds), not tied (its norm is a pair's), not
 * rescued on the host, where keep asks (a whole step, a norm phase that
 * keeps for its clip phase or a pass's sums steps: keep_mode), with no
 * noise range (a sums step's: only the output passes draw ranged noise;
 * sums steps never keep, they sum what their pass kept). */
size_t keep_bytes(const cuda_backend *cb, const dc_step *s, size_t l, keep_mode keep) {
    const dc_layer *ly = &s->layers[l];
    if (keep == KEEP_NONE || cb->opt.sgrad == DCC_SGRAD_OFF || !cb->opt.grouped ||
        cb->sg_max == 0 || ly->kind != DC_LAYER_LINEAR || ly->tie ||
        (keep == KEEP_OUTS && !want_out(ly, 0)) || ly->noise_w.set || ly->noise_b.set ||
        (cb->ovr_active && cb->ovr[l]))
        return 0;
    /* a pass's sums steps clip with DC_E_KEPT_FLOOR: a layer whose kept
     * rounding needs more is not kept */
    if (keep == KEEP_PASS && !(dc_clip_e(s, l, dc_clip_e_how(s) | DC_E_KEPT) <= DC_E_KEPT_FLOOR))
        return 0;
    dcc_linear x = linear_of(cb, ly, (int)s->batch, dc_layer_norm_bias(ly), false);
    /* a kept layer's norms run direct, even where the ghost form would be
     * cheaper alone (grouped_norms), unless the client asked for ghost */
    if (ly->algo == DC_ALGO_GHOST || !dcc_norms_grouped_ok(&x, DC_ALGO_DIRECT) ||
        !dcc_bk_grouped_ok(&x) ||
        (cb->opt.sgrad != DCC_SGRAD_ALL &&
         !dcc_sgrad_worth(x.T, x.d, x.p, dcc_linear_pick_grouped(x.T, x.d, x.p, ly->algo))))
        return 0;
    return al(dcc_sgrad_bytes(&x));
}

/* Whether a one-pass whole step may write its grouped book-keeping sums
 * straight into their outputs (cb->bk_direct): not a micro-batch (its
 * accumulators fold in before the noise), and every output of the step
 * provably fits its dtype once noised (bound_fits), so that the output
 * check takes mode 1; where it might not, the direct sums would run twice
 * (check, then commit) and staging is cheaper. */
bool direct_step(const cuda_backend *cb, const dc_step *s) {
    if (!cb->opt.grouped || cb->opt.bk_direct == DCC_DIRECT_OFF || cb->bk_direct_off ||
        s->acc != DC_ACC_NONE)
        return false;
    if (cb->opt.bk_direct == DCC_DIRECT_ALWAYS) return true;
    float std, divisor;
    step_scales(s, false, &std, &divisor);
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        for (int k = 0; k < 2; k++)
            if (want_out(ly, k) &&
                !bound_fits(out_bound(s, ly), (k ? ly->bias_grad_out : ly->weight_grad_out).dtype,
                            std, divisor))
                return false;
    }
    return true;
}

/* Whether layer l of such a step goes direct: a LINEAR layer of the grouped
 * book-keeping kernel that wants its weight sum, whose per-sample
 * gradients are not kept (their sum is sgrad.cu's), not tied (an embedding
 * adds onto its weight), with no noise range (a sums step's). */
bool direct_layer(const cuda_backend *cb, const dc_step *s, size_t l) {
    const dc_layer *ly = &s->layers[l];
    if (ly->kind != DC_LAYER_LINEAR || !want_out(ly, 0) || ly->tie || cb->sg_off[l] != SIZE_MAX ||
        ly->noise_w.set || ly->noise_b.set)
        return false;
    dcc_linear x = linear_of(cb, ly, (int)s->batch, ly->has_bias, false);
    return dcc_bk_grouped_ok(&x) != 0;
}

/* p grown to n elements (what it held kept); false, and p as it was, when
 * out of memory: the per-layer arrays grow together, and a step that
 * fails here leaves lay_cap, so the next one grows them all again. */
template <typename T> bool grow(T *&p, size_t n) {
    T *q = (T *)realloc(p, n * sizeof *q);
    if (!q) return false;
    p = q;
    return true;
}

/* Floats of staging layer ly's outputs take (fill_tables' offsets: the
 * weight's, then the bias's). */
uint64_t stage_floats(const dc_layer *ly) {
    uint64_t f = 0;
    for (int k = 0; k < 2; k++) {
        uint64_t n;
        if (!want_out(ly, k)) continue;
        numel_out(k ? &ly->bias_grad_out : &ly->weight_grad_out, &n);
        f += al4(n);
    }
    return f;
}

/* The layout from the staging area to the kept area's start, for `staged`
 * floats of staging after `o`: returns the kept area's offset. */
size_t tail(const dc_step *s, cuda_backend *cb, layout *Lo, size_t o, uint64_t staged, size_t temp,
            size_t bsum) {
    const size_t L = s->n_layers, B = s->batch;
    Lo->staging = o;
    o += al(staged * 4);
    Lo->per_sample = o;
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &s->layers[l];
        cb->lay_off[l] = SIZE_MAX;
        if (ly->kind == DC_LAYER_LAYERNORM || ly->kind == DC_LAYER_RMSNORM) {
            cb->lay_off[l] = o;
            o += al(2 * B * (size_t)ly->d * 4);
        }
    }
    /* a norm group's per-sample totals (doubles), for the clip phase */
    Lo->tot = o;
    o += al(B * 8);
    /* embedding indices, copied here once per step (snapshot_indices) */
    Lo->idx = o;
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &s->layers[l];
        if (ly->kind == DC_LAYER_EMBEDDING)
            o += al((size_t)B * (size_t)ly->T * dc_dtype_size(ly->input.dtype));
    }
    Lo->temp = o;
    Lo->temp_bytes = temp;
    o += al(temp);
    Lo->bsum = bsum ? o : SIZE_MAX; /* shared by the layers' launches, in stream order */
    o += al(bsum);
    return o;
}

} // namespace

int dcb::plan_step(cuda_backend *cb, const dc_step *s, keep_mode keep, bool unstage, layout *Lo,
                   dc_err *err) {
    const size_t L = s->n_layers, B = s->batch, LB = L * B;
    size_t o = 0, staged = 0, temp = 0, bsum = 0;
    memset(Lo, 0, sizeof *Lo);
    if (L > cb->lay_cap) {
        if (!grow(cb->lay_off, L) || !grow(cb->bk, L) || !grow(cb->bk_grouped, L) ||
            !grow(cb->nm, L) || !grow(cb->nm_grouped, L) || !grow(cb->safe, L) ||
            !grow(cb->woff, L) || !grow(cb->sg_off, L) || !grow(cb->sg_unstaged, L) ||
            !grow(cb->bk_direct, L) || !grow(cb->bkd, L) || !grow(cb->bk_layer, L) ||
            !grow(cb->sg_out, 2 * L) || !grow(cb->sgl, L))
            return dc_err_set(err, DC_ENOSPACE, "", "out of memory");
        cb->lay_cap = L;
    }
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &s->layers[l];
        int64_t rows = (int64_t)B * ly->T;
        if (ly->T > INT32_MAX || ly->d > INT32_MAX || ly->p > INT32_MAX || rows > INT32_MAX)
            return dc_err_set(err, DC_EINVAL, ly->name,
                              "dimensions beyond %d are not supported by the CUDA backend",
                              INT32_MAX);
        for (int k = 0; k < 2; k++) {
            if (!want_out(ly, k)) continue;
            uint64_t n;
            numel_out(k ? &ly->bias_grad_out : &ly->weight_grad_out, &n);
            if (n > ((uint64_t)1 << 33)) {
                char f[128];
                snprintf(f, sizeof f, "%s.%s", ly->name, k ? "bias_grad_out" : "weight_grad_out");
                return dc_err_set(err, DC_EINVAL, f, "more than %llu elements",
                                  (unsigned long long)((uint64_t)1 << 33));
            }
            Lo->n_out++;
            if (n > Lo->max_n) Lo->max_n = n;
            staged += al4(n);
            Lo->chunks += dcc_out_chunks(n);
        }
        size_t t = 0;
        switch (ly->kind) {
        case DC_LAYER_LINEAR: {
            if (dc_layer_norm_bias(ly)) { /* the direct norms' bias sums (p as padded) */
                dcc_linear xb = linear_of(cb, ly, (int)B, true, false);
                xb.p = (xb.p + 7) & ~7;
                const size_t n = dcc_linear_bias_ws_bytes(&xb);
                if (n > bsum) bsum = n;
            }
            if (want_out(ly, 0) && !bk_per_sample(ly))
                t = (size_t)chunk_rows(ly, (uint32_t)B) * (size_t)(ly->d + ly->p) * 4 + 512;
            dcc_linear x = linear_of(cb, ly, (int)B, false, false);
            if (dcc_pad_wanted(&x)) {
                size_t pt = (size_t)dcc_pad_samples(&x, PAD_CAP) * dcc_pad_sample_bytes(&x);
                if (pt > t) t = pt;
            }
            break;
        }
        case DC_LAYER_EMBEDDING: t = dcc_embedding_ws_bytes((int)B, (int)ly->T); break;
        case DC_LAYER_LAYERNORM:
        case DC_LAYER_RMSNORM: /* row statistics; the bias-only sum's dummy weight */
            t = (size_t)rows * 8 > (size_t)ly->d * 4 ? (size_t)rows * 8 : (size_t)ly->d * 4;
            break;
        }
        if (ly->tie && t < B * sizeof(double)) t = B * sizeof(double); /* the cross terms */
        if (t > temp) temp = t;
    }
    Lo->staged = staged;
    Lo->status = 0;
    Lo->mode = 4;
    Lo->bad = 8;
    Lo->n2 = 16;
    Lo->flags = Lo->n2 + LB * 4;
    Lo->amax = Lo->flags + LB * 4;
    Lo->norms = Lo->amax + (size_t)Lo->n_out * 4; /* [0, norms) is zeroed per step */
    Lo->coefs = Lo->norms + B * 4;
    Lo->lcoef = Lo->coefs + B * 4;
    Lo->dl_bytes = Lo->lcoef + LB * 4;
    o = al(Lo->dl_bytes);
    Lo->cs = o;
    o += al(LB * 4);
    Lo->perm = o; /* the grouped book-keeping's sample order and factors */
    o += al(LB * 4);
    Lo->fac = o;
    o += al(LB * 4);
    Lo->up = o;
    Lo->consts = 0;
    Lo->layer_c = 16;
    Lo->count = al(16 + L * 4);
    Lo->layer_e = al(Lo->count + L * 4);
    Lo->outs = al(Lo->layer_e + L * 8);
    Lo->up_bytes = Lo->outs + (size_t)Lo->n_out * sizeof(dcc_out);
    o += al(Lo->up_bytes);
    /* kept per-sample gradients last: what is left of their cap decides how
     * many layers fit. A kept layer of a one-pass whole step gives up its
     * staging (its sum goes straight to its outputs, or is checked where
     * it is made: dcc_sgrad_sum); the staging a step that keeps it after
     * all not would need lies in its kept bytes, which hold at least as
     * much from two samples on (B d p bf16 against d p f32). */
    const size_t full = tail(s, cb, Lo, o, staged, temp, bsum);
    uint64_t given = 0; /* floats of staging the kept (and direct) layers gave up */
    Lo->sgrad_bytes = 0;
    for (size_t l = 0; l < L; l++) {
        cb->sg_off[l] = SIZE_MAX;
        cb->sg_unstaged[l] = false;
        const size_t need = keep_bytes(cb, s, l, keep);
        if (need == 0 || Lo->sgrad_bytes + need > cb->sg_max) continue;
        const dc_layer *ly = &s->layers[l];
        const uint64_t f = unstage ? stage_floats(ly) : 0;
        /* a logical step's: the kept sum needs every output's accumulator */
        const bool accs = s->acc == DC_ACC_NONE || (ly->acc_w && (!want_out(ly, 1) || ly->acc_b));
        const bool un = f && f * 4 <= need && accs;
        /* a smaller staging area's al() rounds up by less than 256 bytes */
        const uint64_t g = given + (un ? f : 0);
        if (cb->ws_max && full - g * 4 + (g ? 256 : 0) + Lo->sgrad_bytes + need > cb->ws_max)
            continue;
        cb->sg_off[l] = Lo->sgrad_bytes; /* from the kept area's start (cb->sg_base) */
        cb->sg_unstaged[l] = un;
        given += un ? f : 0;
        Lo->sgrad_bytes += need;
    }
    /* the direct layers give up their staging too */
    const bool direct = unstage && direct_step(cb, s);
    for (size_t l = 0; l < L; l++) {
        cb->bk_direct[l] = direct && direct_layer(cb, s, l);
        if (cb->bk_direct[l]) given += stage_floats(&s->layers[l]);
    }
    Lo->staged = staged - given;
    Lo->sgrad = given ? tail(s, cb, Lo, o, staged - given, temp, bsum) : full;
    o = Lo->sgrad + Lo->sgrad_bytes;
    Lo->total = o;
    return 0;
}

/* Whether a workspace that keeps per-sample gradients leaves the GPU a
 * tenth of its memory free (KEEP_FREE_PARTS): they are an optimisation, and the
 * trainers on the GPU may still need to grow. Growing frees the old
 * workspace first (ws_alloc), so that counts as free. */
constexpr size_t KEEP_FREE_PARTS = 10;

bool dcb::keep_fits(cuda_backend *cb, const layout *Lo) {
    if (Lo->total <= cb->ws_cap) return true; /* held already */
    size_t avail = 0, total = 0;
    if (cudaMemGetInfo(&avail, &total) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    avail += cb->ws_cap;
    return avail > Lo->total && avail - Lo->total >= total / KEEP_FREE_PARTS;
}

int dcb::reserve(cuda_backend *cb, const layout *Lo, dc_err *err) {
    if (cb->ws_max && Lo->total > cb->ws_max)
        return dc_err_set(err, DC_ENOSPACE, "clip_step",
                          "this step needs %zu bytes of GPU workspace on cuda:%d, over the "
                          "daemon's gpu.workspace_max of %zu bytes: send fewer or smaller "
                          "layers per step, or raise gpu.workspace_max",
                          Lo->total, cb->device, cb->ws_max);
    if (Lo->total > cb->ws_cap) {
        /* a quarter more for the next, slightly larger step, but not a
         * quarter of gigabytes of kept gradients */
        size_t margin = Lo->total / 4 < ((size_t)256 << 20) ? Lo->total / 4 : (size_t)256 << 20;
        size_t want = Lo->total + margin;
        want = (want + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
        if (cb->ws_max && want > cb->ws_max) want = cb->ws_max;
        int rc = ws_alloc(cb, want, err);
        if (rc) return rc;
    }
    size_t hneed = al(Lo->dl_bytes) + Lo->up_bytes;
    if (hneed > cb->host_cap) {
        size_t want = hneed + hneed / 4 + 4096;
        if (cb->host) cudaFreeHost(cb->host);
        cb->host = NULL;
        cb->host_cap = 0;
        if (cudaMallocHost((void **)&cb->host, want) != cudaSuccess) {
            (void)cudaGetLastError();
            cb->host = NULL;
            return dc_err_set(err, DC_ENOSPACE, "", "cannot allocate %zu bytes of pinned memory",
                              want);
        }
        cb->host_cap = want;
    }
    return 0;
}
