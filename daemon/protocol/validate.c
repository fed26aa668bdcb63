#include "validate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Field paths are built only when an error is reported: a valid step of
 * hundreds of tensors must not pay for formatting their names.
 * fpath: "a.b.c" with empty parts skipped; truncation is harmless. */
static const char *fpath(char *buf, size_t n, const char *a, const char *b, const char *c) {
    snprintf(buf, n, "%s%s%s%s%s", a, b && b[0] ? "." : "", b ? b : "", c && c[0] ? "." : "",
             c ? c : "");
    return buf;
}
#define FP(sub) fpath(f, sizeof f, prefix, name, sub)

static int check_tensor(const Dpclip__TensorRef *ref, const char *prefix, const char *name,
                        const dc_registry *reg, unsigned dtype_mask, int min_ndim, int max_ndim,
                        dc_tensor *out, int *device, dc_err *err) {
    char f[192];
    const dc_buffer *buf;
    uint64_t numel = 1, bytes, end;
    size_t esz;

    memset(out, 0, sizeof *out);
    if (!ref) return dc_err_set(err, DC_EINVAL, FP(""), "required tensor is missing");
    buf = dc_registry_find(reg, ref->buffer_id);
    if (!buf)
        return dc_err_set(err, DC_ENOTFOUND, FP("buffer_id"),
                          "buffer %llu is not registered in this session",
                          (unsigned long long)ref->buffer_id);
    if ((int)ref->dtype <= 0 || (int)ref->dtype > DC_I64)
        return dc_err_set(err, DC_EINVAL, FP("dtype"), "unknown dtype %d", (int)ref->dtype);
    if (!(dtype_mask & (1u << ref->dtype)))
        return dc_err_set(err, DC_EINVAL, FP("dtype"), "dtype %s not allowed here",
                          dc_dtype_name((dc_dtype)ref->dtype));
    if ((int)ref->n_shape < min_ndim || (int)ref->n_shape > max_ndim) {
        if (min_ndim == max_ndim)
            return dc_err_set(err, DC_EINVAL, FP("shape"), "expected %d dimensions, got %zu",
                              min_ndim, ref->n_shape);
        return dc_err_set(err, DC_EINVAL, FP("shape"), "expected %d to %d dimensions, got %zu",
                          min_ndim, max_ndim, ref->n_shape);
    }
    for (size_t i = 0; i < ref->n_shape; i++) {
        if (ref->shape[i] <= 0)
            return dc_err_set(err, DC_EINVAL, FP("shape"),
                              "dimension %zu is %lld; every dimension must be >= 1", i,
                              (long long)ref->shape[i]);
        if (__builtin_mul_overflow(numel, (uint64_t)ref->shape[i], &numel))
            return dc_err_set(err, DC_EINVAL, FP("shape"),
                              "the product of the shape overflows 64 bits");
    }
    esz = dc_dtype_size((dc_dtype)ref->dtype);
    if (__builtin_mul_overflow(numel, (uint64_t)esz, &bytes))
        return dc_err_set(err, DC_EINVAL, FP("shape"), "the tensor's byte size overflows 64 bits");
    /* Misaligned element access is undefined behaviour in C and slow or
     * faulting on GPUs: require natural alignment. */
    if (ref->offset % esz != 0)
        return dc_err_set(err, DC_EINVAL, FP("offset"),
                          "offset %llu is not a multiple of the element size %zu",
                          (unsigned long long)ref->offset, esz);
    if (__builtin_add_overflow(ref->offset, bytes, &end) || end > buf->size)
        return dc_err_set(err, DC_EINVAL, FP("offset"),
                          "offset %llu + %llu bytes is past the end of buffer %llu (%llu bytes)",
                          (unsigned long long)ref->offset, (unsigned long long)bytes,
                          (unsigned long long)buf->id, (unsigned long long)buf->size);
    out->data = (char *)buf->base + ref->offset;
    out->dtype = (dc_dtype)ref->dtype;
    out->ndim = (int)ref->n_shape;
    for (int i = 0; i < out->ndim; i++) out->shape[i] = ref->shape[i];
    if (device) *device = buf->device;
    return 0;
}

