#include "step_pass.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What identifies a layer between a pass and its sums: the tensors it reads
 * (daemon addresses of the same buffers at the same offsets), its shapes and
 * its terms. */
typedef struct pass_layer {
    dc_layer_kind kind;
    int64_t T, d, p, vocab;
    dc_tensor input, grad;
    bool has_bias, has_padding_idx, tie_owner;
    int64_t padding_idx;
    float eps;
    uint32_t tie; /* 1 + the pass index of the other layer of a tied pair, 0 = none */
    bool summed;
} pass_layer;

struct dc_pass {
    uint32_t batch;
    int device;
    float max_grad_norm;
    float noise_multiplier; /* what the pass was accounted at; its sums add it */
    bool data_parallel;     /* a data-parallel member: other ranks noise other rows */
    dc_reduction reduction;
    uint32_t expected_batch;
    size_t n_layers, n_summed;
    size_t next; /* where the next match is looked for first: sums come in order */
    /* a micro-batch of a logical step (ClipStep.logical): its sums carry the
     * same; logical_id 0: none */
    uint64_t logical_id;
    uint32_t micro_batch;
    bool commit;
    double *n2;     /* [L*B] */
    double *tot;    /* [B] */
    double e;       /* the bound its reply's coefficients and every sums step clip by */
    uint64_t *seal; /* [L] each layer's seal, under seal_key (step_run.h) */
    uint64_t seal_key;
    uint8_t *unsealed; /* [L] kept layers left unsealed (step_pass.h), or NULL */
    /* what the backend kept of the norm pass (backend.h dc_kept), lent to
     * each sums step; given back with the pass */
    dc_kept *kept;
    dc_backend *kept_be;
    pass_layer *layers;
};

int dc_pass_check(const dc_step_call *sc, bool grouped, dc_err *e) {
    const dc_step *s = &sc->step;
    const char *what = sc->params.phase == DC_PHASE_NORMS ? "a norm pass (phase STEP_NORMS)"
                                                          : "a sums step (phase STEP_SUMS)";
    if (grouped)
        return dc_err_set(e, DC_EINVAL, "clip_step.phase",
                          "%s is not taken in a norm group: a group's members already sum "
                          "their norms",
                          what);
    if (s->mode != DC_CLIP_FLAT)
        return dc_err_set(e, DC_EINVAL, "clip_step.clip.mode", "%s clips flat", what);
    if (sc->params.phase != DC_PHASE_NORMS) return 0;
    for (size_t l = 0; l < s->n_layers; l++)
        if (s->layers[l].weight_grad_out.data || s->layers[l].bias_grad_out.data)
            return dc_err_set(e, DC_EINVAL,
                              s->layers[l].weight_grad_out.data ? "clip_step.layers.weight_grad_out"
                                                                : "clip_step.layers.bias_grad_out",
                              "layer %zu ('%s'): a norm pass writes no sums; name the outputs "
                              "in the STEP_SUMS steps that follow",
                              l, s->layers[l].name);
    if (s->norms_out.data || s->coefs_out.data)
        return dc_err_set(e, DC_EINVAL,
                          s->norms_out.data ? "clip_step.norms_out" : "clip_step.coefficients_out",
                          "a norm pass writes nothing to client memory: its norms and "
                          "coefficients are in the reply");
    if (sc->params.signal_event || sc->params.notify_enqueued)
        return dc_err_set(e, DC_EINVAL,
                          sc->params.signal_event ? "clip_step.signal_event"
                                                  : "clip_step.notify_enqueued",
                          "a norm pass writes nothing for an event to signal");
    return 0;
}

