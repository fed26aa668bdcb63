/* libdpclip: connection, handshake, buffers, and the request/reply engine
 * behind dpclip_run / dpclip_submit / dpclip_wait / dpclip_poll (those are
 * in submit.c).
 *
 * Model: one Unix stream socket per handle. Every request gets exactly one
 * reply (a ClipStep with an early notice gets the notice first) and replies
 * come in request order (docs/protocol.md), so requests in flight are a FIFO
 * (c->pend) and each reply completes the FIFO's head. A
 * blocking call sends its request and reads replies until its own arrives,
 * completing earlier submits on the way (tickets are stored for dpclip_wait,
 * callbacks are queued and run once the handle's lock is released).
 *
 * Thread safety: each public function holds c->mu for its duration. No
 * global state; SIGPIPE is never raised (MSG_NOSIGNAL). */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "dc_frame.h"
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
static void finish(dpclip_client *c, cl_done *d, int status, const char *field, const char *msg) {
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

static void fail_all_pending(dpclip_client *c, const char *msg) {
    while (c->p_len) {
        cl_pending *p = &c->pend[c->p_head];
        if (p->d) finish(c, p->d, DPCLIP_EIO, "", msg);
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
    fail_all_pending(c, c->errmsg);
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
        finish(c, p.d, cl_daemon_code(r->error->code), r->error->field, r->error->message);
    } else if (r->body_case == DPCLIP__REPLY__BODY_CLIP_STEP) {
        char msg[160] = "";
        rc = cl_to_result(r->clip_step, p.batch, p.n_layers, &p.d->res, msg, sizeof msg);
        finish(c, p.d, rc, "", msg);
    } else {
        finish(c, p.d, DPCLIP_EPROTO, "", "unexpected reply to a ClipStep");
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

/* --- connection ----------------------------------------------------------- */

DPCLIP_API const char *dpclip_default_socket(void) {
    const char *s = getenv("DPCLIP_SOCKET");
    return s && s[0] ? s : "/run/dpclip/dpclipd.sock";
}

/* A job id of the handle's own: handles that name none never share a
 * ledger account (whose steps would count as one job's), as the Python
 * package's fresh ids never do. Unique, not secret: from getrandom, or
 * where that fails the clock, pid and a counter. */
static void fresh_job_id(char *out, size_t n) {
    static atomic_uint_fast64_t counter;
    uint64_t v;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        v = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^
            ((uint64_t)getpid() << 40) ^ (atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15u);
    }
    snprintf(out, n, "anon-%016llx", (unsigned long long)v);
}

static int do_connect(dpclip_client *c, const char *path, const dpclip_connect_opts *o) {
    struct sockaddr_un addr;
    int timeout_ms = o && o->timeout_ms > 0 ? o->timeout_ms : 10000;
    int64_t deadline = cl_deadline(timeout_ms);
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Hello hello = DPCLIP__HELLO__INIT;
    Dpclip__Reply *r;
    const Dpclip__HelloReply *h;
    int fd, rc;

    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof addr.sun_path)
        return cl_fail(c, DPCLIP_EARG, "", "socket path '%s' is longer than %zu bytes", path,
                       sizeof addr.sun_path - 1);
    memcpy(addr.sun_path, path, strlen(path) + 1);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return cl_fail(c, DPCLIP_EIO, "", "socket: %s", strerror(errno));
    /* A blocking connect to a Unix socket waits (bounded by SO_SNDTIMEO)
     * while the daemon's accept backlog is full. */
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    while ((rc = connect(fd, (struct sockaddr *)&addr, sizeof addr)) != 0 && errno == EINTR) {
    }
    if (rc != 0) {
        rc = cl_fail(c, DPCLIP_EIO, "", "connect %s: %s", path, strerror(errno));
        close(fd);
        return rc;
    }
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) != 0) {
        rc = cl_fail(c, DPCLIP_EIO, "", "fcntl: %s", strerror(errno));
        close(fd);
        return rc;
    }
    c->fd = fd;

    hello.protocol_version = DC_PROTOCOL_VERSION;
    if (o && o->client_name) hello.client_name = (char *)o->client_name;
    if (o && o->job_id && o->job_id[0]) {
        snprintf(c->job_id, sizeof c->job_id, "%s", o->job_id);
        hello.job_id = (char *)o->job_id; /* whole: the daemon refuses one too long */
    } else {
        fresh_job_id(c->job_id, sizeof c->job_id);
        hello.job_id = c->job_id;
    }
    req.body_case = DPCLIP__REQUEST__BODY_HELLO;
    req.hello = &hello;
    if ((rc = cl_call(c, &req, -1, DPCLIP__REPLY__BODY_HELLO, deadline, &r))) return rc;
    h = r->hello;
    if (h->protocol_version != DC_PROTOCOL_VERSION) {
        unsigned v = h->protocol_version;
        dpclip__reply__free_unpacked(r, NULL);
        cl_die(c, "dpclipd speaks protocol %u, this library %u", v, DC_PROTOCOL_VERSION);
        return DPCLIP_EPROTO;
    }
    c->info.protocol_version = h->protocol_version;
    snprintf(c->info.daemon_version, sizeof c->info.daemon_version, "%s",
             h->daemon_version ? h->daemon_version : "");
    c->info.max_batch = h->max_batch;
    c->info.max_layers = h->max_layers;
    c->info.max_frame = h->max_frame;
    c->info.session_id = h->session_id;
    for (size_t i = 0; i < h->n_backends; i++)
        if (h->backends[i] && strcmp(h->backends[i], "cuda") == 0) c->info.has_cuda = 1;
    c->info.mps_active = h->mps_active;
    dpclip__reply__free_unpacked(r, NULL);
    return 0;
}

