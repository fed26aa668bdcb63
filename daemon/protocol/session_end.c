/* How a ClipStep ends, on the loop thread, whichever way it ran: a whole
 * step, a norm pass or its sums steps (session_step.c), or a norm group's
 * phases (session_group.c). Its reply or error (step_reply.c), the
 * session's bookkeeping (metrics, the steps' cadence, the workspace it
 * grew), the call freed, then the session's next request. Below both of
 * its callers, it calls neither: the group's stages and the step's meet
 * here instead of calling each other. */
#include <stdlib.h>

#include "dc_ewma.h"
#include "host.h"
#include "session_int.h"
#include "step_account.h"
#include "step_logical.h"
#include "step_pass.h"
#include "step_reply.h"

/* A step call freed, with everything it holds (its caller has cleared
 * the session's s->call where it was that). */
void dc_session_call_free(dc_step_call *sc) {
    if (!sc->kept_borrowed) /* a group step that never clipped */
        dc_backend_kept_free(sc->kept_be, sc->kept);
    dc_step_result_free(&sc->res);
    free(sc->n2);
    free(sc->seal);
    free(sc->unsealed);
    free(sc->partial);
    free(sc->tot);
    free(sc->rep);
    free(sc->pass_at);
    if (sc->cached) sc->step.layers = NULL; /* the plan's */
    dc_validate_step_free(&sc->step);
    free(sc);
}

/* The session may take its next request, or go if its client went. */
void dc_session_next(dc_session *s) {
    if (s->gone) dc_session_destroy(s);
    else dc_session_process(s);
}

/* The session's norm pass goes, with its bytes against the pass limits. */
void dc_session_pass_drop(dc_session *s) {
    dc_pass_free(s->pass);
    s->pass = NULL;
    s->pass_bytes = 0;
}

dc_worker_pool *dc_session_step_pool(const dc_step_call *sc) {
    dc_host *host = sc->s->host;
    return sc->step.device >= 0 ? &host->gpu->pools[sc->step.device] : host->cpu_pool;
}

/* Poll for what comes back: an early notice within about the time the
 * last ones took, the completion around the recent steps' run time. */
void dc_session_step_expect(const dc_step_call *sc, uint64_t now) {
    dc_session *s = sc->s;
    dc_host *host = s->host;
    if (sc->notify)
        dc_host_poll(host, now,
                     now + (s->ewma_notice_ns ? 2 * s->ewma_notice_ns + 100000u : 2000000u), false);
    if (sc->step.device >= 0 && s->ewma_gpu_run_ns) {
        uint64_t from, to;
        dc_ewma_window(now, s->ewma_gpu_run_ns, 0, &from, &to);
        dc_host_poll(host, from, to, false);
    } else {
        dc_host_spin(host, false);
    }
}

/* A GPU step's workspace as its backend holds it now: a step that made it
 * grow past gpu.workspace allocated inside the step path. */
static void note_workspace(dc_host *host, const dc_step_call *sc) {
    if (sc->step.device >= 0 && sc->step.device < DC_MAX_GPUS) {
        uint64_t *held = &host->gpu_workspace[sc->step.device];
        uint64_t had = *held > host->cfg.gpu_workspace ? *held : host->cfg.gpu_workspace;
        if (sc->workspace > had)
            dc_log_warn("cuda:%d: a step needed more device workspace than gpu.workspace; it "
                        "grew to %llu bytes inside the step: set gpu.workspace to at least "
                        "that to keep allocations out of the step path",
                        sc->step.device, (unsigned long long)sc->workspace);
        *held = sc->workspace;
    }
}

/* After a reply: a trainer's next request often follows within
 * microseconds (its next step in a tight loop, or a registration), so poll
 * a little (daemon.spin_us). And a trainer's steps come at a steady period:
 * have the loop, and the GPU's worker, awake around when the next one is
 * due, rather than pay two wake-ups on its critical path. */
static void expect_next(dc_session *s, const dc_step_call *sc, uint64_t now) {
    dc_host *host = s->host;
    dc_host_spin(host, true);
    if (!s->ewma_period_ns || !host->spin_ns) return;
    uint64_t due = sc->t_frame + s->ewma_period_ns;
    if (due + s->ewma_period_ns / 4 <= now) return; /* late already: no cadence to follow */
    uint64_t m = dc_ewma_margin(s->ewma_period_ns);
    dc_host_poll(host, due > m ? due - m : 0, due + m, true);
    if (sc->step.device >= 0) /* and the GPU's worker: a timed wait, then polling */
        dc_worker_pool_expect(&host->gpu->pools[sc->step.device], due > m ? due - m : 0,
                              due + 2 * m);
}

void dc_session_step_done(dc_task *task) {
    dc_step_call *sc = (dc_step_call *)task;
    dc_session_step_reply(sc);
    dc_session_step_finish(sc);
}

void dc_session_step_reply(dc_step_call *sc) {
    dc_session *s = sc->s;
    sc->t_done = uv_hrtime();
    s->call = NULL;
    if (sc->step.device >= 0) {
        uint64_t run = sc->t_end - sc->t_start;
        dc_ewma_add(&s->ewma_gpu_run_ns, run);
    }
    dc_logical_done(s, sc); /* moves its logical step on, or aborts it */
    if (sc->rc == 0) {
        Dpclip__Reply reply = DPCLIP__REPLY__INIT;
        Dpclip__ClipStepReply cr = DPCLIP__CLIP_STEP_REPLY__INIT;
        /* a micro-batch is part of its logical step (counted at the
         * commit), a sums step of its norm pass's */
        const bool micro = sc->params.logical_id && !sc->params.commit;
        dc_step_reply_fill(sc,
                           micro                               ? s->steps + 1
                           : sc->params.phase == DC_PHASE_SUMS ? s->steps
                                                               : ++s->steps,
                           &cr);
        if (sc->params.logical_id) {
            cr.logical_id = sc->params.logical_id;
            cr.micro_batches = dc_logical_micro_batches(s);
        }
        reply.id = sc->req_id;
        reply.body_case = DPCLIP__REPLY__BODY_CLIP_STEP;
        reply.clip_step = &cr;
        dc_session_send(s, &reply);
    } else {
        s->steps_failed++;
        if (sc->err.code == DC_OK) dc_err_set(&sc->err, DC_EINTERNAL, "clip_step", "step failed");
        if (!sc->res.released) dc_step_account_refund(sc);
        dc_session_send_error(s, sc->req_id, &sc->err);
        if (sc->abandoned) {
            /* its flag was never stored: the hang-up has the client zero
             * its outputs and release its stream (step_run.c done_store) */
            dc_log_warn("session %llu: a failed step's outputs could not be zeroed (request "
                        "%llu); closing the session after its error",
                        (unsigned long long)s->id, (unsigned long long)sc->req_id);
            s->closing = true;
        }
    }
}

void dc_session_step_finish(dc_step_call *sc) {
    dc_session *s = sc->s;
    dc_host *host = s->host;
    uint64_t now = uv_hrtime();
    s->last_step_ns = now;
    dc_step_reply_count(sc, now, host->metrics);
    note_workspace(host, sc);
    if (sc->params.phase == DC_PHASE_SUMS && dc_pass_done(s->pass))
        dc_session_pass_drop(s); /* every layer summed: nothing more to hold */
    expect_next(s, sc, now);
    dc_step_reply_log(sc, s->id, s->steps, sc->t_done, now, s->last_send_ns);
    dc_session_call_free(sc);
    dc_session_next(s);
}