int dc_validate_tensor(const Dpclip__TensorRef *ref, const char *field, const dc_registry *reg,
                       unsigned dtype_mask, int min_ndim, int max_ndim, dc_tensor *out, int *device,
                       dc_err *err) {
    return check_tensor(ref, field, NULL, reg, dtype_mask, min_ndim, max_ndim, out, device, err);
}

/* Per-step context so that every tensor can also be checked to live where
 * the first one does (a step runs on one device). */
typedef struct vctx {
    const dc_registry *reg;
    int device; /* -2: not yet known */
    dc_err *err;
} vctx;

static int vtensor(vctx *v, const Dpclip__TensorRef *ref, const char *prefix, const char *name,
                   unsigned mask, int min_ndim, int max_ndim, dc_tensor *out) {
    char f[192];
    int dev = -1, rc;
    rc = check_tensor(ref, prefix, name, v->reg, mask, min_ndim, max_ndim, out, &dev, v->err);
    if (rc) return rc;
    if (v->device == -2) v->device = dev;
    else if (v->device != dev)
        return dc_err_set(v->err, DC_EINVAL, FP(""),
                          "all tensors of a step must be in the same place (host memory or one "
                          "GPU); this one is on %s%d, earlier ones on %s%d",
                          dev < 0 ? "host" : "cuda:", dev < 0 ? 0 : dev,
                          v->device < 0 ? "host" : "cuda:", v->device < 0 ? 0 : v->device);
    return 0;
}

/* Optional tensor: absent when the reference is missing. */
static int vopt(vctx *v, const Dpclip__TensorRef *ref, const char *prefix, const char *name,
                unsigned mask, int ndim, const int64_t *want, dc_tensor *out) {
    int rc;
    memset(out, 0, sizeof *out);
    if (!ref) return 0;
    rc = vtensor(v, ref, prefix, name, mask, ndim, ndim, out);
    if (rc) return rc;
    for (int i = 0; i < ndim; i++)
        if (out->shape[i] != want[i]) {
            char f[192];
            return dc_err_set(v->err, DC_EINVAL, FP("shape"), "dimension %d is %lld, expected %lld",
                              i, (long long)out->shape[i], (long long)want[i]);
        }
    return 0;
}

/* An activation-like [B,d]/[B,T,d] tensor and its output grad: the grad must
 * have the same rank, batch and (3D) sequence length. */
static int vpair(vctx *v, uint32_t B, const char *lp, const char *in_name,
                 const Dpclip__TensorRef *in_ref, unsigned in_mask, int in_min, int in_max,
                 const Dpclip__TensorRef *g_ref, dc_tensor *in, dc_tensor *g) {
    char f[192];
    int rc;

    if ((rc = vtensor(v, in_ref, lp, in_name, in_mask, in_min, in_max, in))) return rc;
    if (in->shape[0] != (int64_t)B)
        return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, in_name, "shape"),
                          "first dimension %lld must equal batch_size %u", (long long)in->shape[0],
                          B);
    /* Float inputs carry a feature dimension; integer indices do not. */
    int extra = dc_dtype_is_float(in->dtype) ? 0 : 1;
    int gnd = in->ndim + extra;
    if ((rc = vtensor(v, g_ref, lp, "output_grad", DC_MASK_FLOAT, gnd, gnd, g))) return rc;
    int seq_dims = in->ndim - (extra ? 0 : 1); /* 1 for [B,(d)], 2 for [B,T,(d)] */
    for (int i = 0; i < seq_dims; i++)
        if (g->shape[i] != in->shape[i])
            return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "output_grad", "shape"),
                              "dimension %d is %lld but %s has %lld there", i,
                              (long long)g->shape[i], in_name, (long long)in->shape[i]);
    return 0;
}

static int finite_pos(float x) { return isfinite(x) && x > 0.0f; }

