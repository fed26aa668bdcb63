/* ClipStep requests: the session's side of a step, which drives its stages
 * in order (step_call.h lists them). Each stage fills its part of the step
 * call and returns; what comes next is decided here, top to bottom:
 *   1. validate (step_validate.c): the request's fields, or the plan cache's
 *      copy of the same step; then a norm group's terms (session_group.c)
 *      and what the step names of the session (device, events);
 *   2. account (step_account.c): the terms, the curve (may wait), the
 *      charge, the spend durable (may wait);
 *   3. run (step_run.c) on a worker: norms, coefficients, clipped sum and
 *      noise; a NORM_REDUCE group's step goes to session_group.c instead,
 *      whose norm phase, reduction and clip phase end in
 *      dc_session_step_done as well;
 *   4. reply (step_reply.c), or the error, with the spend of a step that
 *      released nothing refunded: session_end.c, where a grouped step's
 *      phases end too.
 * All on the loop thread except the work itself. While a step is accepted
 * and not replied to (s->call), the session takes no other request. */
#include <stddef.h>
#include <stdlib.h>

#include "dc_ewma.h"
#include "host.h"
#include "log.h"
#include "session_int.h"
#include "step_account.h"
#include "step_logical.h"
#include "step_pass.h"
#include "step_reply.h"
#include "step_run.h"
#include "step_validate.h"

static void step_accept(dc_session *s, uint64_t id, dc_step_call *sc);
static void step_account(dc_step_call *sc);
static void step_submit(dc_step_call *sc);

/* A step of a grouped session refused before its norms reached the group:
 * the group step fails on every member, not only here. The member's step
 * number is spent with it, as the others' are: its next step is the group's
 * next, not the failed one again (which would fail with the old error). */
static void group_fail(dc_session *s, const dc_step_call *sc, const dc_err *e) {
    uint64_t step;
    if (!s->group) return;
    step = sc && sc->group_step ? sc->group_step : s->group_steps + 1;
    dc_group_fail(s->group, s->group_rank, step, e);
    if (step > s->group_steps && step <= DC_GROUP_STEP_MAX) s->group_steps = step;
}

/* A step refused before it ran. `async`: from a stage that waited, so the
 * session then moves on to its next request. */
static void step_refuse(dc_step_call *sc, const dc_err *e, bool async) {
    dc_session *s = sc->s;
    uint64_t id = sc->req_id;
    s->call = NULL;
    if (sc->pass_reserved) dc_session_pass_drop(s); /* its reservation */
    dc_logical_refused(s, sc, e);                   /* its logical step aborts */
    group_fail(s, sc, e);
    dc_session_call_free(sc);
    dc_session_reject(s, id, e);
    if (async) dc_session_next(s);
}

/* --- 1. validate --------------------------------------------------------- */

int dc_session_step_cached(dc_session *s, uint64_t id, const uint8_t *key, size_t key_len) {
    const dc_step_plan *p = s->plan;
    dc_step_call *sc;
    dc_err e;
    if (!p || !dc_step_plan_matches(p, key, key_len, s->reg.gen, s->host->limits)) return 0;
    if (!(sc = calloc(1, sizeof *sc))) return 0;
    sc->s = s;
    sc->req_id = id;
    sc->t_recv = uv_hrtime();
    sc->t_frame = s->t_frame;
    /* The layers are borrowed from the plan, which outlives the call: it is
     * replaced or dropped only while no step of the session is in flight
     * (a new step validating, the session's end). The group's terms are
     * the step's own each time (its state and counter move on). */
    dc_step_plan_use(p, sc);
    if (dc_session_group_prepare(s, sc, &e)) step_refuse(sc, &e, false);
    else step_accept(s, id, sc);
    return 1;
}

