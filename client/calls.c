/* libdpclip: a request and its reply. Replies are read in request order
 * (framing.c) and each completes the FIFO's head (conn.c); a blocking call
 * sends its request and reads replies until its own arrives, completing
 * earlier submits on the way. */
#include <string.h>

#include "internal.h"

/* Reads one reply and pops the FIFO's head with it. A synchronous request's
 * reply is handed to the caller in *sync (free it); an async one is
 * completed here. */
int cl_read_one(dpclip_client *c, int64_t deadline, Dpclip__Reply **sync) {
    Dpclip__Reply *r;
    cl_pending p;
    int rc;

    *sync = NULL;
    if (c->p_len == 0) return cl_fail(c, DPCLIP_EINTERNAL, "", "no request is outstanding");
    if ((rc = cl_read_reply(c, deadline, &r))) return rc;
    p = c->pend[c->p_head];
    /* Errors about frames the daemon could not decode carry id 0. */
    if (r->id != p.req_id && !(r->id == 0 && r->body_case == DPCLIP__REPLY__BODY_ERROR)) {
        unsigned long long got = (unsigned long long)r->id;
        dpclip__reply__free_unpacked(r, NULL);
        return cl_die(c, "dpclipd answered request %llu while %llu was next: stream out of sync",
                      got, (unsigned long long)p.req_id);
    }
    if (r->body_case == DPCLIP__REPLY__BODY_CLIP_STEP_ENQUEUED) {
        /* A step's early notice: its final reply is still to come, so the
         * request stays at the head. Blocking calls just read on. */
        if (p.d && !p.d->enqueued) {
            p.d->enqueued = 1;
            p.d->enq.step_index = r->clip_step_enqueued->step_index;
            p.d->enq.epsilon = r->clip_step_enqueued->epsilon;
            p.d->enq.delta = r->clip_step_enqueued->delta;
            p.d->enq.done_value = r->clip_step_enqueued->done_value;
        }
        dpclip__reply__free_unpacked(r, NULL);
        return 0;
    }
    c->p_head = (c->p_head + 1) % c->p_cap;
    c->p_len--;
    if (p.kind == CL_REQ_SYNC) {
        *sync = r;
        return 0;
    }
    if (r->body_case == DPCLIP__REPLY__BODY_ERROR) {
        cl_finish(c, p.d, cl_daemon_code(r->error->code), r->error->field, r->error->message);
    } else if (r->body_case == DPCLIP__REPLY__BODY_CLIP_STEP) {
        char msg[160] = "";
        rc = cl_to_result(r->clip_step, p.batch, p.n_layers, &p.d->res, msg, sizeof msg);
        cl_finish(c, p.d, rc, "", msg);
    } else {
        cl_finish(c, p.d, DPCLIP_EPROTO, "", "unexpected reply to a ClipStep");
    }
    dpclip__reply__free_unpacked(r, NULL);
    return 0;
}

/* Sends req and waits for its reply, completing earlier submits on the way.
 * On success *out is the reply with body `expect`; an Error reply becomes
 * the handle's error and its code. */
int cl_call(dpclip_client *c, Dpclip__Request *req, int pass_fd, Dpclip__Reply__BodyCase expect,
            int64_t deadline, Dpclip__Reply **out) {
    cl_pending p;
    Dpclip__Reply *r = NULL;
    int rc;

    *out = NULL;
    if (c->fd < 0) return cl_closed(c);
    if ((rc = cl_reserve_pending(c))) return rc;
    if ((rc = cl_send_request(c, req, pass_fd, deadline))) return rc;
    memset(&p, 0, sizeof p);
    p.req_id = req->id;
    p.kind = CL_REQ_SYNC;
    cl_push_pending(c, &p);
    while (!r) {
        if ((rc = cl_read_one(c, deadline, &r))) {
            if (rc == DPCLIP_EAGAIN) return cl_die(c, "timed out waiting for dpclipd");
            return rc;
        }
    }
    if (r->body_case == DPCLIP__REPLY__BODY_ERROR) {
        rc = cl_fail(c, cl_daemon_code(r->error->code), r->error->field, "%s", r->error->message);
        dpclip__reply__free_unpacked(r, NULL);
        return rc;
    }
    if (r->body_case != expect) {
        int got = (int)r->body_case;
        dpclip__reply__free_unpacked(r, NULL);
        return cl_die(c, "dpclipd sent reply type %d where %d was expected", got, (int)expect);
    }
    *out = r;
    return 0;
}
