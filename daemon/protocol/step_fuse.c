#include "step_fuse.h"

#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "gpu.h"
#include "group.h"
#include "step_logical.h"
#include "step_run.h"

/* The field a member's step differs from the first's in, or NULL. The
 * fused step runs with the first member's terms and copies its [B] tables
 * into every member's: whatever the group believed when it matched them,
 * each member's batch and terms are checked here, where they are used. */
static const char *member_differs(const dc_step *a, const dc_step *b) {
    if (a->batch != b->batch) return "clip_step.batch_size";
    if (a->max_grad_norm != b->max_grad_norm) return "clip_step.clip.max_grad_norm";
    if (a->noise_multiplier != b->noise_multiplier) return "clip_step.noise_multiplier";
    if (a->reduction != b->reduction) return "clip_step.clip.loss_reduction";
    if (a->expected_batch != b->expected_batch) return "clip_step.clip.expected_batch_size";
    if (a->mode != b->mode) return "clip_step.clip.mode";
    if (a->device != b->device) return "clip_step";
    if (a->acc != b->acc) return "clip_step.logical";
    return NULL;
}

int dc_step_fuse_build(dc_step_fused *f, dc_step_call *chain, uint32_t n, dc_err *e) {
    const dc_step *first = &chain->step;
    const char *field;
    size_t L = 0, at = 0;
    memset(f, 0, sizeof *f);
    for (const dc_step_call *sc = chain; sc; sc = sc->fuse_next)
        if ((field = member_differs(first, &sc->step)))
            return dc_err_set(e, DC_EINVAL, field,
                              "the members of a fused group step disagree on %s (rank %u and "
                              "rank %u)",
                              field, chain->gw.rank, sc->gw.rank);
    f->n = n;
    f->members = malloc(n * sizeof *f->members);
    if (!f->members) goto fail;
    for (uint32_t i = 0; i < n; i++, chain = chain->fuse_next) {
        f->members[i] = chain;
        L += chain->step.n_layers;
    }
    f->step.layers = malloc((L ? L : 1) * sizeof *f->step.layers);
    f->more_norms = calloc(n, sizeof *f->more_norms);
    f->more_coefs = calloc(n, sizeof *f->more_coefs);
    if (!f->step.layers || !f->more_norms || !f->more_coefs ||
        dc_step_result_init(&f->res, first->batch, L, false))
        goto fail;
    /* the terms are every member's (the group checked them) */
    f->step.batch = first->batch;
    f->step.n_layers = L;
    f->step.mode = DC_CLIP_FLAT;
    f->step.max_grad_norm = first->max_grad_norm;
    f->step.reduction = first->reduction;
    f->step.expected_batch = first->expected_batch;
    f->step.noise_multiplier = first->noise_multiplier;
    f->step.noise_key = first->noise_key;
    f->step.noise_step = first->noise_step;
    f->step.group_noise_key = first->group_noise_key;
    f->step.group_step = first->group_step;
    f->step.device = first->device;
    f->step.acc = first->acc; /* the members agree (group terms) */
    f->step.norms_out = first->norms_out;
    f->step.coefs_out = first->coefs_out;
    f->step.n_more_outs = n - 1;
    f->step.more_norms_out = f->more_norms;
    f->step.more_coefs_out = f->more_coefs;
    for (uint32_t i = 0; i < n; i++) {
        const dc_step_call *sc = f->members[i];
        const dc_step *st = &sc->step;
        f->step.want_layer_norms |= st->want_layer_norms;
        if (i) {
            f->more_norms[i - 1] = st->norms_out;
            f->more_coefs[i - 1] = st->coefs_out;
        }
        for (size_t l = 0; l < st->n_layers; l++) {
            dc_layer *ly = &f->step.layers[at + l];
            *ly = st->layers[l];
            /* counted by rank 0 alone, as in the phased path */
            ly->norm_excluded = ly->replicated && sc->gw.rank != 0;
            ly->noise_step = st->noise_step;
            ly->noise_index = (uint32_t)l;
            if (ly->tie) ly->tie += (uint32_t)at;
        }
        at += st->n_layers;
    }
    return 0;
fail:
    dc_step_fuse_free(f);
    return dc_err_set(e, DC_ENOSPACE, "clip_step", "out of memory for a fused group step");
}

/* Everything that writes the members' memory is queued: their signal
 * events follow it (the backend's enqueued hook, before it synchronises). */
static void fused_enqueued(void *arg) {
    dc_step_fused *f = arg;
    for (uint32_t i = 0; i < f->n; i++) {
        dc_step_call *sc = f->members[i];
        dc_err e;
        if (sc->signal_event && dc_gpu_record_event(sc->be, sc->signal_event, &e) == 0)
            sc->signaled = true;
    }
}

