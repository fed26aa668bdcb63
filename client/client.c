/* libdpclip: handles. Connecting (the handshake), disconnecting, the
 * handle's information and errors, ping, norm groups. The library's layers,
 * each using only those before it: conn.c (a handle's state under its lock:
 * errors, the FIFO of requests in flight, completions), framing.c (frames
 * over the socket), calls.c (a request and its reply), step_build.c (step
 * objects), buffers.c, cuda.c, submit.c (running steps), then this file.
 *
 * Thread safety: each public function holds c->mu for its duration. No
 * global state; SIGPIPE is never raised (MSG_NOSIGNAL). */
#include <errno.h>
#include <fcntl.h>
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
    cl_fail_all_pending(c, "disconnected");
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