DPCLIP_API int dpclip_connect(const char *socket_path, const dpclip_connect_opts *opts,
                              dpclip_client **out) {
    dpclip_client *c;
    int rc;

    if (!out) return DPCLIP_EARG;
    *out = NULL;
    if (!(c = calloc(1, sizeof *c))) return DPCLIP_ENOMEM;
    {
        const char *sp = getenv("DPCLIP_SPIN");
        c->spin_enabled = !(sp && strcmp(sp, "0") == 0);
    }
    if (pthread_mutex_init(&c->mu, NULL) != 0) {
        free(c);
        return DPCLIP_ENOMEM;
    }
    c->fd = -1;
    *out = c;
    cl_lock(c);
    rc = do_connect(c, socket_path ? socket_path : dpclip_default_socket(), opts);
    /* Without a completed handshake the handle is of no use. */
    if (rc && c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
    cl_unlock(c);
    return rc;
}

static void free_done_list(cl_done *d) {
    while (d) {
        cl_done *next = d->next;
        dpclip_result_free(&d->res);
        free(d);
        d = next;
    }
}

/* Callbacks still pending are called with DPCLIP_EIO before this returns. */
DPCLIP_API void dpclip_disconnect(dpclip_client *c) {
    if (!c) return;
    cl_lock(c);
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    fail_all_pending(c, "disconnected");
    cl_unlock(c);

    free_done_list(c->done_head);
    for (size_t i = 0; i < c->m_len; i++) munmap(c->maps[i].addr, c->maps[i].size);
    free(c->maps);
    free(c->cuda_bufs);
    free(c->pend);
    free(c->sbuf);
    free(c->packed);
    free(c->rbuf);
    cl_step_scratch_free(c);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

DPCLIP_API const char *dpclip_job_id(const dpclip_client *c) { return c ? c->job_id : ""; }

DPCLIP_API const char *dpclip_errmsg(const dpclip_client *c) {
    return c ? c->errmsg : "no client handle (out of memory)";
}

DPCLIP_API const char *dpclip_errfield(const dpclip_client *c) { return c ? c->errfield : ""; }

DPCLIP_API const char *dpclip_strerror(int code) {
    switch (code) {
    case DPCLIP_OK: return "success";
    case DPCLIP_EINVAL: return "invalid argument in the request";
    case DPCLIP_ENOTFOUND: return "not found";
    case DPCLIP_EPERM: return "permission denied";
    case DPCLIP_EPRECOND: return "failed precondition";
    case DPCLIP_ENOSPACE: return "resource exhausted";
    case DPCLIP_ENONFINITE: return "non-finite value in an input";
    case DPCLIP_EPROTO: return "protocol error";
    case DPCLIP_EINTERNAL: return "internal error";
    case DPCLIP_EUNAVAIL: return "unavailable";
    case DPCLIP_EUNIMPL: return "not implemented";
    case DPCLIP_EIO: return "connection to dpclipd failed";
    case DPCLIP_ENOMEM: return "out of memory";
    case DPCLIP_EAGAIN: return "not finished yet";
    case DPCLIP_EARG: return "bad argument to a library call";
    default: return "unknown error code";
    }
}

DPCLIP_API int dpclip_daemon_info_get(dpclip_client *c, dpclip_daemon_info *info) {
    int rc = 0;
    if (!c || !info) return DPCLIP_EARG;
    cl_lock(c);
    if (c->info.protocol_version == 0) rc = cl_fail(c, DPCLIP_EIO, "", "not connected");
    else *info = c->info;
    cl_unlock(c);
    return rc;
}

DPCLIP_API int dpclip_insecure(const dpclip_client *c) {
    int v;
    if (!c) return 0;
    cl_lock((dpclip_client *)c);
    v = c->insecure;
    cl_unlock((dpclip_client *)c);
    return v;
}

DPCLIP_API int dpclip_fd(const dpclip_client *c) {
    int fd;
    if (!c) return -1;
    cl_lock((dpclip_client *)c);
    fd = c->fd;
    cl_unlock((dpclip_client *)c);
    return fd;
}

DPCLIP_API int dpclip_ping(dpclip_client *c) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Ping ping = DPCLIP__PING__INIT;
    Dpclip__Reply *r;
    int rc;

    if (!c) return DPCLIP_EARG;
    cl_lock(c);
    ping.nonce = c->next_req_id * 2654435761u + 1;
    req.body_case = DPCLIP__REQUEST__BODY_PING;
    req.ping = &ping;
    if ((rc = cl_call(c, &req, -1, DPCLIP__REPLY__BODY_PONG, -1, &r)) == 0) {
        if (r->pong->nonce != ping.nonce)
            rc = cl_die(c, "dpclipd answered a ping with the wrong nonce");
        dpclip__reply__free_unpacked(r, NULL);
    }
    cl_unlock(c);
    return rc;
}

/* --- norm groups ----------------------------------------------------------- */

static int join_group(dpclip_client *c, const dpclip_group_opts *o, dpclip_group_link *link,
                      uint64_t *group_id) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__JoinGroup jg = DPCLIP__JOIN_GROUP__INIT;
    Dpclip__Reply *r;
    int rc;

    if (!c || !o || !o->name) return DPCLIP_EARG;
    cl_lock(c);
    jg.name = (char *)o->name;
    jg.rank = o->rank;
    jg.size = o->size;
    jg.timeout_ms = o->timeout_ms;
    jg.clipping = o->group_wise ? DPCLIP__GROUP_CLIPPING__GROUP_WISE
                                : DPCLIP__GROUP_CLIPPING__NORM_REDUCE;
    if (link) {
        jg.daemons = link->daemons;
        jg.daemon_rank = link->daemon_rank;
        jg.local_size = link->local_size;
        if (link->nccl_version) { /* relayed from daemon 0 */
            jg.nccl_id.data = link->nccl_id;
            jg.nccl_id.len = DPCLIP_NCCL_ID_BYTES;
            jg.nccl_version = link->nccl_version;
        }
    }
    req.body_case = DPCLIP__REQUEST__BODY_JOIN_GROUP;
    req.join_group = &jg;
    if ((rc = cl_call(c, &req, -1, DPCLIP__REPLY__BODY_JOIN_GROUP, -1, &r)) == 0) {
        Dpclip__JoinGroupReply *jr = r->join_group;
        if (group_id) *group_id = jr->group_id;
        if (link && link->daemons > 1 && !o->group_wise) {
            if (jr->nccl_id.len != DPCLIP_NCCL_ID_BYTES || !jr->nccl_version)
                rc = cl_die(c, "dpclipd answered a cross-daemon join without an NCCL id");
            else if (!link->nccl_version) {
                memcpy(link->nccl_id, jr->nccl_id.data, DPCLIP_NCCL_ID_BYTES);
                link->nccl_version = jr->nccl_version;
            }
        }
        dpclip__reply__free_unpacked(r, NULL);
    }
    cl_unlock(c);
    return rc;
}