static bool tensor_same(const dc_tensor *a, const dc_tensor *b) {
    if (a->data != b->data || a->dtype != b->dtype || a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

static void layer_keep(pass_layer *k, const dc_layer *ly) {
    memset(k, 0, sizeof *k);
    k->kind = ly->kind;
    k->T = ly->T;
    k->d = ly->d;
    k->p = ly->p;
    k->vocab = ly->vocab;
    k->input = ly->input;
    k->grad = ly->grad;
    k->has_bias = ly->has_bias;
    k->has_padding_idx = ly->has_padding_idx;
    k->padding_idx = ly->padding_idx;
    k->tie_owner = ly->tie_owner;
    k->eps = ly->eps;
    k->tie = ly->tie;
}

static bool layer_same(const pass_layer *k, const dc_layer *ly) {
    return k->kind == ly->kind && k->T == ly->T && k->d == ly->d && k->p == ly->p &&
           k->vocab == ly->vocab && tensor_same(&k->input, &ly->input) &&
           tensor_same(&k->grad, &ly->grad) && k->has_bias == ly->has_bias &&
           k->has_padding_idx == ly->has_padding_idx &&
           (!k->has_padding_idx || k->padding_idx == ly->padding_idx) &&
           k->tie_owner == ly->tie_owner && (k->tie != 0) == (ly->tie != 0) &&
           memcmp(&k->eps, &ly->eps, sizeof k->eps) == 0;
}

int dc_pass_new(dc_step_call *sc, dc_pass **out, dc_err *e) {
    const dc_step *s = &sc->step;
    const uint32_t B = s->batch;
    const size_t L = s->n_layers;
    dc_step_result *r = &sc->res;
    dc_pass *p = calloc(1, sizeof *p);
    *out = NULL;
    if (!p || !(p->tot = malloc(B * sizeof *p->tot)) ||
        !(p->layers = malloc(L * sizeof *p->layers)))
        goto nomem;
    p->batch = B;
    p->device = s->device;
    p->max_grad_norm = s->max_grad_norm;
    p->logical_id = sc->params.logical_id;
    p->micro_batch = sc->params.micro_batch;
    p->commit = sc->params.commit;
    p->noise_multiplier = s->noise_multiplier;
    p->data_parallel = sc->params.dp.declared;
    p->reduction = s->reduction;
    p->expected_batch = s->expected_batch;
    p->n_layers = L;
    for (size_t l = 0; l < L; l++) layer_keep(&p->layers[l], &s->layers[l]);
    /* the e every sums step clips with (a kept pass's at least its floor) */
    double eb = dc_clip_e_step(s, dc_clip_e_how(s));
    if (sc->kept && eb < DC_E_KEPT_FLOOR) eb = DC_E_KEPT_FLOOR;
    p->e = eb; /* a sums step's layers are some of the norm's: they clip by its bound */
    for (uint32_t b = 0; b < B; b++) {
        double t = 0.0;
        for (size_t l = 0; l < L; l++) t += sc->n2[l * B + b];
        /* run_norms failed the step on a non-finite input; a total that
         * overflowed still must not clip as "no clipping" */
        if (!isfinite(t)) {
            dc_pass_free(p);
            return dc_err_set(e, DC_ENONFINITE, "clip_step",
                              "sample %u: its squared gradient norm overflows", b);
        }
        p->tot[b] = t;
        r->norms[b] = (float)sqrt(t);
        /* the coefficients its sums will clip by: with the re-measurement's
         * margin (step_pass.h), so that the reply says what is applied */
        r->coefs[b] = dc_clip_coef(s->max_grad_norm, sqrt(t * (1.0 + DC_PHASE_RECHECK_TOL)), eb);
    }
    for (size_t i = 0; i < L * B; i++) r->layer_norms[i] = (float)sqrt(sc->n2[i]);
    p->n2 = sc->n2;
    sc->n2 = NULL;
    p->seal = sc->seal;
    sc->seal = NULL;
    p->seal_key = sc->seal_key;
    p->unsealed = sc->unsealed;
    sc->unsealed = NULL;
    p->kept = sc->kept;
    p->kept_be = sc->kept_be;
    sc->kept = NULL;
    *out = p;
    return 0;
nomem:
    dc_pass_free(p);
    return dc_err_set(e, DC_ENOSPACE, "clip_step", "out of memory");
}

/* A sums step adds its pass's noise, the noise the pass was accounted at
 * (validate.c has checked that each output names its range): not less, and
 * none where the pass was a noiseless share. A pass outside data
 * parallelism is a logical step of its own, whose every element no other
 * member noises: its sums' ranges are their whole outputs. */
static int noise_check(const dc_pass *p, const dc_step *s, dc_err *e) {
    if (s->noise_multiplier != p->noise_multiplier)
        return dc_err_set(e, DC_EINVAL, "clip_step.noise_multiplier",
                          "a sums step adds its norm pass's noise: noise_multiplier %g, the one "
                          "the pass was accounted at (%g given)",
                          (double)p->noise_multiplier, (double)s->noise_multiplier);
    if (p->data_parallel) return 0;
    for (size_t l = 0; l < s->n_layers; l++)
        for (int k = 0; k < 2; k++) {
            const dc_layer *ly = &s->layers[l];
            const dc_noise_range *r = k ? &ly->noise_b : &ly->noise_w;
            const dc_tensor *t = k ? &ly->bias_grad_out : &ly->weight_grad_out;
            char f[96];
            if (!r->set || (r->begin == 0 && r->end == (uint64_t)t->shape[r->dim])) continue;
            snprintf(f, sizeof f, "clip_step.layers[%zu].%s", l, k ? "bias_noise" : "weight_noise");
            return dc_err_set(e, DC_EINVAL, f,
                              "layer %zu ('%s'): the norm pass declared no data parallelism, "
                              "so no other rank noises the rest of this output: its noise "
                              "range is the whole output",
                              l, ly->name);
        }
    return 0;
}

/* The pass's layer that a sums layer names, not summed yet: SIZE_MAX if
 * none. Looked for from where the last match left off. */
static size_t find(const dc_pass *p, const dc_layer *ly) {
    for (size_t i = 0; i < p->n_layers; i++) {
        size_t k = (p->next + i) % p->n_layers;
        if (!p->layers[k].summed && layer_same(&p->layers[k], ly)) return k;
    }
    return SIZE_MAX;
}

int dc_pass_take(dc_pass *p, dc_step_call *sc, dc_err *e) {
    const dc_step *s = &sc->step;
    const uint32_t B = s->batch;
    const size_t L = s->n_layers;
    size_t *at = NULL, matched = 0;
    int rc;

    if (!p)
        return dc_err_set(e, DC_EPRECOND, "clip_step.phase",
                          "no norm pass to sum: send a STEP_NORMS step naming every layer "
                          "first (any other step ends the pass)");
    if (s->device != p->device || B != p->batch)
        return dc_err_set(e, DC_EINVAL,
                          s->device != p->device ? "clip_step" : "clip_step.batch_size",
                          "the norm pass was of %u samples on %s: a sums step takes its batch "
                          "and device",
                          p->batch, p->device < 0 ? "host memory" : "a GPU");
    if (sc->params.logical_id != p->logical_id || sc->params.micro_batch != p->micro_batch ||
        sc->params.commit != p->commit)
        return dc_err_set(e, DC_EINVAL, "clip_step.logical",
                          "a sums step carries its norm pass's logical step, micro-batch and "
                          "commit");
    if (s->max_grad_norm != p->max_grad_norm || s->reduction != p->reduction ||
        s->expected_batch != p->expected_batch)
        return dc_err_set(e, DC_EINVAL, "clip_step.clip",
                          "a sums step takes its norm pass's max_grad_norm, reduction and "
                          "expected batch size");
    if ((rc = noise_check(p, s, e))) return rc;
    if (!(at = malloc(L * sizeof *at)) || !(sc->n2 = malloc(L * B * sizeof *sc->n2)) ||
        !(sc->tot = malloc(B * sizeof *sc->tot)) ||
        !(sc->seal = malloc((L ? L : 1) * sizeof *sc->seal)) ||
        (p->unsealed && !(sc->unsealed = malloc(L ? L : 1)))) {
        rc = dc_err_set(e, DC_ENOSPACE, "clip_step", "out of memory");
        goto fail;
    }
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &s->layers[l];
        if ((at[l] = find(p, ly)) == SIZE_MAX) {
            rc = dc_err_set(e, DC_EINVAL, "clip_step.layers",
                            "layer %zu ('%s') is no layer of the norm pass that is still to "
                            "sum: name each of the pass's layers once, with the same kind, "
                            "shapes and tensors",
                            l, ly->name);
            goto fail;
        }
        p->layers[at[l]].summed = true; /* for the search of the next ones */
        p->next = at[l] + 1;
        matched++;
    }
    /* a tied pair: both layers here, and the pass's pair */
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &s->layers[l];
        if (ly->tie && p->layers[at[l]].tie != at[ly->tie - 1] + 1) {
            rc = dc_err_set(e, DC_EINVAL, "clip_step.layers.tied_to",
                            "layer %zu ('%s'): its tied pair is not the norm pass's", l, ly->name);
            goto fail;
        }
    }
    for (size_t l = 0; l < L; l++) {
        memcpy(&sc->n2[l * B], &p->n2[at[l] * B], B * sizeof *sc->n2);
        sc->seal[l] = p->seal[at[l]];
        if (sc->unsealed) sc->unsealed[l] = p->unsealed[at[l]];
    }
    sc->seal_key = p->seal_key;
    sc->kept = p->kept; /* lent (or none): the pass gives it back */
    sc->kept_be = p->kept_be;
    sc->kept_borrowed = p->kept != NULL;
    memcpy(sc->tot, p->tot, B * sizeof *sc->tot);
    sc->e_min = p->e;
    p->n_summed += L;
    sc->pass_at = at; /* the pass's index of each layer: its accumulators (step_logical.c) */
    return 0;
fail:
    for (size_t l = 0; l < matched; l++) p->layers[at[l]].summed = false;
    free(at);
    free(sc->n2);
    free(sc->tot);
    free(sc->seal);
    free(sc->unsealed);
    sc->n2 = sc->tot = NULL;
    sc->seal = NULL;
    sc->unsealed = NULL;
    return rc;
}

void dc_phase_margin(double *tot, uint32_t batch) {
    for (uint32_t b = 0; b < batch; b++) tot[b] *= 1.0 + DC_PHASE_RECHECK_TOL;
}

uint64_t dc_pass_bytes(uint32_t batch, size_t n_layers) {
    return sizeof(dc_pass) +
           (uint64_t)n_layers *
               (batch * sizeof(double) + sizeof(uint64_t) + 1 + sizeof(pass_layer)) +
           (uint64_t)batch * sizeof(double);
}

uint64_t dc_pass_logical_id(const dc_pass *p) { return p ? p->logical_id : 0; }

bool dc_pass_pending(const dc_pass *p) { return p && p->logical_id && p->n_summed < p->n_layers; }

bool dc_pass_done(const dc_pass *p) { return p && p->n_summed == p->n_layers; }

void dc_pass_free(dc_pass *p) {
    if (!p) return;
    dc_backend_kept_free(p->kept_be, p->kept);
    free(p->n2);
    free(p->tot);
    free(p->seal);
    free(p->unsealed);
    free(p->layers);
    free(p);
}