static int validate_layer(vctx *v, const Dpclip__ClipStep *msg, size_t i, dc_layer *l) {
    const Dpclip__Layer *m = msg->layers[i];
    uint32_t B = msg->batch_size;
    char lp[96], f[192];
    int rc;

    memset(l, 0, sizeof *l);
    if (!m) return dc_err_set(v->err, DC_EINVAL, "clip_step.layers", "null layer");
    snprintf(lp, sizeof lp, "clip_step.layers[%zu]", i);
    if (m->name && m->name[0]) {
        if (strlen(m->name) >= sizeof l->name)
            return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "name", NULL),
                              "name longer than %zu bytes", sizeof l->name - 1);
        snprintf(l->name, sizeof l->name, "%s", m->name);
    } else {
        snprintf(l->name, sizeof l->name, "layers[%zu]", i);
    }
    l->max_grad_norm = m->max_grad_norm;
    l->replicated = m->replicated;
    if (msg->clip->mode == DPCLIP__CLIPPING_MODE__PER_LAYER && !finite_pos(m->max_grad_norm))
        return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "max_grad_norm", NULL),
                          "per-layer clipping needs a finite max_grad_norm > 0 for every layer");

    switch (m->kind_case) {
    case DPCLIP__LAYER__KIND_LINEAR: {
        const Dpclip__LinearLayer *x = m->linear;
        strncat(lp, ".linear", sizeof lp - strlen(lp) - 1);
        l->kind = DC_LAYER_LINEAR;
        if ((rc = vpair(v, B, lp, "activations", x->activations, DC_MASK_FLOAT, 2, 3,
                        x->output_grad, &l->input, &l->grad)))
            return rc;
        l->T = l->input.ndim == 3 ? l->input.shape[1] : 1;
        l->d = l->input.shape[l->input.ndim - 1];
        l->p = l->grad.shape[l->grad.ndim - 1];
        l->has_bias = x->has_bias;
        if ((int)x->algorithm < 0 || (int)x->algorithm > 2)
            return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "algorithm", NULL),
                              "unknown algorithm %d", (int)x->algorithm);
        l->algo = (dc_algo)x->algorithm;
        int64_t wshape[2] = {l->p, l->d}, bshape[1] = {l->p};
        if ((rc = vopt(v, x->weight_grad_out, lp, "weight_grad_out", DC_MASK_FLOAT, 2, wshape,
                       &l->weight_grad_out)))
            return rc;
        if (x->bias_grad_out && !x->has_bias)
            return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "bias_grad_out", NULL),
                              "bias_grad_out given but has_bias is false");
        if ((rc = vopt(v, x->bias_grad_out, lp, "bias_grad_out", DC_MASK_FLOAT, 1, bshape,
                       &l->bias_grad_out)))
            return rc;
        return 0;
    }
    case DPCLIP__LAYER__KIND_EMBEDDING: {
        const Dpclip__EmbeddingLayer *x = m->embedding;
        strncat(lp, ".embedding", sizeof lp - strlen(lp) - 1);
        l->kind = DC_LAYER_EMBEDDING;
        if ((rc = vpair(v, B, lp, "indices", x->indices, DC_MASK_INDEX, 1, 2, x->output_grad,
                        &l->input, &l->grad)))
            return rc;
        l->T = l->input.ndim == 2 ? l->input.shape[1] : 1;
        l->d = l->grad.shape[l->grad.ndim - 1];
        if (x->num_embeddings == 0 || x->num_embeddings > (uint64_t)INT64_MAX / 2)
            return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "num_embeddings", NULL),
                              "num_embeddings must be >= 1");
        l->vocab = (int64_t)x->num_embeddings;
        l->has_padding_idx = x->has_padding_idx;
        l->padding_idx = x->padding_idx;
        if (x->has_padding_idx && (x->padding_idx < 0 || x->padding_idx >= l->vocab))
            return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "padding_idx", NULL),
                              "padding_idx %lld outside [0, %lld)", (long long)x->padding_idx,
                              (long long)l->vocab);
        int64_t wshape[2] = {l->vocab, l->d};
        return vopt(v, x->weight_grad_out, lp, "weight_grad_out", DC_MASK_FLOAT, 2, wshape,
                    &l->weight_grad_out);
    }
    case DPCLIP__LAYER__KIND_LAYER_NORM:
    case DPCLIP__LAYER__KIND_RMS_NORM: {
        int ln = m->kind_case == DPCLIP__LAYER__KIND_LAYER_NORM;
        const Dpclip__TensorRef *in = ln ? m->layer_norm->input : m->rms_norm->input;
        const Dpclip__TensorRef *g = ln ? m->layer_norm->output_grad : m->rms_norm->output_grad;
        const Dpclip__TensorRef *wo = ln ? m->layer_norm->weight_grad_out
                                         : m->rms_norm->weight_grad_out;
        float eps = ln ? m->layer_norm->eps : m->rms_norm->eps;
        strncat(lp, ln ? ".layer_norm" : ".rms_norm", sizeof lp - strlen(lp) - 1);
        l->kind = ln ? DC_LAYER_LAYERNORM : DC_LAYER_RMSNORM;
        if ((rc = vpair(v, B, lp, "input", in, DC_MASK_FLOAT, 2, 3, g, &l->input, &l->grad)))
            return rc;
        l->T = l->input.ndim == 3 ? l->input.shape[1] : 1;
        l->d = l->input.shape[l->input.ndim - 1];
        if (l->grad.shape[l->grad.ndim - 1] != l->d)
            return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "output_grad.shape", NULL),
                              "last dimension %lld must equal the input's %lld",
                              (long long)l->grad.shape[l->grad.ndim - 1], (long long)l->d);
        if (!finite_pos(eps))
            return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "eps", NULL),
                              "eps must be finite and > 0");
        l->eps = eps;
        int64_t wshape[1] = {l->d};
        if ((rc = vopt(v, wo, lp, "weight_grad_out", DC_MASK_FLOAT, 1, wshape,
                       &l->weight_grad_out)))
            return rc;
        if (ln) {
            l->has_bias = m->layer_norm->has_bias;
            if (m->layer_norm->bias_grad_out && !l->has_bias)
                return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "bias_grad_out", NULL),
                                  "bias_grad_out given but has_bias is false");
            return vopt(v, m->layer_norm->bias_grad_out, lp, "bias_grad_out", DC_MASK_FLOAT, 1,
                        wshape, &l->bias_grad_out);
        }
        return 0;
    }
    default:
        return dc_err_set(v->err, DC_EINVAL, fpath(f, sizeof f, lp, "kind", NULL),
                          "layer kind not set or unknown");
    }
}

