/* dpclip_step: the trainer's description of one optimizer step, and its
 * translation to a dpclip.ClipStep message at send time.
 *
 * Ownership: a step owns copies of the layer descriptions and of their names;
 * tensors are plain references (buffer id, offset, shape), so nothing else
 * needs copying. The message is built in scratch memory owned by the client
 * handle (under its lock) and points into the step's arrays: shapes and
 * names are not copied again. */
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct cl_layer {
    Dpclip__Layer__KindCase kind;
    char *name;       /* owned copy, or NULL */
    int replicated;   /* norm groups: held whole by every member */
    uint32_t tied_to; /* 1 + the layer whose weight this one's is; 0 = none */
    /* a sums step's noise ranges (dpclip_step_set_noise_range): [0] weight,
     * [1] bias; set 0: none */
    struct {
        int set;
        uint32_t dim;
        uint64_t begin, end;
    } noise[2];
    union {
        dpclip_linear lin;
        dpclip_embedding emb;
        dpclip_norm_layer norm;
    } u;
} cl_layer;

struct dpclip_step {
    uint32_t batch;
    dpclip_clip_config cfg;
    cl_layer *layers;
    size_t n, cap;
    dpclip_tensor norms_out, coefs_out;
    dpclip_tensor done_flag; /* buffer_id 0: none */
    int want_layer_norms;
    uint64_t wait_event, signal_event;
    int notify_enqueued;
    dpclip_phase phase;
    uint32_t dp_world, dp_rank; /* data parallelism; world 0: none */
    uint64_t dp_step;
    float dp_sigma;
    uint64_t logical_id; /* gradient accumulation; 0: none */
    uint32_t micro_batch;
    int commit;
    /* Changes with every mutation (from one process-wide counter, so a
     * step freed and another allocated at its address never share one):
     * the client reuses its packed request while it stays the same. */
    uint64_t ver;
};

static atomic_uint_fast64_t g_step_ver;

static void touch(dpclip_step *s) { s->ver = atomic_fetch_add(&g_step_ver, 1) + 1; }

uint64_t cl_step_version(const dpclip_step *s) { return s->ver; }

/* --- step objects ------------------------------------------------------- */

DPCLIP_API dpclip_step *dpclip_step_new(uint32_t batch_size, const dpclip_clip_config *cfg) {
    dpclip_step *s;
    if (batch_size == 0 || !cfg) return NULL;
    s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->batch = batch_size;
    s->cfg = *cfg;
    touch(s);
    return s;
}

static void clear_layers(dpclip_step *s) {
    for (size_t i = 0; i < s->n; i++) free(s->layers[i].name);
    s->n = 0;
}

DPCLIP_API void dpclip_step_free(dpclip_step *s) {
    if (!s) return;
    clear_layers(s);
    free(s->layers);
    free(s);
}

/* Keeps the clip config, the layer array's capacity, want_layer_norms and
 * the events; drops the layers and the norms/coefficients outputs. */
DPCLIP_API void dpclip_step_reset(dpclip_step *s, uint32_t batch_size) {
    if (!s) return;
    clear_layers(s);
    touch(s);
    s->batch = batch_size;
    memset(&s->norms_out, 0, sizeof s->norms_out);
    memset(&s->coefs_out, 0, sizeof s->coefs_out);
}

uint32_t cl_step_batch(const dpclip_step *s) { return s->batch; }
uint32_t cl_step_layers(const dpclip_step *s) { return (uint32_t)s->n; }

static int tensor_ok(const dpclip_tensor *t, int required) {
    if (t->ndim < 0 || t->ndim > 3) return 0;
    if (required && (t->ndim == 0 || t->buffer == 0)) return 0;
    return 1;
}