void dc_session_step(dc_session *s, uint64_t id, const Dpclip__ClipStep *m, const uint8_t *key,
                     size_t key_len) {
    dc_step_call *sc = calloc(1, sizeof *sc);
    dc_err e;

    if (!sc) {
        dc_err_set(&e, DC_ENOSPACE, "clip_step", "out of memory");
        dc_session_reject(s, id, &e);
        return;
    }
    sc->s = s;
    sc->req_id = id;
    sc->t_recv = uv_hrtime();
    sc->t_frame = s->t_frame;
    if (dc_step_validate(sc, m, &s->reg, s->host->limits, &e)) {
        step_refuse(sc, &e, false);
        return;
    }
    /* the validated step, before a norm group's terms change it */
    dc_session_plan_drop(s);
    if (key) s->plan = dc_step_plan_new(sc, key, key_len, s->reg.gen, s->host->limits);
    if (dc_session_group_prepare(s, sc, &e)) {
        step_refuse(sc, &e, false);
        return;
    }
    step_accept(s, id, sc);
}

/* Loop thread: the step's GPU work is queued and signal_event recorded. */
static void step_notice(dc_task *task) {
    dc_step_call *sc = (dc_step_call *)task;
    dc_session *s = sc->s;
    uint64_t took = uv_hrtime() - sc->t_submit;
    dc_ewma_add(&s->ewma_notice_ns, took);
    Dpclip__Reply reply = DPCLIP__REPLY__INIT;
    Dpclip__ClipStepEnqueued n = DPCLIP__CLIP_STEP_ENQUEUED__INIT;
    dc_step_reply_notice(sc, s->steps + 1, &n);
    reply.id = sc->req_id;
    reply.body_case = DPCLIP__REPLY__BODY_CLIP_STEP_ENQUEUED;
    reply.clip_step_enqueued = &n;
    dc_session_send(s, &reply);
}

/* A norm pass is held between steps, for as long as its sums take: its
 * bytes are reserved when its NORMS step is accepted, against the user's
 * and the daemon's pass limits, so that passes kept by many sessions
 * cannot add up past them. */
static int pass_reserve(dc_session *s, uint64_t bytes, dc_err *e) {
    const dc_host_cfg *c = &s->host->cfg;
    dc_uid_usage mine, all;
    dc_host_uid_usage(s->host, (uint32_t)s->peer_uid, &mine, &all);
    if (mine.pass_bytes + bytes > c->max_pass_memory_per_uid)
        return dc_err_set(e, DC_ENOSPACE, "limits.max_pass_memory_per_uid",
                          "a norm pass of %llu bytes would take uid %u's passes past %llu bytes "
                          "(limits.max_pass_memory_per_uid; %llu held now)",
                          (unsigned long long)bytes, (unsigned)s->peer_uid,
                          (unsigned long long)c->max_pass_memory_per_uid,
                          (unsigned long long)mine.pass_bytes);
    if (all.pass_bytes + bytes > c->max_pass_memory)
        return dc_err_set(e, DC_ENOSPACE, "limits.max_pass_memory",
                          "a norm pass of %llu bytes would take the daemon's passes past %llu "
                          "bytes (limits.max_pass_memory; %llu held now)",
                          (unsigned long long)bytes, (unsigned long long)c->max_pass_memory,
                          (unsigned long long)all.pass_bytes);
    s->pass_bytes = bytes;
    return 0;
}

/* A step in phases (step_pass.h): its rules, and a sums step's norm pass.
 * Any other step is a new logical step, which ends the session's pass. */
static int step_phase(dc_session *s, dc_step_call *sc, dc_err *e) {
    const dc_step_phase ph = sc->params.phase;
    /* a micro-batch's pass is summed whole before the next step: else its
     * logical step's sums would miss some of its samples (once its logical
     * step aborted, nothing of it is released: the pass goes) */
    if (ph != DC_PHASE_SUMS && dc_pass_pending(s->pass) &&
        dc_logical_is_open(s, dc_pass_logical_id(s->pass)))
        return dc_err_set(e, DC_EPRECOND, "clip_step.phase",
                          "the norm pass of a logical step's micro-batch has layers still to "
                          "sum: every layer of a micro-batch's pass is summed before its next "
                          "step");
    if (ph != DC_PHASE_SUMS) dc_session_pass_drop(s);
    if (ph == DC_PHASE_WHOLE) return 0;
    if (dc_pass_check(sc, s->group != NULL, e)) return e->code;
    if (ph == DC_PHASE_SUMS) return dc_pass_take(s->pass, sc, e);
    if (pass_reserve(s, dc_pass_bytes(sc->step.batch, sc->step.n_layers), e)) return e->code;
    sc->pass_reserved = true;
    if (!(sc->n2 = malloc((size_t)sc->step.batch * sc->step.n_layers * sizeof *sc->n2)) ||
        !(sc->seal = malloc((sc->step.n_layers ? sc->step.n_layers : 1) * sizeof *sc->seal)))
        return dc_err_set(e, DC_ENOSPACE, "clip_step", "out of memory");
    return 0;
}