/* The fused norms count rank 0's copy of the replicated layers alone, and
 * every copy is noised alike, so every member's copy must hold the same
 * data (group.h): their checksums (dc_step_run_replicas_hash) are compared
 * first, and a copy that differs fails the fused step on every member
 * before anything is written. */
static int replicas_check(dc_step_fused *f, dc_backend *be) {
    uint64_t first = 0;
    for (uint32_t i = 0; i < f->n; i++) {
        uint64_t h;
        bool any;
        const dc_step *st = &f->members[i]->step;
        int rc = dc_step_run_replicas_hash(be, st, dc_step_run_replicas_key(st), &h, &any, &f->err);
        if (rc) return rc;
        if (!any) continue;
        if (i == 0) {
            first = h;
        } else if (h != first) {
            return dc_err_set(&f->err, DC_EINVAL, "clip_step.layers.replicated",
                              "rank %u's copy of the replicated layers holds other data than "
                              "rank %u's; replicated layers hold the same data on every member, "
                              "whose copies are noised alike",
                              f->members[i]->gw.rank, f->members[0]->gw.rank);
        }
    }
    return 0;
}

void dc_step_fuse_work(dc_task *task, dc_backend *be) {
    dc_step_fused *f = (dc_step_fused *)task;
    f->t_start = uv_hrtime();
    dc_err_clear(&f->err);
    for (uint32_t i = 0; i < f->n; i++) {
        dc_step_call *sc = f->members[i];
        bool waited = sc->prewait && sc->prewait->rc == 0; /* on this thread, before */
        sc->be = be;
        if (sc->wait_event && !waited && (f->rc = dc_gpu_wait_event(be, sc->wait_event, &f->err))) {
            f->t_waited = f->t_end = uv_hrtime();
            return;
        }
    }
    f->t_waited = uv_hrtime();
    /* a micro-batch of a logical step: every member's accumulators, into
     * the fused step's copies of its layers */
    for (uint32_t i = 0, at = 0; i < f->n; at += (uint32_t)f->members[i]->step.n_layers, i++) {
        dc_step_call *sc = f->members[i];
        if ((f->rc = dc_logical_ensure(sc, be, &f->err))) {
            f->t_end = uv_hrtime();
            return;
        }
        for (size_t l = 0; l < sc->step.n_layers; l++) {
            f->step.layers[at + l].acc_w = sc->step.layers[l].acc_w;
            f->step.layers[at + l].acc_b = sc->step.layers[l].acc_b;
        }
    }
    if ((f->rc = replicas_check(f, be))) {
        f->t_end = uv_hrtime();
        return;
    }
    f->step.enqueued = fused_enqueued;
    f->step.enqueued_arg = f;
    f->rc = dc_backend_run_step(be, &f->step, &f->res, &f->err);
    if (f->rc && f->res.released) dc_step_run_released_error(&f->err);
    for (uint32_t i = 0; f->rc == 0 && i < f->n; i++) {
        dc_step_call *sc = f->members[i];
        if (sc->signal_event && !sc->signaled) {
            f->res.released = true; /* the outputs are written, whatever happens next */
            f->rc = dc_gpu_record_event(be, sc->signal_event, &f->err);
        }
    }
    f->workspace = dc_backend_workspace_bytes(be);
    f->t_end = uv_hrtime();
}

void dc_step_fuse_split(dc_step_fused *f) {
    const uint32_t B = f->step.batch;
    size_t at = 0;
    for (uint32_t i = 0; i < f->n; i++) {
        dc_step_call *sc = f->members[i];
        const size_t L = sc->step.n_layers;
        sc->rc = f->rc;
        sc->err = f->err;
        sc->t_start = f->t_start;
        sc->t_waited = f->t_waited;
        sc->t_end = f->t_end;
        sc->workspace = f->workspace;
        sc->group_wait_ns = sc->gw.wait_ns;
        sc->group_exchange_ns = 0;
        sc->res.released |= f->res.released;
        sc->res.compute_ns = f->res.compute_ns;
        memcpy(sc->res.phase_ns, f->res.phase_ns, sizeof sc->res.phase_ns);
        if (f->rc == 0) {
            memcpy(sc->res.norms, f->res.norms, B * sizeof *sc->res.norms);
            memcpy(sc->res.coefs, f->res.coefs, B * sizeof *sc->res.coefs);
            memcpy(sc->res.layer_norms, f->res.layer_norms + at * B,
                   L * B * sizeof *sc->res.layer_norms);
        }
        at += L;
    }
}

void dc_step_fuse_free(dc_step_fused *f) {
    if (!f) return;
    free(f->members);
    free(f->step.layers);
    free(f->more_norms);
    free(f->more_coefs);
    dc_step_result_free(&f->res);
    f->members = NULL;
    f->step.layers = NULL;
    f->more_norms = f->more_coefs = NULL;
}