/* Appends a layer slot with a copy of `name`; NULL on allocation failure. */
static cl_layer *push_layer(dpclip_step *s, const char *name) {
    cl_layer *l;
    touch(s);
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        cl_layer *nl = realloc(s->layers, cap * sizeof *nl);
        if (!nl) return NULL;
        s->layers = nl;
        s->cap = cap;
    }
    l = &s->layers[s->n];
    memset(l, 0, sizeof *l);
    if (name) {
        l->name = strdup(name);
        if (!l->name) return NULL;
    }
    s->n++;
    return l;
}

DPCLIP_API int dpclip_step_add_linear(dpclip_step *s, const dpclip_linear *l) {
    cl_layer *x;
    if (!s || !l) return DPCLIP_EARG;
    if (!tensor_ok(&l->activations, 1) || !tensor_ok(&l->output_grad, 1) ||
        !tensor_ok(&l->weight_grad_out, 0) || !tensor_ok(&l->bias_grad_out, 0))
        return DPCLIP_EARG;
    if (!(x = push_layer(s, l->name))) return DPCLIP_ENOMEM;
    x->kind = DPCLIP__LAYER__KIND_LINEAR;
    x->u.lin = *l;
    x->u.lin.name = x->name;
    return DPCLIP_OK;
}

DPCLIP_API int dpclip_step_add_embedding(dpclip_step *s, const dpclip_embedding *e) {
    cl_layer *x;
    if (!s || !e) return DPCLIP_EARG;
    if (!tensor_ok(&e->indices, 1) || !tensor_ok(&e->output_grad, 1) ||
        !tensor_ok(&e->weight_grad_out, 0))
        return DPCLIP_EARG;
    if (!(x = push_layer(s, e->name))) return DPCLIP_ENOMEM;
    x->kind = DPCLIP__LAYER__KIND_EMBEDDING;
    x->u.emb = *e;
    x->u.emb.name = x->name;
    return DPCLIP_OK;
}

static int add_norm(dpclip_step *s, const dpclip_norm_layer *n, Dpclip__Layer__KindCase kind) {
    cl_layer *x;
    if (!s || !n) return DPCLIP_EARG;
    if (!tensor_ok(&n->input, 1) || !tensor_ok(&n->output_grad, 1) ||
        !tensor_ok(&n->weight_grad_out, 0) || !tensor_ok(&n->bias_grad_out, 0))
        return DPCLIP_EARG;
    if (!(x = push_layer(s, n->name))) return DPCLIP_ENOMEM;
    x->kind = kind;
    x->u.norm = *n;
    x->u.norm.name = x->name;
    return DPCLIP_OK;
}

DPCLIP_API int dpclip_step_add_layernorm(dpclip_step *s, const dpclip_norm_layer *n) {
    return add_norm(s, n, DPCLIP__LAYER__KIND_LAYER_NORM);
}

DPCLIP_API int dpclip_step_add_rmsnorm(dpclip_step *s, const dpclip_norm_layer *n) {
    return add_norm(s, n, DPCLIP__LAYER__KIND_RMS_NORM);
}

/* Which two tensors of a layer a rebind re-points. */
typedef enum cl_pair { CL_PAIR_INPUTS, CL_PAIR_OUTPUTS } cl_pair;

/* Layer x's inputs (its activations or indices, its output gradient) or
 * outputs (its weight's and bias's gradients; an embedding has no bias:
 * t[1] NULL). */
static void pair_of(cl_layer *x, cl_pair which, dpclip_tensor *t[2]) {
    const bool out = which == CL_PAIR_OUTPUTS;
    switch (x->kind) {
    case DPCLIP__LAYER__KIND_LINEAR:
        t[0] = out ? &x->u.lin.weight_grad_out : &x->u.lin.activations;
        t[1] = out ? &x->u.lin.bias_grad_out : &x->u.lin.output_grad;
        break;
    case DPCLIP__LAYER__KIND_EMBEDDING:
        t[0] = out ? &x->u.emb.weight_grad_out : &x->u.emb.indices;
        t[1] = out ? NULL : &x->u.emb.output_grad;
        break;
    default: /* the norms */
        t[0] = out ? &x->u.norm.weight_grad_out : &x->u.norm.input;
        t[1] = out ? &x->u.norm.bias_grad_out : &x->u.norm.output_grad;
        break;
    }
}