/* A validated step (owned by sc): check what it names of the session's
 * current state, then account for it. */
static void step_accept(dc_session *s, uint64_t id, dc_step_call *sc) {
    const struct dc_step_params *m = &sc->params;
    dc_err e;
    sc->s = s;
    sc->req_id = id;
    if (s->prev_step_frame) {
        /* A pause (over a second: evaluation, checkpointing) is no period. */
        uint64_t period = sc->t_frame - s->prev_step_frame;
        if (period < 1000000000u) dc_ewma_add(&s->ewma_period_ns, period);
    }
    s->prev_step_frame = sc->t_frame;
    if (dc_step_validate_names(sc, s->host->gpu->n,
                               m->wait_event ? dc_session_find_event(s, m->wait_event) : NULL,
                               m->signal_event ? dc_session_find_event(s, m->signal_event) : NULL,
                               &e) ||
        dc_step_run_prepare(sc, &e) || step_phase(s, sc, &e) || dc_logical_prepare(s, sc, &e)) {
        step_refuse(sc, &e, false);
        return;
    }
    if (sc->step.done_flag && s->group) {
        dc_err_set(&e, DC_EINVAL, "clip_step.done_flag",
                   "a norm group's steps complete through their replies (no done_flag)");
        step_refuse(sc, &e, false);
        return;
    }
    if (sc->notify) sc->task.notice = step_notice;
    step_account(sc);
}

/* --- 2. account ---------------------------------------------------------- */

/* The spend is on disk, or could not be written (rc: the step is refused). */
static void step_durable(dc_step_call *sc, int rc, const dc_err *e) {
    if (rc) step_refuse(sc, e, true);
    else step_submit(sc);
}

/* Accounting, once the curve of the step's (q, sigma) is at hand: the
 * charge, then the wait for it to be durable. `async`: resumed by the
 * ledger. */
static void step_charge(dc_step_call *sc, bool async) {
    dc_session *s = sc->s;
    dc_host *host = s->host;
    bool wait;
    dc_err e;
    dc_step_charge kind;
    bool covered = s->group && dc_group_covers(s->group, s->group_rank, sc->group_step,
                                               (float)sc->sigma, s->account->job_id);
    if (dc_step_account_charge(sc, s->account, covered, &host->cfg, host->metrics, &kind, &e))
        goto fail;
    /* only a charge covers the group's members: a share or a covered step
     * paid nothing */
    if (s->group && kind == DC_STEP_CHARGED)
        dc_group_charged(s->group, s->group_rank, sc->group_step, (float)sc->sigma,
                         s->account->job_id);
    sc->t_checked = uv_hrtime();
    s->call = sc;
    if (dc_step_account_durable(sc, step_durable, &wait, &e)) goto fail;
    if (!wait) step_submit(sc);
    return;
fail:
    step_refuse(sc, &e, async);
}

static void step_curve_ready(dc_step_call *sc, int rc, const dc_err *e) {
    (void)rc;
    (void)e;
    step_charge(sc, true);
}

_Static_assert(sizeof(((dc_session *)0)->job_id) >= DC_LEDGER_JOB_ID_MAX,
               "a session keeps every job id the ledger accepts whole");

/* Accounting, up to the charge: the step's terms on the session's account
 * (opened now if the Hello's was refused). */