/* Layer.weight_noise / bias_noise of layer i (step_pass.h: a sums step
 * noises the part of each output its rank owns): a range of an output the
 * layer names, along dim 0 (rows) or dim 1 of a 2-D output, within it; on
 * a STEP_SUMS step with noise only, and there on every output. The rules
 * that need the norm pass (its sigma, data parallelism) are step_pass.c's. */
static int validate_noise(const Dpclip__ClipStep *msg, size_t i, int k, dc_layer *l, dc_err *err) {
    const Dpclip__Layer *m = msg->layers[i];
    const Dpclip__NoiseRange *x = k ? m->bias_noise : m->weight_noise;
    const dc_tensor *t = k ? &l->bias_grad_out : &l->weight_grad_out;
    const char *name = k ? "bias_noise" : "weight_noise";
    const bool sums = msg->phase == DPCLIP__STEP_PHASE__STEP_SUMS;
    const bool noisy = msg->noise_multiplier > 0.0f;
    dc_noise_range *r = k ? &l->noise_b : &l->noise_w;
    char f[128];

    snprintf(f, sizeof f, "clip_step.layers[%zu].%s", i, name);
    if (!x) {
        if (sums && noisy && t->data)
            return dc_err_set(err, DC_EINVAL, f,
                              "layer %zu ('%s'): a sums step with noise (noise_multiplier %g) "
                              "names the part of each output it noises, the rows this rank "
                              "owns (the whole output outside data parallelism)",
                              i, l->name, (double)msg->noise_multiplier);
        return 0;
    }
    if (!t->data)
        return dc_err_set(err, DC_EINVAL, f, "layer %zu ('%s') names no %s to noise", i, l->name,
                          k ? "bias_grad_out" : "weight_grad_out");
    if (!sums)
        return dc_err_set(err, DC_EINVAL, f,
                          "only a sums step (phase STEP_SUMS) takes a noise range: any other "
                          "step noises every element of its outputs");
    if (!noisy)
        return dc_err_set(err, DC_EINVAL, f,
                          "a noise range on a step with noise_multiplier 0 adds no noise: give "
                          "the pass's noise multiplier, or no range");
    if (x->dim > 1 || (x->dim == 1 && t->ndim != 2)) {
        snprintf(f, sizeof f, "clip_step.layers[%zu].%s.dim", i, name);
        return dc_err_set(err, DC_EINVAL, f, "dim %u: 0 (rows) or, for a 2-D output, 1 (columns)",
                          x->dim);
    }
    const uint64_t size = (uint64_t)t->shape[x->dim];
    if (x->begin > x->end || x->end > size) {
        snprintf(f, sizeof f, "clip_step.layers[%zu].%s.%s", i, name,
                 x->begin > x->end ? "begin" : "end");
        return dc_err_set(err, DC_EINVAL, f,
                          "[%llu, %llu) is outside the output's %llu %s (begin <= end <= %llu)",
                          (unsigned long long)x->begin, (unsigned long long)x->end,
                          (unsigned long long)size, x->dim ? "columns" : "rows",
                          (unsigned long long)size);
    }
    r->set = true;
    r->dim = x->dim;
    r->begin = x->begin;
    r->end = x->end;
    return 0;
}