DPCLIP_API int dpclip_join_group(dpclip_client *c, const dpclip_group_opts *o, uint64_t *group_id) {
    return join_group(c, o, NULL, group_id);
}

DPCLIP_API int dpclip_join_group_linked(dpclip_client *c, const dpclip_group_opts *o,
                                        dpclip_group_link *link, uint64_t *group_id) {
    if (!link) return DPCLIP_EARG;
    return join_group(c, o, link, group_id);
}

/* --- buffers ------------------------------------------------------------- */

int cl_register_buffer(dpclip_client *c, Dpclip__RegisterBuffer *rb, int pass_fd, uint64_t *id) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Reply *r;
    int rc;

    req.body_case = DPCLIP__REQUEST__BODY_REGISTER_BUFFER;
    req.register_buffer = rb;
    if ((rc = cl_call(c, &req, pass_fd, DPCLIP__REPLY__BODY_REGISTER_BUFFER, -1, &r))) return rc;
    *id = r->register_buffer->buffer_id;
    dpclip__reply__free_unpacked(r, NULL);
    return 0;
}

static int register_fd(dpclip_client *c, int fd, size_t size, uint64_t *id) {
    Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
    rb.kind = DPCLIP__BUFFER_KIND__SHM_FD;
    rb.size = size;
    return cl_register_buffer(c, &rb, fd, id);
}

