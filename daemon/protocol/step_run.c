#include "step_run.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <uv.h>

#include "dc_hash.h"
#include "gpu.h"
#include "step_logical.h"
#include "step_pass.h"

/* Worker thread, inside the backend's run_step: everything that writes the
 * client's memory is queued. Record the client's event behind it now, off
 * the step's critical path (the driver call costs microseconds; after the
 * synchronisation the reply would wait for it), and with an early notice
 * let the loop send it while the device works. If the record fails the
 * notice is not sent and dc_step_run_work fails the step or records again. */
static void step_enqueued(void *arg) {
    dc_step_call *sc = arg;
    dc_err e;
    if (dc_gpu_record_event(sc->be, sc->signal_event, &e)) return;
    sc->signaled = true;
    if (sc->notify && !sc->step.done_flag) dc_task_notify(&sc->task); /* (sent at submit) */
}

/* A step that failed once noised: no noised value may leave in its message,
 * whatever the backend wrote there (the client keeps its code and field). */
void dc_step_run_released_error(dc_err *e) {
    snprintf(e->msg, sizeof e->msg,
             "the noised clipped sum is not finite in this output's dtype; nothing was "
             "written. The failure depends on the noise, so the step's privacy spend stands");
}

int dc_step_run_prepare(dc_step_call *sc, dc_err *e) {
    if (sc->notify) sc->step.zero_on_fail = true;
    if (sc->signal_event) {
        sc->step.enqueued = step_enqueued;
        sc->step.enqueued_arg = sc;
    }
    if (dc_step_result_init(&sc->res, sc->step.batch, sc->step.n_layers,
                            sc->step.mode == DC_CLIP_PER_LAYER))
        return dc_err_set(e, DC_ENOSPACE, "clip_step", "out of memory");
    return 0;
}

/* A sums step's layers its pass left unsealed: each summed from the
 * pass's store alone, which the backend does for a kept layer whose weight
 * sum is asked for (and refuses to do otherwise: backend.h dc_kept), and
 * nothing of the client's read for it: no bias sum, no tie. */
static int unsealed_ok(dc_step_call *sc) {
    for (size_t l = 0; sc->unsealed && l < sc->step.n_layers; l++) {
        const dc_layer *ly = &sc->step.layers[l];
        if (!sc->unsealed[l]) continue;
        if (!sc->kept || !ly->weight_grad_out.data || (ly->has_bias && ly->bias_grad_out.data) ||
            ly->tie)
            return dc_err_set(&sc->err, DC_EINVAL, "clip_step.layers",
                              "layer %zu ('%s'): its norm pass kept its per-sample gradients, "
                              "so its sums step sums them, which it does for the weight's "
                              "output: name that output (and no other)",
                              l, ly->name);
    }
    return 0;
}

/* The clip phase of a step whose norms an earlier task measured (sc->n2,
 * totals sc->tot, seals sc->seal): its data checked against the seals and
 * clipped with the margin (step_pass.h). The reply's norms stay the
 * totals'. */