/* Tied parameters: each Layer.tied_to names an earlier layer whose weight is
 * this one's. A pair is one EMBEDDING and one LINEAR of one weight shape
 * ([vocab, d] = [p, d]), each in at most one pair; only the earlier layer
 * names a weight_grad_out (it receives both uses); FLAT clipping; in a norm
 * group both layers are replicated or neither. */
static int validate_ties(const Dpclip__ClipStep *msg, dc_step *out, dc_err *err) {
    char f[96];
    for (size_t i = 0; i < out->n_layers; i++) {
        uint32_t to = msg->layers[i]->tied_to;
        dc_layer *l = &out->layers[i], *o;
        if (!to) continue;
        snprintf(f, sizeof f, "clip_step.layers[%zu].tied_to", i);
        if ((size_t)to > i)
            return dc_err_set(err, DC_EINVAL, f,
                              "tied_to %u names no earlier layer (1 + the index of one before "
                              "this, layer %zu)",
                              to, i);
        o = &out->layers[to - 1];
        if (o->tie)
            return dc_err_set(err, DC_EINVAL, f,
                              "layer %u is tied to another layer already: a weight is shared "
                              "by two layers at most",
                              to - 1);
        if (!((o->kind == DC_LAYER_EMBEDDING && l->kind == DC_LAYER_LINEAR) ||
              (o->kind == DC_LAYER_LINEAR && l->kind == DC_LAYER_EMBEDDING)))
            return dc_err_set(err, DC_EINVAL, f,
                              "tied layers are one embedding and one linear layer; layer %u "
                              "and this one are not",
                              to - 1);
        const dc_layer *e = o->kind == DC_LAYER_EMBEDDING ? o : l;
        const dc_layer *n = o->kind == DC_LAYER_LINEAR ? o : l;
        if (e->vocab != n->p || e->d != n->d)
            return dc_err_set(err, DC_EINVAL, f,
                              "the tied weights differ in shape: the embedding's is [%lld, "
                              "%lld] (num_embeddings, dim), the linear layer's [%lld, %lld] "
                              "(out, in)",
                              (long long)e->vocab, (long long)e->d, (long long)n->p,
                              (long long)n->d);
        if (l->weight_grad_out.data) {
            snprintf(f, sizeof f, "clip_step.layers[%zu].weight_grad_out", i);
            return dc_err_set(err, DC_EINVAL, f,
                              "a layer tied to an earlier one has no weight_grad_out: the "
                              "earlier layer's receives the sum of both uses");
        }
        if (out->mode != DC_CLIP_FLAT)
            return dc_err_set(err, DC_EINVAL, f,
                              "tied layers need FLAT clipping (clip.mode): a per-layer "
                              "threshold would clip one weight twice");
        if (l->replicated != o->replicated)
            return dc_err_set(err, DC_EINVAL, f,
                              "a tied pair is replicated on both layers or neither");
        l->tie = to;
        l->tie_owner = false;
        o->tie = (uint32_t)i + 1;
        o->tie_owner = true;
    }
    return 0;
}