DPCLIP_API int dpclip_buffer_alloc(dpclip_client *c, size_t size, uint64_t *buffer_id,
                                   void **data) {
    void *addr = MAP_FAILED;
    uint64_t id = 0;
    int fd = -1, rc;

    if (!c || !buffer_id || !data) return DPCLIP_EARG;
    cl_lock(c);
    if (size == 0) {
        rc = cl_fail(c, DPCLIP_EARG, "", "buffer size 0");
        goto out;
    }
    if (c->m_len == c->m_cap) {
        size_t cap = c->m_cap ? c->m_cap * 2 : 8;
        cl_mapping *nm = realloc(c->maps, cap * sizeof *nm);
        if (!nm) {
            rc = cl_fail(c, DPCLIP_ENOMEM, "", "out of memory");
            goto out;
        }
        c->maps = nm;
        c->m_cap = cap;
    }
    /* Sealed against shrinking so that nobody can truncate the file under
     * the daemon's mapping (it would SIGBUS); against growing and further
     * sealing so that the size both sides agree on stays the size. */
    fd = memfd_create("dpclip", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        rc = cl_fail(c, DPCLIP_ENOMEM, "", "memfd_create: %s", strerror(errno));
        goto out;
    }
    if (ftruncate(fd, (off_t)size) != 0) {
        rc = cl_fail(c, DPCLIP_ENOMEM, "", "ftruncate(%zu): %s", size, strerror(errno));
        goto out;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        rc = cl_fail(c, DPCLIP_ENOMEM, "", "sealing the memfd: %s", strerror(errno));
        goto out;
    }
    addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) {
        rc = cl_fail(c, DPCLIP_ENOMEM, "", "mmap(%zu): %s", size, strerror(errno));
        goto out;
    }
    if ((rc = register_fd(c, fd, size, &id))) goto out;
    c->maps[c->m_len].id = id;
    c->maps[c->m_len].addr = addr;
    c->maps[c->m_len].size = size;
    c->m_len++;
    *buffer_id = id;
    *data = addr;
    addr = MAP_FAILED; /* now owned by c->maps */
out:
    if (addr != MAP_FAILED) munmap(addr, size);
    if (fd >= 0) close(fd); /* the daemon holds its own reference */
    cl_unlock(c);
    return rc;
}

DPCLIP_API int dpclip_buffer_register_fd(dpclip_client *c, int fd, size_t size,
                                         uint64_t *buffer_id) {
    int rc;
    if (!c || fd < 0 || !buffer_id) return DPCLIP_EARG;
    cl_lock(c);
    rc = register_fd(c, fd, size, buffer_id);
    cl_unlock(c);
    return rc;
}

int cl_release_buffer(dpclip_client *c, uint64_t buffer_id) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__ReleaseBuffer rb = DPCLIP__RELEASE_BUFFER__INIT;
    Dpclip__Reply *r;
    int rc;

    rb.buffer_id = buffer_id;
    req.body_case = DPCLIP__REQUEST__BODY_RELEASE_BUFFER;
    req.release_buffer = &rb;
    rc = cl_call(c, &req, -1, DPCLIP__REPLY__BODY_RELEASE_BUFFER, -1, &r);
    if (rc == 0) dpclip__reply__free_unpacked(r, NULL);
    /* Released, or the daemon is gone (which released it): unmap ours. */
    if (rc == 0 || rc == DPCLIP_EIO) {
        cl_cuda_forget(c, buffer_id);
        for (size_t i = 0; i < c->m_len; i++) {
            if (c->maps[i].id != buffer_id) continue;
            munmap(c->maps[i].addr, c->maps[i].size);
            c->maps[i] = c->maps[--c->m_len];
            break;
        }
    }
    return rc;
}

DPCLIP_API int dpclip_buffer_release(dpclip_client *c, uint64_t buffer_id) {
    int rc;
    if (!c) return DPCLIP_EARG;
    cl_lock(c);
    rc = cl_release_buffer(c, buffer_id);
    cl_unlock(c);
    return rc;
}
