/* libdpclip: running steps. dpclip_run (blocking), dpclip_submit and
 * dpclip_submit_cb (pipelined), dpclip_wait / dpclip_wait_enqueued /
 * dpclip_poll (completions), over the request FIFO of conn.c. A step
 * object that has not changed since it was last sent is re-sent from its
 * packed bytes (c->packed), so a trainer's every-iteration step costs no
 * message building. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dc_ewma.h"
#include "internal.h"

/* --- steps --------------------------------------------------------------- */

/* Builds and sends the step; for async kinds `d` becomes the pending
 * request's completion record. */
static int send_step(dpclip_client *c, const dpclip_step *s, cl_req_kind kind, cl_done *d) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    cl_pending p;
    int rc;

    if (c->fd < 0) return cl_closed(c);
    if ((rc = cl_reserve_pending(c))) return rc;
    if (c->packed_step != s || c->packed_ver != cl_step_version(s)) {
        size_t n;
        c->packed_step = NULL;
        if ((rc = cl_step_message(c, s, &req.clip_step))) return rc;
        req.body_case = DPCLIP__REQUEST__BODY_CLIP_STEP;
        req.id = 0;
        n = dpclip__request__get_packed_size(&req);
        if (n > c->packed_cap) {
            uint8_t *nb = realloc(c->packed, n);
            if (!nb)
                return cl_fail(c, DPCLIP_ENOMEM, "", "out of memory for a %zu-byte request", n);
            c->packed = nb;
            c->packed_cap = n;
        }
        c->packed_len = dpclip__request__pack(&req, c->packed);
        c->packed_step = s;
        c->packed_ver = cl_step_version(s);
    }
    if ((rc = cl_send_body(c, c->packed, c->packed_len, -1, &req.id))) return rc;
    memset(&p, 0, sizeof p);
    p.req_id = req.id;
    p.kind = kind;
    p.batch = cl_step_batch(s);
    p.n_layers = cl_step_layers(s);
    p.d = d;
    cl_push_pending(c, &p);
    return 0;
}

DPCLIP_API int dpclip_run(dpclip_client *c, const dpclip_step *s, dpclip_result *res) {
    Dpclip__Reply *r = NULL;
    int rc;

    if (res) memset(res, 0, sizeof *res);
    if (!c || !s || !res) return DPCLIP_EARG;
    cl_lock(c);
    uint64_t t0 = dc_clock_ns();
    if ((rc = send_step(c, s, CL_REQ_SYNC, NULL))) goto out;
    uint64_t t_sent = dc_clock_ns();
    /* Steps of a trainer have the same shape step after step: poll around
     * the time the last reply took instead of sleeping through it. Short
     * steps (< 1 ms) need no window: the daemon answers within the wait's
     * first scheduling quantum. */
    if (c->spin_enabled && c->ewma_rt_ns > 1000000u && c->p_len == 1) {
        uint64_t early = c->ewma_rt_ns / 20 > 300000u ? c->ewma_rt_ns / 20 : 300000u;
        c->spin_from_ns = t0 + c->ewma_rt_ns - early;
        c->spin_to_ns = t0 + c->ewma_rt_ns + 4 * early;
    }
    /* Replies to earlier submits come first; read_one completes them. */
    while (!r)
        if ((rc = cl_read_one(c, -1, &r))) break;
    c->spin_to_ns = 0;
    if (rc) goto out;
    uint64_t t_got = dc_clock_ns(), rt = t_got - t0;
    dc_ewma_add(&c->ewma_rt_ns, rt);
    if (r->body_case == DPCLIP__REPLY__BODY_ERROR) {
        rc = cl_fail(c, cl_daemon_code(r->error->code), r->error->field, "%s", r->error->message);
    } else if (r->body_case == DPCLIP__REPLY__BODY_CLIP_STEP) {
        char msg[160];
        if ((rc = cl_to_result(r->clip_step, cl_step_batch(s), cl_step_layers(s), res, msg,
                               sizeof msg)))
            cl_fail(c, rc, "", "%s", msg);
        else
            c->last_timing = (dpclip_timing){t0,
                                             t_sent,
                                             r->clip_step->t_received_ns,
                                             r->clip_step->t_replied_ns,
                                             t_got,
                                             r->clip_step->compute_ns,
                                             r->clip_step->group_wait_ns,
                                             r->clip_step->group_exchange_ns,
                                             r->clip_step->input_wait_ns};
    } else {
        rc = cl_die(c, "dpclipd sent reply type %d to a ClipStep", (int)r->body_case);
    }
    dpclip__reply__free_unpacked(r, NULL);
out:
    cl_unlock(c);
    return rc;
}