static int clip_checked(dc_step_call *sc, dc_backend *be) {
    const uint32_t B = sc->step.batch;
    const size_t L = sc->step.n_layers;
    uint64_t *now = NULL;
    double *tot = NULL;
    int rc;
    if (!dc_backend_has_clip_phase(be))
        return dc_err_set(&sc->err, DC_EUNIMPL, "clip_step.phase",
                          "the %s backend has no separate clip phase", dc_backend_name(be));
    if (!sc->seal)
        return dc_err_set(&sc->err, DC_EINTERNAL, "clip_step.phase",
                          "a clip phase without its norms' seals");
    if (!(now = malloc((L ? L : 1) * sizeof *now)) || !(tot = malloc((B ? B : 1) * sizeof *tot))) {
        rc = dc_err_set(&sc->err, DC_ENOSPACE, "clip_step", "out of memory");
        goto out;
    }
    /* a group member's own kept layers go unsealed; a pass's sums step's,
     * those its pass left unsealed */
    dc_kept view = {L, sc->unsealed};
    const dc_kept *unsealed = !sc->kept_borrowed ? sc->kept : sc->unsealed ? &view : NULL;
    if ((rc = unsealed_ok(sc))) goto out;
    if ((rc = dc_step_run_seal(be, &sc->step, sc->seal_key, unsealed, now, &sc->err))) goto out;
    for (size_t l = 0; l < L; l++)
        if (now[l] != sc->seal[l]) {
            rc = dc_err_set(&sc->err, DC_EINVAL, "clip_step.layers",
                            "layer %zu ('%s'): its data changed since its norms were measured: "
                            "a clipped sum is only released for the data its norms measured; "
                            "nothing was written",
                            l, sc->step.layers[l].name);
            goto out;
        }
    if (sc->grouped && sc->gw.has_rep_hash) {
        /* the replicated copy the group compared is the one released */
        uint64_t h;
        bool any;
        if ((rc = dc_step_run_replicas_hash(be, &sc->step, sc->gw.rep_key, &h, &any, &sc->err)))
            goto out;
        if (h != sc->gw.rep_hash) {
            rc = dc_err_set(&sc->err, DC_EINVAL, "clip_step.layers.replicated",
                            "the replicated layers' data changed since the group compared "
                            "them; nothing was written");
            goto out;
        }
    }
    memcpy(tot, sc->tot, B * sizeof *tot);
    dc_phase_margin(tot, B);
    if ((rc = dc_backend_run_clip(be, &sc->step, sc->n2, tot, sc->e_min, sc->kept,
                                  sc->kept && sc->kept_borrowed ? sc->pass_at : NULL, &sc->res,
                                  &sc->err)))
        goto out;
    for (uint32_t b = 0; b < B; b++) sc->res.norms[b] = (float)sqrt(sc->tot[b]);
out:
    /* a member's kept gradients are spent (or not to be used): back for
     * the next; a pass's stay with it for its other sums steps */
    if (!sc->kept_borrowed) dc_backend_kept_free(sc->kept_be, sc->kept);
    sc->kept = NULL;
    free(now);
    free(tot);
    return rc;
}

/* The whole step, or (sums) the clip phase of a step in phases with the
 * norm pass's totals (step_pass.c). */
static void run_step(dc_step_call *sc, dc_backend *be, bool sums) {
    sc->t_start = uv_hrtime();
    sc->be = be;
    dc_err_clear(&sc->err);
    /* A pre-wait ran before this task on this same thread (one worker per
     * GPU, in order): if it succeeded the stream already waits. */
    bool waited = sc->prewait && sc->prewait->rc == 0;
    if (sc->wait_event && !waited && (sc->rc = dc_gpu_wait_event(be, sc->wait_event, &sc->err))) {
        sc->t_waited = sc->t_end = uv_hrtime();
        return;
    }
    sc->t_waited = uv_hrtime();
    if ((sc->rc = dc_logical_ensure(sc, be, &sc->err))) {
        sc->t_end = uv_hrtime();
        return;
    }
    if (!sums) sc->rc = dc_backend_run_step(be, &sc->step, &sc->res, &sc->err);
    else sc->rc = clip_checked(sc, be);
    if (sc->rc && sc->res.released) dc_step_run_released_error(&sc->err);
    if (sc->rc == 0 && sc->signal_event && !sc->signaled) {
        sc->res.released = true; /* the outputs are written, whatever happens next */
        if (sc->notify)
            sc->rc = dc_err_set(&sc->err, DC_EINTERNAL, "clip_step.signal_event",
                                "could not record the step's signal event");
        else sc->rc = dc_gpu_record_event(be, sc->signal_event, &sc->err);
    }
    /* Read here, on the thread that owns the backend. */
    sc->workspace = dc_backend_workspace_bytes(be);
    sc->t_end = uv_hrtime();
}

/* The end of a step with a completion flag: a failed one's outputs zeroed
 * (its consumer may already wait on the flag), then the value stored,
 * whatever happened, so that no client's stream waits for good. The store
 * is the last access: the work it reports has finished on the device
 * (run_step waited for it).
 *
 * Where the outputs cannot be zeroed (the device's context is broken)
 * they may hold part of the step, clipped sums without their noise: the
 * flag, which would let the client's stream apply them, is never stored.
 * The abandon word takes the value instead, and the session closes after
 * the error (abandoned): the client, woken by the hang-up, zeroes the
 * outputs itself, which no work of this daemon's can write any more (a
 * broken context runs none), and then releases its own stream
 * (docs/protocol.md, "Done flag"). */
static void done_store(dc_step_call *sc, dc_backend *be) {
    const dc_step *s = &sc->step;
    if (!s->done_flag) return;
    if (sc->rc && dc_backend_zero_outputs(be, s) != 0) {
        size_t n = strlen(sc->err.msg);
        snprintf(sc->err.msg + n, sizeof sc->err.msg - n,
                 "; its outputs could not be zeroed, so the done flag was not stored and the "
                 "session closes: zero them before releasing the stream");
        if (s->done_abandon) __atomic_store_n(s->done_abandon, sc->done_value, __ATOMIC_RELEASE);
        sc->abandoned = true;
        return;
    }
    __atomic_store_n(s->done_flag, sc->done_value, __ATOMIC_RELEASE);
}