DPCLIP_API int dpclip_step_rebind(dpclip_step *s, size_t n, const uint64_t *refs) {
    if (!s || !refs || n != s->n) return DPCLIP_EARG;
    for (size_t i = 0; i < 2 * n; i++) /* all checked first: refused, the step is unchanged */
        if (refs[2 * i] == 0) return DPCLIP_EARG;
    for (size_t i = 0; i < n; i++) {
        dpclip_tensor *t[2];
        pair_of(&s->layers[i], CL_PAIR_INPUTS, t);
        for (int k = 0; k < 2; k++) {
            t[k]->buffer = refs[4 * i + 2 * k];
            t[k]->offset = refs[4 * i + 2 * k + 1];
        }
    }
    touch(s);
    return DPCLIP_OK;
}

/* Whether t names an output (what the wire message sends: ref()). */
static bool names_output(const dpclip_tensor *t) { return t && t->ndim != 0 && t->buffer != 0; }

DPCLIP_API int dpclip_step_rebind_outputs(dpclip_step *s, size_t n, const uint64_t *refs) {
    if (!s || !refs || n != s->n) return DPCLIP_EARG;
    for (size_t i = 0; i < n; i++) { /* all checked first: refused, the step is unchanged */
        dpclip_tensor *t[2];
        pair_of(&s->layers[i], CL_PAIR_OUTPUTS, t);
        for (int k = 0; k < 2; k++)
            if (names_output(t[k]) != (refs[4 * i + 2 * k] != 0)) return DPCLIP_EARG;
    }
    for (size_t i = 0; i < n; i++) {
        dpclip_tensor *t[2];
        pair_of(&s->layers[i], CL_PAIR_OUTPUTS, t);
        for (int k = 0; k < 2; k++) {
            if (!names_output(t[k])) continue;
            t[k]->buffer = refs[4 * i + 2 * k];
            t[k]->offset = refs[4 * i + 2 * k + 1];
        }
    }
    touch(s);
    return DPCLIP_OK;
}

/* Either pointer may be NULL (no such output). */
DPCLIP_API int dpclip_step_set_outputs(dpclip_step *s, const dpclip_tensor *norms_out,
                                       const dpclip_tensor *coefs_out) {
    if (!s) return DPCLIP_EARG;
    if ((norms_out && !tensor_ok(norms_out, 0)) || (coefs_out && !tensor_ok(coefs_out, 0)))
        return DPCLIP_EARG;
    touch(s);
    if (norms_out) s->norms_out = *norms_out;
    else memset(&s->norms_out, 0, sizeof s->norms_out);
    if (coefs_out) s->coefs_out = *coefs_out;
    else memset(&s->coefs_out, 0, sizeof s->coefs_out);
    return DPCLIP_OK;
}

/* NULL: none. Kept across dpclip_step_reset, as the events are. */
DPCLIP_API int dpclip_step_set_done_flag(dpclip_step *s, const dpclip_tensor *flag) {
    if (!s) return DPCLIP_EARG;
    if (flag && !tensor_ok(flag, 0)) return DPCLIP_EARG;
    touch(s);
    if (flag) s->done_flag = *flag;
    else memset(&s->done_flag, 0, sizeof s->done_flag);
    return DPCLIP_OK;
}

DPCLIP_API void dpclip_step_set_events(dpclip_step *s, uint64_t wait_event, uint64_t signal_event) {
    if (!s) return;
    touch(s);
    s->wait_event = wait_event;
    s->signal_event = signal_event;
}