DPCLIP_API int dpclip_last_timing(dpclip_client *c, dpclip_timing *t) {
    int rc = 0;
    if (!c || !t) return DPCLIP_EARG;
    cl_lock(c);
    if (c->last_timing.start_ns == 0)
        rc = cl_fail(c, DPCLIP_EPRECOND, "", "no step has completed through dpclip_run yet");
    else *t = c->last_timing;
    cl_unlock(c);
    return rc;
}

static int submit(dpclip_client *c, const dpclip_step *s, cl_req_kind kind, dpclip_step_cb cb,
                  void *user, uint64_t *ticket) {
    cl_done *d;
    int rc;

    cl_lock(c);
    if (!(d = calloc(1, sizeof *d))) {
        rc = cl_fail(c, DPCLIP_ENOMEM, "", "out of memory");
        goto out;
    }
    d->kind = kind;
    d->cb = cb;
    d->user = user;
    if (kind == CL_REQ_TICKET) d->ticket = ++c->next_ticket;
    if ((rc = send_step(c, s, kind, d))) {
        free(d);
        goto out;
    }
    d->t_sent = dc_clock_ns();
    if (ticket) *ticket = d->ticket;
out:
    cl_unlock(c);
    return rc;
}

DPCLIP_API int dpclip_submit(dpclip_client *c, const dpclip_step *s, uint64_t *ticket) {
    if (!c || !s || !ticket) return DPCLIP_EARG;
    return submit(c, s, CL_REQ_TICKET, NULL, NULL, ticket);
}

/* The callback runs on the thread of a later dpclip_run/wait/poll/disconnect
 * call on this handle, after that call released the handle's lock. */
DPCLIP_API int dpclip_submit_cb(dpclip_client *c, const dpclip_step *s, dpclip_step_cb cb,
                                void *user) {
    if (!c || !s || !cb) return DPCLIP_EARG;
    return submit(c, s, CL_REQ_CB, cb, user, NULL);
}

static int ticket_pending(const dpclip_client *c, uint64_t ticket) {
    for (size_t i = 0; i < c->p_len; i++) {
        const cl_pending *p = &c->pend[(c->p_head + i) % c->p_cap];
        if (p->kind == CL_REQ_TICKET && p->d->ticket == ticket) return 1;
    }
    return 0;
}

static cl_done *take_done(dpclip_client *c, uint64_t ticket) {
    for (cl_done **pp = &c->done_head; *pp; pp = &(*pp)->next) {
        cl_done *d = *pp;
        if (d->ticket != ticket) continue;
        *pp = d->next;
        return d;
    }
    return NULL;
}

DPCLIP_API int dpclip_wait(dpclip_client *c, uint64_t ticket, int timeout_ms, dpclip_result *res) {
    int64_t deadline = cl_deadline(timeout_ms);
    Dpclip__Reply *sync;
    cl_done *d;
    int rc;

    if (res) memset(res, 0, sizeof *res);
    if (!c || !res) return DPCLIP_EARG;
    cl_lock(c);
    while (!(d = take_done(c, ticket))) {
        if (!ticket_pending(c, ticket)) {
            rc = cl_fail(c, DPCLIP_EARG, "", "ticket %llu is unknown or already collected",
                         (unsigned long long)ticket);
            goto out;
        }
        rc = cl_read_one(c, deadline, &sync);
        if (sync) { /* cannot happen: sync requests finish inside their call */
            dpclip__reply__free_unpacked(sync, NULL);
            rc = cl_die(c, "internal error: stray synchronous reply");
        }
        if (rc == DPCLIP_EAGAIN) goto out;
        if (rc && rc != DPCLIP_EIO) goto out;
        /* EIO completed every pending ticket: the loop finds ours. */
    }
    rc = d->status;
    if (rc) {
        snprintf(c->errmsg, sizeof c->errmsg, "%s", d->errmsg);
        snprintf(c->errfield, sizeof c->errfield, "%s", d->errfield);
    } else {
        *res = d->res;
        memset(&d->res, 0, sizeof d->res);
    }
    free(d);
out:
    cl_unlock(c);
    return rc;
}