void dc_step_run_work(dc_task *task, dc_backend *be) {
    dc_step_call *sc = (dc_step_call *)task;
    run_step(sc, be, false);
    done_store(sc, be);
}

void dc_step_run_sums_work(dc_task *task, dc_backend *be) {
    run_step((dc_step_call *)task, be, true);
}

static void norms_phase(dc_step_call *sc, dc_backend *be, bool unseal_kept);

/* A norm pass's kept layers without a bias or a tie (step_pass.h): each
 * sums step can take their sums from the store alone (it must: unsealed_ok),
 * so their data, never read again, goes unsealed; into sc->unsealed, and
 * *view over it. A bias's sum reads the client's output grads, and a tied
 * use's the client's data, so those layers stay sealed. */
static int pass_unsealed(dc_step_call *sc, dc_kept *view) {
    const size_t L = sc->step.n_layers;
    if (!(sc->unsealed = calloc(L ? L : 1, 1)))
        return dc_err_set(&sc->err, DC_ENOSPACE, "clip_step", "out of memory");
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &sc->step.layers[l];
        sc->unsealed[l] = dc_kept_has(sc->kept, l) && !ly->has_bias && !ly->tie;
    }
    *view = (dc_kept){L, sc->unsealed};
    return 0;
}

void dc_step_run_pass_work(dc_task *task, dc_backend *be) {
    dc_step_call *sc = (dc_step_call *)task;
    /* what it keeps its sums steps sum from: those kept layers whose every
     * sum comes from the store go unsealed (pass_unsealed) */
    norms_phase(sc, be, false);
    sc->t_end = uv_hrtime();
}

void dc_step_run_prewait(dc_task *task, dc_backend *be) {
    struct dc_prewait *pw = (struct dc_prewait *)task;
    pw->rc = dc_gpu_wait_event(be, pw->event, &pw->err);
}

/* --- a NORM_REDUCE group's step, in two tasks ----------------------------- */

void dc_step_run_norms_work(dc_task *task, dc_backend *be) {
    norms_phase((dc_step_call *)task, be, true);
}

/* The backend may keep per-sample gradients for the sums that follow.
 * unseal_kept: those are this call's own clip phase's (a group member's),
 * which must sum every kept layer from them (the backend refuses
 * otherwise), so they go unsealed. */
static void norms_phase(dc_step_call *sc, dc_backend *be, bool unseal_kept) {
    sc->t_start = sc->t_waited = uv_hrtime();
    dc_err_clear(&sc->err);
    /* GPU steps: the stream waits for the client's inputs first (unless a
     * pre-wait for this step's event already did, on this thread) */
    bool waited = sc->prewait && sc->prewait->rc == 0;
    if (sc->wait_event && !waited && (sc->rc = dc_gpu_wait_event(be, sc->wait_event, &sc->err)))
        return;
    sc->rc = dc_backend_has_norm_phase(be)
                 ? dc_backend_run_norms(be, &sc->step, sc->n2, &sc->kept, &sc->err)
                 : dc_err_set(&sc->err, DC_EUNIMPL, "clip_step",
                              "the %s backend has no separate norm phase", dc_backend_name(be));
    if (sc->kept) sc->kept_be = be;
    if (sc->rc == 0)
        dc_backend_norm_times(be, sc->res.phase_ns); /* (a clip phase's replace them) */
    /* the seal right after the norms: what the clip phase may sum */
    dc_kept view;
    const dc_kept *unsealed = unseal_kept ? sc->kept : NULL;
    if (sc->rc == 0 && !unseal_kept && sc->kept && !(sc->rc = pass_unsealed(sc, &view)))
        unsealed = &view;
    if (sc->rc == 0 && !(sc->rc = dc_step_run_seal_key(&sc->seal_key, &sc->err)))
        sc->rc = dc_step_run_seal(be, &sc->step, sc->seal_key, unsealed, sc->seal, &sc->err);
    if (sc->rc == 0 && sc->grouped) {
        /* the bound its clip phase would take alone: the group clips every
         * member by the largest (group.h) */
        sc->gw.e = dc_clip_e_phase(&sc->step, dc_clip_e_how(&sc->step),
                                   sc->kept ? sc->kept->layer : NULL);
        sc->gw.rep_key = dc_step_run_replicas_key(&sc->step);
        sc->rc = dc_step_run_replicas_hash(be, &sc->step, sc->gw.rep_key, &sc->gw.rep_hash,
                                           &sc->gw.has_rep_hash, &sc->err);
    }
    sc->t_normed = uv_hrtime();
}