static void step_account(dc_step_call *sc) {
    dc_session *s = sc->s;
    dc_host *host = s->host;
    dc_err e;
    const bool micro = sc->params.logical_id && !sc->params.commit;
    if ((sc->params.phase == DC_PHASE_SUMS && s->account) || micro) {
        /* the rest of its norm pass's logical step, which was accounted; or
         * a micro-batch of a logical step, accounted at its commit (it
         * writes no output) */
        sc->eps = s->account ? s->account->eps : 0.0;
        sc->delta = s->account ? s->account->delta : 0.0;
        sc->t_checked = uv_hrtime();
        s->call = sc;
        step_submit(sc);
        return;
    }
    if (dc_step_account_check(sc, &host->cfg, &e)) goto fail;
    if (!s->account) {
        if (dc_ledger_account_open(host->ledger, (uint32_t)s->peer_uid, s->job_id, &s->account, &e))
            goto fail;
        s->account->sessions++; /* as the Hello does; the session's end takes it back */
    }
    if (dc_step_account_terms(sc, s->account, &e)) goto fail;
    s->call = sc; /* from here the session's next request waits for this step */
    if (dc_step_account_curve(sc, s->account, host->loop, step_curve_ready)) return;
    step_charge(sc, false);
    return;
fail:
    step_refuse(sc, &e, false);
}

/* --- 3. run ---------------------------------------------------------------- */

/* Loop thread: a norm pass ran; the session keeps it for its sums. */
static void pass_done(dc_task *task) {
    dc_step_call *sc = (dc_step_call *)task;
    dc_session *s = sc->s;
    if (sc->rc == 0) sc->rc = dc_pass_new(sc, &s->pass, &sc->err);
    if (sc->rc) dc_session_pass_drop(s); /* nothing kept: the reservation goes */
    dc_session_step_done(task);
}

static void step_submit(dc_step_call *sc) {
    dc_session *s = sc->s;
    dc_host *host = s->host;
    struct dc_prewait *pw = s->prewait;
    /* The pre-wait counts if it was for this frame and this event, and is
     * still to run (dc_step_run_work reads its result) or ran fine. */
    if (pw && sc->wait_event && pw->t_frame == sc->t_frame && pw->event == sc->wait_event &&
        (pw->busy || pw->rc == 0))
        sc->prewait = pw;
    sc->step.noise_key = host->noise_key;
    sc->step.noise_step = ++*host->noise_steps;
    sc->task.owner = (uint32_t)s->peer_uid; /* workers are shared fairly between users */
    if (sc->grouped) {                      /* norm phase, the group's reduction, clip phase */
        dc_session_group_submit(sc);
        return;
    }
    sc->task.work = sc->params.phase == DC_PHASE_NORMS  ? dc_step_run_pass_work
                    : sc->params.phase == DC_PHASE_SUMS ? dc_step_run_sums_work
                                                        : dc_step_run_work;
    sc->task.done = sc->params.phase == DC_PHASE_NORMS ? pass_done : dc_session_step_done;
    sc->t_submit = uv_hrtime();
    /* A completion flag's notice goes now, accepted and charged, before
     * any work: the worker stores the value it names at the step's end,
     * failed or not (step_run.c), and sends no notice of its own. */
    if (sc->step.done_flag) sc->done_value = ++s->done_seq;
    dc_worker_pool_submit(dc_session_step_pool(sc), &sc->task);
    if (sc->step.done_flag) step_notice(&sc->task);
    dc_session_step_expect(sc, sc->t_submit);
}

static void prewait_done(dc_task *task) {
    struct dc_prewait *pw = (struct dc_prewait *)task;
    dc_session *s = pw->s;
    pw->busy = false;
    s->async_ops--;
    dc_session_next(s);
}

void dc_session_prewait(dc_session *s) {
    const dc_step_plan *p = s->plan;
    const struct dc_session_event *ev;
    struct dc_prewait *pw = s->prewait;
    if (!p || p->step.device < 0 || p->step.device >= s->host->gpu->n || !p->params.wait_event ||
        (pw && pw->busy) || !(ev = dc_session_find_event(s, p->params.wait_event)) ||
        ev->device != p->step.device)
        return;
    if (!pw && !(pw = s->prewait = calloc(1, sizeof *pw))) return; /* best effort */
    pw->s = s;
    pw->event = ev->event;
    pw->t_frame = s->t_frame;
    pw->rc = -1;
    pw->busy = true;
    pw->task.work = dc_step_run_prewait;
    pw->task.done = prewait_done;
    s->async_ops++; /* the session waits for it like for a handle open */
    dc_worker_pool_submit(&s->host->gpu->pools[p->step.device], &pw->task);
}

/* --- 4. reply: session_end.c ------------------------------------------------ */
