/* libdpclip: a handle's state under its lock, which every other part of
 * the library builds on: its errors (and the death of its connection), the
 * lock and the callbacks completed while it was held, the FIFO of requests
 * in flight and their completions, and step results.
 *
 * Model: one Unix stream socket per handle. Every request gets exactly one
 * reply (a ClipStep with an early notice gets the notice first) and replies
 * come in request order (docs/protocol.md), so requests in flight are a FIFO
 * (c->pend) and each reply completes the FIFO's head (calls.c). Tickets are
 * stored for dpclip_wait; callbacks are queued and run once the handle's
 * lock is released. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* --- errors ------------------------------------------------------------- */

int cl_fail(dpclip_client *c, int code, const char *field, const char *fmt, ...) {
    va_list ap;
    snprintf(c->errfield, sizeof c->errfield, "%s", field ? field : "");
    va_start(ap, fmt);
    vsnprintf(c->errmsg, sizeof c->errmsg, fmt, ap);
    va_end(ap);
    return code;
}

/* Completes an async request with `status` (its result, if any, already in
 * d->res) and queues it where its owner will find it. */
void cl_finish(dpclip_client *c, cl_done *d, int status, const char *field, const char *msg) {
    d->status = status;
    snprintf(d->errmsg, sizeof d->errmsg, "%s", msg ? msg : "");
    snprintf(d->errfield, sizeof d->errfield, "%s", field ? field : "");
    d->next = NULL;
    if (d->kind == CL_REQ_TICKET) {
        d->next = c->done_head;
        c->done_head = d;
    } else {
        if (c->cb_tail) c->cb_tail->next = d;
        else c->cb_head = d;
        c->cb_tail = d;
    }
}

void cl_fail_all_pending(dpclip_client *c, const char *msg) {
    while (c->p_len) {
        cl_pending *p = &c->pend[c->p_head];
        if (p->d) cl_finish(c, p->d, DPCLIP_EIO, "", msg);
        c->p_head = (c->p_head + 1) % c->p_cap;
        c->p_len--;
    }
}

int cl_keep_notice(dpclip_client *c, const Dpclip__Reply *r) {
    if (r->id != 0 || r->body_case != DPCLIP__REPLY__BODY_ERROR || !r->error || !r->error->field ||
        strcmp(r->error->field, "daemon") != 0)
        return 0;
    snprintf(c->notice, sizeof c->notice, "%s",
             r->error->message && r->error->message[0] ? r->error->message
                                                       : "dpclipd is closing the connection");
    return 1;
}

int cl_closed(dpclip_client *c) {
    if (c->notice[0]) return cl_fail(c, DPCLIP_EIO, "daemon", "%s", c->notice);
    return cl_fail(c, DPCLIP_EIO, "", "the connection to dpclipd is closed");
}

int cl_die(dpclip_client *c, const char *fmt, ...) {
    va_list ap;
    c->errfield[0] = '\0';
    va_start(ap, fmt);
    vsnprintf(c->errmsg, sizeof c->errmsg, fmt, ap);
    va_end(ap);
    /* After the daemon's notice, that is why (not "Broken pipe"). */
    if (c->notice[0]) {
        snprintf(c->errmsg, sizeof c->errmsg, "%s", c->notice);
        snprintf(c->errfield, sizeof c->errfield, "daemon");
    }
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->rlen = 0;
    cl_fail_all_pending(c, c->errmsg);
    return DPCLIP_EIO;
}

/* Daemon error codes are 1..10 and equal to ours; anything else is bogus. */
int cl_daemon_code(Dpclip__ErrorCode code) {
    int v = (int)code;
    return v >= DPCLIP_EINVAL && v <= DPCLIP_EUNIMPL ? v : DPCLIP_EINTERNAL;
}

/* --- locking and callbacks --------------------------------------------- */

void cl_lock(dpclip_client *c) { pthread_mutex_lock(&c->mu); }