uint64_t dc_step_run_replicas_key(const dc_step *st) {
    return dc_hash_mix(st->group_noise_key ^ dc_hash_mix(st->group_step));
}

/* The checksums of the layers' inputs and output grads (the replicated
 * layers' alone with replicated_only), in one backend call: h[2i] and
 * h[2i + 1] of the i-th layer taken. *n: the layers taken. The caller frees
 * *h. */
static int layers_hash(dc_backend *be, const dc_step *st, bool replicated_only, const dc_kept *skip,
                       uint64_t key, uint64_t **h, size_t *n, const char *field, dc_err *e) {
    const dc_tensor **ts = NULL;
    size_t k = 0;
    int rc = 0;
    *h = NULL;
    *n = 0;
    if (!dc_backend_has_hash(be))
        return dc_err_set(e, DC_EUNIMPL, field, "the %s backend cannot checksum tensors",
                          dc_backend_name(be));
    if (!(ts = malloc((2 * st->n_layers + 1) * sizeof *ts)) ||
        !(*h = malloc((2 * st->n_layers + 1) * sizeof **h))) {
        rc = dc_err_set(e, DC_ENOSPACE, "clip_step", "out of memory");
        goto fail;
    }
    for (size_t l = 0; l < st->n_layers; l++) {
        if (replicated_only && !st->layers[l].replicated) continue;
        if (dc_kept_has(skip, l)) continue;
        ts[k++] = &st->layers[l].input;
        ts[k++] = &st->layers[l].grad;
    }
    if (k && (rc = dc_backend_tensors_hash(be, ts, k, key, *h, e))) goto fail;
    *n = k / 2;
    free(ts);
    return 0;
fail:
    free(ts);
    free(*h);
    *h = NULL;
    return rc;
}

int dc_step_run_replicas_hash(dc_backend *be, const dc_step *st, uint64_t key, uint64_t *out,
                              bool *any, dc_err *e) {
    uint64_t *h, sum = 0;
    size_t n;
    int rc = layers_hash(be, st, true, NULL, key, &h, &n, "clip_step.layers.replicated", e);
    if (rc) return rc;
    for (size_t i = 0; i < n; i++) sum = dc_hash_mix(dc_hash_mix(sum ^ h[2 * i]) ^ h[2 * i + 1]);
    free(h);
    *any = n > 0;
    *out = sum;
    return 0;
}

int dc_step_run_seal_key(uint64_t *key, dc_err *e) {
    if (getrandom(key, sizeof *key, 0) != (ssize_t)sizeof *key)
        return dc_err_set(e, DC_EINTERNAL, "clip_step", "no key for the step's seal: %s",
                          strerror(errno));
    return 0;
}

int dc_step_run_seal(dc_backend *be, const dc_step *st, uint64_t key, const dc_kept *kept,
                     uint64_t *out, dc_err *e) {
    uint64_t *h;
    size_t n;
    int rc = layers_hash(be, st, false, kept, key, &h, &n, "clip_step.phase", e);
    if (rc) return rc;
    /* h holds the n layers taken, in order */
    size_t i = 0;
    for (size_t l = 0; l < st->n_layers; l++) {
        if (dc_kept_has(kept, l)) {
            out[l] = 0; /* summed from the daemon's copy: nothing to check */
            continue;
        }
        out[l] = dc_hash_mix(dc_hash_mix(h[2 * i]) ^ h[2 * i + 1]);
        i++;
    }
    (void)n;
    free(h);
    return 0;
}

void dc_step_run_clip_work(dc_task *task, dc_backend *be) {
    dc_step_call *sc = (dc_step_call *)task;
    sc->t_start = sc->t_waited = uv_hrtime();
    sc->be = be;
    dc_err_clear(&sc->err);
    if (!(sc->rc = dc_logical_ensure(sc, be, &sc->err))) sc->rc = clip_checked(sc, be);
    if (sc->rc == 0 && sc->signal_event) { /* the client's stream may go on */
        sc->res.released = true;
        sc->rc = dc_gpu_record_event(be, sc->signal_event, &sc->err);
    }
    sc->t_end = uv_hrtime();
}