DPCLIP_API int dpclip_step_set_replicated(dpclip_step *s, size_t layer, int yes) {
    if (!s || layer >= s->n) return DPCLIP_EARG;
    s->layers[layer].replicated = yes != 0;
    touch(s);
    return 0;
}

DPCLIP_API int dpclip_step_set_tied(dpclip_step *s, size_t layer, size_t owner) {
    if (!s || layer >= s->n || owner >= layer) return DPCLIP_EARG;
    s->layers[layer].tied_to = (uint32_t)owner + 1;
    touch(s);
    return 0;
}

DPCLIP_API int dpclip_step_set_noise_range(dpclip_step *s, size_t layer, int output, uint32_t dim,
                                           uint64_t begin, uint64_t end) {
    if (!s || layer >= s->n || (output != 0 && output != 1) || dim > 1 || begin > end)
        return DPCLIP_EARG;
    s->layers[layer].noise[output].set = 1;
    s->layers[layer].noise[output].dim = dim;
    s->layers[layer].noise[output].begin = begin;
    s->layers[layer].noise[output].end = end;
    touch(s);
    return 0;
}

DPCLIP_API void dpclip_step_notify_enqueued(dpclip_step *s, int yes) {
    if (!s) return;
    touch(s);
    s->notify_enqueued = yes != 0;
}

DPCLIP_API int dpclip_step_set_phase(dpclip_step *s, dpclip_phase phase) {
    if (!s ||
        (phase != DPCLIP_STEP_WHOLE && phase != DPCLIP_STEP_NORMS && phase != DPCLIP_STEP_SUMS))
        return DPCLIP_EARG;
    touch(s);
    s->phase = phase;
    return 0;
}

DPCLIP_API int dpclip_step_set_logical(dpclip_step *s, uint64_t id, uint32_t micro_batch,
                                       int commit) {
    if (!s || (!id && (micro_batch || commit))) return DPCLIP_EARG;
    touch(s);
    s->logical_id = id;
    s->micro_batch = id ? micro_batch : 0;
    s->commit = id ? commit != 0 : 0;
    return 0;
}

DPCLIP_API int dpclip_step_set_data_parallel(dpclip_step *s, uint32_t world, uint32_t rank,
                                             float noise_multiplier, uint64_t step) {
    if (!s || (world && (world < 2 || rank >= world || !(noise_multiplier > 0.0f) ||
                         !isfinite(noise_multiplier) || step >= (UINT64_C(1) << 63))))
        return DPCLIP_EARG;
    touch(s);
    s->dp_world = world;
    s->dp_rank = world ? rank : 0;
    s->dp_sigma = world ? noise_multiplier : 0.0f;
    s->dp_step = world ? step : 0;
    return 0;
}

DPCLIP_API void dpclip_step_want_layer_norms(dpclip_step *s, int yes) {
    if (!s) return;
    touch(s);
    s->want_layer_norms = yes != 0;
}

/* --- the message -------------------------------------------------------- */

typedef struct msg_layer {
    Dpclip__Layer layer;
    union {
        Dpclip__LinearLayer lin;
        Dpclip__EmbeddingLayer emb;
        Dpclip__LayerNormLayer ln;
        Dpclip__RMSNormLayer rms;
    } k;
    Dpclip__TensorRef refs[4];
    Dpclip__NoiseRange noise[2];
} msg_layer;

typedef struct msg_scratch {
    Dpclip__ClipStep step;
    Dpclip__ClipConfig clip;
    Dpclip__TensorRef norms_out, coefs_out, done_flag;
    Dpclip__DataParallel dp;
    Dpclip__LogicalStep logical;
    msg_layer *layers;
    Dpclip__Layer **ptrs;
    size_t cap;
} msg_scratch;

void cl_step_scratch_free(dpclip_client *c) {
    msg_scratch *m = c->msg_scratch;
    if (!m) return;
    free(m->layers);
    free(m->ptrs);
    free(m);
    c->msg_scratch = NULL;
}