/* What the step will cost, against the limits: refused before any work, the
 * error naming the setting to raise. */
int dc_validate_step_cost(const dc_step *s, const dc_limits *lim, dc_err *err) {
    dc_step_cost c;
    dc_step_cost_estimate(s, &c);
    if (lim->max_step_samples && c.samples > lim->max_step_samples)
        return dc_err_set(err, DC_ENOSPACE, "clip_step.layers",
                          "%zu layers x batch %u = %llu per-sample values, over "
                          "limits.max_step_samples (%llu): send fewer layers or samples per step",
                          s->n_layers, s->batch, (unsigned long long)c.samples,
                          (unsigned long long)lim->max_step_samples);
    if (lim->max_step_memory && c.host_bytes > lim->max_step_memory)
        return dc_err_set(err, DC_ENOSPACE, "clip_step",
                          "this step needs about %llu MiB of daemon memory, over "
                          "limits.max_step_memory (%llu MiB)",
                          (unsigned long long)(c.host_bytes >> 20),
                          (unsigned long long)(lim->max_step_memory >> 20));
    double max = s->device < 0 ? lim->max_step_gflop : lim->max_gpu_step_gflop;
    if (max > 0.0 && c.gflop > max)
        return dc_err_set(err, DC_ENOSPACE, "clip_step",
                          "this step is about %.0f GFLOP of work, over limits.%s (%.0f)", c.gflop,
                          s->device < 0 ? "max_step_gflop" : "max_gpu_step_gflop", max);
    return 0;
}

/* ClipStep.done_flag: one I32 in a shared-memory buffer of the session
 * (the daemon's host stores it, whatever device the step's tensors are
 * on), or two: the second is the abandon word (step.h); check_tensor has
 * it in bounds and 4-aligned. */
static int validate_done_flag(const Dpclip__TensorRef *ref, const dc_registry *reg, dc_step *out,
                              dc_err *err) {
    dc_tensor t;
    int dev = -1, rc;
    if ((rc = check_tensor(ref, "clip_step.done_flag", NULL, reg, 1u << DC_I32, 1, 1, &t, &dev,
                           err)))
        return rc;
    if (dev != -1)
        return dc_err_set(err, DC_EINVAL, "clip_step.done_flag",
                          "must be in a shared-memory buffer, not on cuda:%d: the daemon's host "
                          "stores it (a client's stream waits on its page mapped into the device)",
                          dev);
    if (t.shape[0] != 1 && t.shape[0] != 2)
        return dc_err_set(err, DC_EINVAL, "clip_step.done_flag.shape",
                          "[1] (the flag) or [2] (the flag and its abandon word); got [%lld]",
                          (long long)t.shape[0]);
    out->done_flag = (uint32_t *)t.data;
    out->done_abandon = t.shape[0] == 2 ? out->done_flag + 1 : NULL;
    return 0;
}