/* The completion record of a ticket still in flight, or NULL. */
static cl_done *pending_done(const dpclip_client *c, uint64_t ticket) {
    for (size_t i = 0; i < c->p_len; i++) {
        const cl_pending *p = &c->pend[(c->p_head + i) % c->p_cap];
        if (p->kind == CL_REQ_TICKET && p->d->ticket == ticket) return p->d;
    }
    return NULL;
}

DPCLIP_API int dpclip_wait_enqueued(dpclip_client *c, uint64_t ticket, int timeout_ms,
                                    dpclip_enqueued *info) {
    int64_t deadline = cl_deadline(timeout_ms);
    Dpclip__Reply *sync;
    int rc;

    if (info) memset(info, 0, sizeof *info);
    if (!c || !info) return DPCLIP_EARG;
    cl_lock(c);
    /* A notice comes within about the time the last ones took (a fraction
     * of a millisecond: the daemon queues the step's GPU work): poll for it
     * rather than sleep through a wake-up. */
    cl_done *pd = pending_done(c, ticket);
    if (c->spin_enabled && pd && !pd->enqueued) {
        uint64_t w = c->ewma_notice_ns ? 2 * c->ewma_notice_ns + 200000u : 2000000u;
        c->spin_from_ns = pd->t_sent;
        c->spin_to_ns = pd->t_sent + (w < 5000000u ? w : 5000000u);
    }
    for (;;) {
        cl_done *d = pending_done(c, ticket);
        if (d && d->enqueued) {
            *info = d->enq;
            if (d == pd && d->t_sent) {
                uint64_t took = dc_clock_ns() - d->t_sent;
                dc_ewma_add(&c->ewma_notice_ns, took);
            }
            rc = 0;
            break;
        }
        if (!d) {
            /* finished: a success counts as enqueued (still to collect); a
             * failure is reported and collected here */
            for (d = c->done_head; d && d->ticket != ticket; d = d->next) {
            }
            if (!d) {
                rc = cl_fail(c, DPCLIP_EARG, "", "ticket %llu is unknown or already collected",
                             (unsigned long long)ticket);
                break;
            }
            if (d->status == 0) {
                info->step_index = d->res.step_index;
                info->epsilon = d->res.epsilon;
                info->delta = d->res.delta;
                rc = 0;
                break;
            }
            d = take_done(c, ticket);
            rc = d->status;
            snprintf(c->errmsg, sizeof c->errmsg, "%s", d->errmsg);
            snprintf(c->errfield, sizeof c->errfield, "%s", d->errfield);
            dpclip_result_free(&d->res);
            free(d);
            break;
        }
        rc = cl_read_one(c, deadline, &sync);
        if (sync) {
            dpclip__reply__free_unpacked(sync, NULL);
            rc = cl_die(c, "internal error: stray synchronous reply");
        }
        if (rc == DPCLIP_EAGAIN) break;
        if (rc && rc != DPCLIP_EIO) break;
    }
    c->spin_to_ns = 0;
    cl_unlock(c);
    return rc;
}

DPCLIP_API int dpclip_poll(dpclip_client *c, int timeout_ms) {
    int64_t deadline = cl_deadline(timeout_ms);
    Dpclip__Reply *sync;
    int n = 0, rc = 0;

    if (!c) return -DPCLIP_EARG;
    cl_lock(c);
    while (c->p_len) {
        /* Wait up to the timeout for the first completion, then take only
         * what has already arrived. */
        size_t before = c->p_len;
        rc = cl_read_one(c, n ? dc_clock_ms() : deadline, &sync);
        if (sync) {
            dpclip__reply__free_unpacked(sync, NULL);
            rc = cl_die(c, "internal error: stray synchronous reply");
        }
        if (rc == DPCLIP_EAGAIN) {
            rc = 0;
            break;
        }
        if (rc) break;
        if (c->p_len < before) n++; /* an early notice completes nothing */
    }
    cl_unlock(c);
    return rc ? -rc : n;
}