/* Fills r from t; NULL when t is absent (ndim 0 or buffer 0), which leaves
 * the optional field unset in the message. The shape array points into t. */
static Dpclip__TensorRef *ref(Dpclip__TensorRef *r, const dpclip_tensor *t) {
    if (t->ndim == 0 || t->buffer == 0) return NULL;
    dpclip__tensor_ref__init(r);
    r->buffer_id = t->buffer;
    r->offset = t->offset;
    r->dtype = (Dpclip__DType)t->dtype;
    r->n_shape = (size_t)t->ndim;
    r->shape = (int64_t *)t->shape;
    return r;
}

static int scratch_reserve(dpclip_client *c, size_t n) {
    msg_scratch *m = c->msg_scratch;
    if (!m) {
        if (!(m = calloc(1, sizeof *m))) return DPCLIP_ENOMEM;
        c->msg_scratch = m;
    }
    if (n > m->cap) {
        size_t cap = m->cap ? m->cap : 16;
        msg_layer *nl;
        Dpclip__Layer **np;
        while (cap < n) cap *= 2;
        if (!(nl = realloc(m->layers, cap * sizeof *nl))) return DPCLIP_ENOMEM;
        m->layers = nl;
        if (!(np = realloc(m->ptrs, cap * sizeof *np))) return DPCLIP_ENOMEM;
        m->ptrs = np;
        m->cap = cap;
    }
    return 0;
}