int dc_validate_step(const Dpclip__ClipStep *msg, const dc_registry *reg, const dc_limits *lim,
                     dc_step *out, dc_err *err) {
    vctx v = {reg, -2, err};
    const Dpclip__ClipConfig *c = msg->clip;
    int rc;

    memset(out, 0, sizeof *out);
    if (msg->batch_size == 0 || msg->batch_size > lim->max_batch)
        return dc_err_set(err, DC_EINVAL, "clip_step.batch_size",
                          "batch_size %u outside [1, %u] (the daemon's limits.max_batch, "
                          "--max-batch)",
                          msg->batch_size, lim->max_batch);
    if (msg->n_layers == 0 || msg->n_layers > lim->max_layers)
        return dc_err_set(err, DC_EINVAL, "clip_step.layers", "%zu layers; a step needs 1 to %u",
                          msg->n_layers, lim->max_layers);
    if (!c) return dc_err_set(err, DC_EINVAL, "clip_step.clip", "clipping config is missing");
    if (c->mode != DPCLIP__CLIPPING_MODE__FLAT && c->mode != DPCLIP__CLIPPING_MODE__PER_LAYER)
        return dc_err_set(err, DC_EINVAL, "clip_step.clip.mode", "unknown clipping mode %d",
                          (int)c->mode);
    if (c->mode == DPCLIP__CLIPPING_MODE__FLAT && !finite_pos(c->max_grad_norm))
        return dc_err_set(err, DC_EINVAL, "clip_step.clip.max_grad_norm",
                          "max_grad_norm must be finite and > 0");
    if (c->loss_reduction != DPCLIP__LOSS_REDUCTION__SUM &&
        c->loss_reduction != DPCLIP__LOSS_REDUCTION__MEAN)
        return dc_err_set(err, DC_EINVAL, "clip_step.clip.loss_reduction",
                          "loss_reduction must be SUM or MEAN");
    /* A mean loss divides the noised sum by expected_batch_size; 0 would
     * divide by the actual batch size, which under Poisson sampling says who
     * is in the batch and would be released without noise. Only a rate of 1
     * (or none stated, which the ledger counts as 1) has a public one. */
    if (c->loss_reduction == DPCLIP__LOSS_REDUCTION__MEAN && c->expected_batch_size == 0 &&
        msg->sample_rate != 0.0 && msg->sample_rate != 1.0)
        return dc_err_set(err, DC_EINVAL, "clip_step.clip.expected_batch_size",
                          "a MEAN step with sample_rate %g needs expected_batch_size (the "
                          "sample rate times the dataset size): dividing by the actual batch "
                          "size would release it without noise",
                          msg->sample_rate);
    if (!isfinite(msg->noise_multiplier) || msg->noise_multiplier < 0.0f)
        return dc_err_set(err, DC_EINVAL, "clip_step.noise_multiplier",
                          "noise_multiplier must be finite and >= 0");

    out->batch = msg->batch_size;
    out->mode = c->mode == DPCLIP__CLIPPING_MODE__PER_LAYER ? DC_CLIP_PER_LAYER : DC_CLIP_FLAT;
    out->max_grad_norm = c->max_grad_norm;
    out->reduction = c->loss_reduction == DPCLIP__LOSS_REDUCTION__MEAN ? DC_REDUCTION_MEAN
                                                                       : DC_REDUCTION_SUM;
    out->expected_batch = c->expected_batch_size ? c->expected_batch_size : msg->batch_size;
    out->noise_multiplier = msg->noise_multiplier;
    out->want_layer_norms = msg->want_layer_norms;
    out->layers = calloc(msg->n_layers, sizeof *out->layers);
    if (!out->layers) return dc_err_set(err, DC_ENOSPACE, "clip_step", "out of memory");
    out->n_layers = msg->n_layers;

    for (size_t i = 0; i < msg->n_layers; i++)
        if ((rc = validate_layer(&v, msg, i, &out->layers[i])) ||
            (rc = validate_noise(msg, i, 0, &out->layers[i], err)) ||
            (rc = validate_noise(msg, i, 1, &out->layers[i], err)))
            goto fail;
    {
        int64_t bshape[1] = {(int64_t)msg->batch_size};
        if ((rc = vopt(&v, msg->norms_out, "clip_step.norms_out", NULL, DC_MASK_F32, 1, bshape,
                       &out->norms_out)))
            goto fail;
        if ((rc = vopt(&v, msg->coefficients_out, "clip_step.coefficients_out", NULL, DC_MASK_F32,
                       1, bshape, &out->coefs_out)))
            goto fail;
    }
    if ((rc = validate_ties(msg, out, err))) goto fail;
    if (msg->done_flag && (rc = validate_done_flag(msg->done_flag, reg, out, err))) goto fail;
    out->device = v.device < 0 ? -1 : v.device;
    for (size_t i = 0, r = 0; i < out->n_layers; i++)
        if (out->layers[i].replicated) out->layers[i].rep_ordinal = (uint32_t)r++;
    if ((rc = dc_validate_step_cost(out, lim, err))) goto fail;
    return 0;

fail:
    dc_validate_step_free(out);
    return rc;
}

void dc_validate_step_free(dc_step *s) {
    free(s->layers);
    s->layers = NULL;
    s->n_layers = 0;
}