/* Releases the lock, then runs the callbacks completed during the call, in
 * completion order, with the lock not held (they may call the library). */
void cl_unlock(dpclip_client *c) {
    cl_done *d = c->cb_head;
    c->cb_head = c->cb_tail = NULL;
    pthread_mutex_unlock(&c->mu);
    while (d) {
        cl_done *next = d->next;
        d->cb(d->user, d->status, d->status ? d->errmsg : NULL, d->status ? NULL : &d->res);
        dpclip_result_free(&d->res);
        free(d);
        d = next;
    }
}

/* --- the FIFO ------------------------------------------------------------ */

/* Makes room for one more pending request before it is sent, so that a sent
 * request can always be tracked. */
int cl_reserve_pending(dpclip_client *c) {
    cl_pending *np;
    size_t cap;
    if (c->p_len < c->p_cap) return 0;
    cap = c->p_cap ? c->p_cap * 2 : 16;
    np = malloc(cap * sizeof *np);
    if (!np) return cl_fail(c, DPCLIP_ENOMEM, "", "out of memory");
    for (size_t i = 0; i < c->p_len; i++) np[i] = c->pend[(c->p_head + i) % c->p_cap];
    free(c->pend);
    c->pend = np;
    c->p_cap = cap;
    c->p_head = 0;
    return 0;
}

void cl_push_pending(dpclip_client *c, const cl_pending *p) {
    c->pend[(c->p_head + c->p_len) % c->p_cap] = *p;
    c->p_len++;
}

/* Copies a ClipStepReply into a result with malloc'd arrays. */
int cl_to_result(const Dpclip__ClipStepReply *r, uint32_t batch, uint32_t n_layers,
                 dpclip_result *res, char *msg, size_t msgn) {
    size_t lb = (size_t)n_layers * batch;
    memset(res, 0, sizeof *res);
    if (r->n_norms != batch || r->n_coefficients != batch ||
        (r->n_layer_norms && r->n_layer_norms != lb) ||
        (r->n_layer_coefficients && r->n_layer_coefficients != lb)) {
        snprintf(msg, msgn,
                 "the daemon's reply has %zu norms and %zu coefficients for a batch of %u",
                 r->n_norms, r->n_coefficients, batch);
        return DPCLIP_EPROTO;
    }
    res->batch = batch;
    res->n_layers = n_layers;
    res->step_index = r->step_index;
    res->compute_ns = r->compute_ns;
    res->input_wait_ns = r->input_wait_ns;
    res->logical_id = r->logical_id;
    res->micro_batches = r->micro_batches;
    res->epsilon = r->epsilon;
    res->delta = r->delta;
    res->norms = malloc(batch * sizeof(float));
    res->coefs = malloc(batch * sizeof(float));
    if (r->n_layer_norms) res->layer_norms = malloc(lb * sizeof(float));
    if (r->n_layer_coefficients) res->layer_coefs = malloc(lb * sizeof(float));
    if (!res->norms || !res->coefs || (r->n_layer_norms && !res->layer_norms) ||
        (r->n_layer_coefficients && !res->layer_coefs)) {
        dpclip_result_free(res);
        snprintf(msg, msgn, "out of memory for the step's result");
        return DPCLIP_ENOMEM;
    }
    memcpy(res->norms, r->norms, batch * sizeof(float));
    memcpy(res->coefs, r->coefficients, batch * sizeof(float));
    if (res->layer_norms) memcpy(res->layer_norms, r->layer_norms, lb * sizeof(float));
    if (res->layer_coefs) memcpy(res->layer_coefs, r->layer_coefficients, lb * sizeof(float));
    return 0;
}

DPCLIP_API void dpclip_result_free(dpclip_result *r) {
    if (!r) return;
    free(r->norms);
    free(r->coefs);
    free(r->layer_norms);
    free(r->layer_coefs);
    memset(r, 0, sizeof *r);
}