int cl_step_message(dpclip_client *c, const dpclip_step *s, Dpclip__ClipStep **out) {
    msg_scratch *m;

    if (s->batch == 0) return cl_fail(c, DPCLIP_EARG, "clip_step.batch_size", "batch size 0");
    if (s->n == 0) return cl_fail(c, DPCLIP_EARG, "clip_step.layers", "the step has no layers");
    if (scratch_reserve(c, s->n))
        return cl_fail(c, DPCLIP_ENOMEM, "", "out of memory building a %zu-layer step", s->n);
    m = c->msg_scratch;

    dpclip__clip_step__init(&m->step);
    dpclip__clip_config__init(&m->clip);
    m->clip.max_grad_norm = s->cfg.max_grad_norm;
    m->clip.loss_reduction = (Dpclip__LossReduction)s->cfg.reduction;
    m->clip.expected_batch_size = s->cfg.expected_batch_size;
    m->clip.mode = (Dpclip__ClippingMode)s->cfg.mode;
    m->step.batch_size = s->batch;
    m->step.clip = &m->clip;
    m->step.noise_multiplier = s->cfg.noise_multiplier;
    m->step.norms_out = ref(&m->norms_out, &s->norms_out);
    m->step.coefficients_out = ref(&m->coefs_out, &s->coefs_out);
    m->step.done_flag = ref(&m->done_flag, &s->done_flag);
    m->step.want_layer_norms = s->want_layer_norms;
    m->step.sample_rate = s->cfg.sample_rate;
    m->step.target_delta = s->cfg.target_delta;
    m->step.target_epsilon = s->cfg.target_epsilon;
    m->step.wait_event = s->wait_event;
    m->step.signal_event = s->signal_event;
    m->step.notify_enqueued = s->notify_enqueued != 0;
    m->step.phase = (Dpclip__StepPhase)s->phase;
    if (s->dp_world) {
        dpclip__data_parallel__init(&m->dp);
        m->dp.world = s->dp_world;
        m->dp.rank = s->dp_rank;
        m->dp.step = s->dp_step;
        m->dp.noise_multiplier = s->dp_sigma;
        m->step.data_parallel = &m->dp;
    }
    if (s->logical_id) {
        dpclip__logical_step__init(&m->logical);
        m->logical.id = s->logical_id;
        m->logical.micro_batch = s->micro_batch;
        m->logical.commit = s->commit != 0;
        m->step.logical = &m->logical;
    }
    m->step.n_layers = s->n;
    m->step.layers = m->ptrs;

    for (size_t i = 0; i < s->n; i++) {
        const cl_layer *x = &s->layers[i];
        msg_layer *ml = &m->layers[i];
        Dpclip__Layer *L = &ml->layer;

        dpclip__layer__init(L);
        m->ptrs[i] = L;
        if (x->name) L->name = x->name;
        L->replicated = x->replicated != 0;
        L->tied_to = x->tied_to;
        for (int k = 0; k < 2; k++) {
            Dpclip__NoiseRange *nr = &ml->noise[k];
            if (!x->noise[k].set) continue;
            dpclip__noise_range__init(nr);
            nr->dim = x->noise[k].dim;
            nr->begin = x->noise[k].begin;
            nr->end = x->noise[k].end;
            if (k) L->bias_noise = nr;
            else L->weight_noise = nr;
        }
        L->kind_case = x->kind;
        switch (x->kind) {
        case DPCLIP__LAYER__KIND_LINEAR: {
            const dpclip_linear *l = &x->u.lin;
            Dpclip__LinearLayer *k = &ml->k.lin;
            dpclip__linear_layer__init(k);
            k->activations = ref(&ml->refs[0], &l->activations);
            k->output_grad = ref(&ml->refs[1], &l->output_grad);
            k->has_bias = l->has_bias != 0;
            k->algorithm = (Dpclip__Algorithm)l->algo;
            k->weight_grad_out = ref(&ml->refs[2], &l->weight_grad_out);
            k->bias_grad_out = ref(&ml->refs[3], &l->bias_grad_out);
            L->max_grad_norm = l->max_grad_norm;
            L->linear = k;
            break;
        }
        case DPCLIP__LAYER__KIND_EMBEDDING: {
            const dpclip_embedding *e = &x->u.emb;
            Dpclip__EmbeddingLayer *k = &ml->k.emb;
            dpclip__embedding_layer__init(k);
            k->indices = ref(&ml->refs[0], &e->indices);
            k->output_grad = ref(&ml->refs[1], &e->output_grad);
            k->num_embeddings = e->num_embeddings;
            k->has_padding_idx = e->has_padding_idx != 0;
            k->padding_idx = e->padding_idx;
            k->weight_grad_out = ref(&ml->refs[2], &e->weight_grad_out);
            L->max_grad_norm = e->max_grad_norm;
            L->embedding = k;
            break;
        }
        case DPCLIP__LAYER__KIND_LAYER_NORM: {
            const dpclip_norm_layer *n = &x->u.norm;
            Dpclip__LayerNormLayer *k = &ml->k.ln;
            dpclip__layer_norm_layer__init(k);
            k->input = ref(&ml->refs[0], &n->input);
            k->output_grad = ref(&ml->refs[1], &n->output_grad);
            k->eps = n->eps;
            k->has_bias = n->has_bias != 0;
            k->weight_grad_out = ref(&ml->refs[2], &n->weight_grad_out);
            k->bias_grad_out = ref(&ml->refs[3], &n->bias_grad_out);
            L->max_grad_norm = n->max_grad_norm;
            L->layer_norm = k;
            break;
        }
        case DPCLIP__LAYER__KIND_RMS_NORM: {
            const dpclip_norm_layer *n = &x->u.norm;
            Dpclip__RMSNormLayer *k = &ml->k.rms;
            dpclip__rmsnorm_layer__init(k);
            k->input = ref(&ml->refs[0], &n->input);
            k->output_grad = ref(&ml->refs[1], &n->output_grad);
            k->eps = n->eps;
            k->weight_grad_out = ref(&ml->refs[2], &n->weight_grad_out);
            L->max_grad_norm = n->max_grad_norm;
            L->rms_norm = k;
            break;
        }
        default: return cl_fail(c, DPCLIP_EINTERNAL, "clip_step.layers", "corrupt step object");
        }
    }
    *out = &m->step;
    return 0;
}
