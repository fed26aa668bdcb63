#include "status.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "dc_clock.h"
#include "listen.h"
#include "log.h"
#include "sdnotify.h"

#ifdef DPCLIP_HAVE_MHD
#include <microhttpd.h>

/* A snapshot shared by the requests that render from it. */
struct dc_status_snap {
    void *data;
    int refs; /* under dc_status.mu */
};

static void snap_unref(dc_status *st, dc_status_snap *sn) {
    bool last;
    if (!sn) return;
    pthread_mutex_lock(&st->mu);
    last = --sn->refs == 0;
    pthread_mutex_unlock(&st->mu);
    if (last) {
        st->provider->release(sn->data);
        free(sn);
    }
}

/* --- the loop side ---------------------------------------------------------- */

static void on_async(uv_async_t *h) {
    dc_status *st = h->data;
    dc_status_snap *sn, *old = NULL;
    uint64_t target;

    pthread_mutex_lock(&st->mu);
    target = st->want;
    pthread_mutex_unlock(&st->mu);
    if (target == st->have) return; /* have: written by this thread only */

    /* Copies only: the formatting happens on the HTTP threads. */
    if ((sn = calloc(1, sizeof *sn)) && !(sn->data = st->provider->snapshot(st->arg))) {
        free(sn);
        sn = NULL;
    }
    pthread_mutex_lock(&st->mu);
    if (sn) {
        sn->refs = 1;
        old = st->snap;
        st->snap = sn;
    }
    st->have = target;
    st->rendered_ns = uv_hrtime();
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    snap_unref(st, old);
}

/* --- the HTTP side (libmicrohttpd threads) ------------------------------------ */

/* The body for `metrics` (or /status) as `v` may see it, from a fresh
 * snapshot if the loop answers in time. *stale_ms: 0 if fresh, else the age
 * of what is served. */
static char *fetch(dc_status *st, const dc_status_viewer *v, bool metrics, size_t *len,
                   uint64_t *stale_ms) {
    dc_status_snap *sn = NULL;
    dc_sbuf b = {0};
    bool fresh = false;

    pthread_mutex_lock(&st->mu);
    if (!st->closing) {
        uint64_t my = ++st->want;
        uint64_t deadline = dc_clock_ns() + (uint64_t)DC_STATUS_WAIT_MS * 1000000u;
        struct timespec ts = {(time_t)(deadline / 1000000000u), (long)(deadline % 1000000000u)};
        uv_async_send(&st->async);
        while (st->have < my && !st->closing)
            if (pthread_cond_timedwait(&st->cv, &st->mu, &ts) == ETIMEDOUT) break;
        fresh = st->have >= my;
    }
    if ((sn = st->snap)) sn->refs++;
    *stale_ms = fresh ? 0 : st->rendered_ns ? (dc_clock_ns() - st->rendered_ns) / 1000000u : 0;
    st->served++;
    pthread_mutex_unlock(&st->mu);
    if (!sn) return NULL;
    st->provider->render(sn->data, v, metrics, &b);
    snap_unref(st, sn);
    if (b.oom) {
        dc_sbuf_free(&b);
        return NULL;
    }
    *len = b.len;
    return b.p;
}

/* Who is on the other end: SO_PEERCRED on the Unix socket; nobody known on
 * TCP (127.0.0.1 says nothing about the user). */
static void viewer_of(struct MHD_Connection *c, dc_status_viewer *v) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c,
                                                                 MHD_CONNECTION_INFO_CONNECTION_FD);
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    struct ucred cred;
    socklen_t cl = sizeof cred;
    memset(v, 0, sizeof *v);
    if (!ci || getsockname(ci->connect_fd, (struct sockaddr *)&sa, &sl) != 0 ||
        sa.ss_family != AF_UNIX ||
        getsockopt(ci->connect_fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0)
        return;
    v->known = true;
    v->uid = (uint32_t)cred.uid;
    v->gid = (uint32_t)cred.gid;
#ifdef SO_PEERGROUPS
    {
        gid_t groups[DC_STATUS_MAX_GROUPS];
        socklen_t gl = sizeof groups;
        if (getsockopt(ci->connect_fd, SOL_SOCKET, SO_PEERGROUPS, groups, &gl) == 0)
            for (size_t i = 0; i < gl / sizeof groups[0]; i++)
                v->groups[v->n_groups++] = (uint32_t)groups[i];
    }
#endif
}

static enum MHD_Result respond(struct MHD_Connection *c, unsigned code, const char *type,
                               char *body, size_t len, uint64_t stale_ms) {
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, body, body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    enum MHD_Result ret;
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    if (stale_ms) {
        char v[32];
        snprintf(v, sizeof v, "%llu", (unsigned long long)stale_ms);
        MHD_add_response_header(r, "X-Dpclip-Stale-Ms", v);
    }
    ret = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result text(struct MHD_Connection *c, unsigned code, const char *msg) {
    char *b = strdup(msg);
    return respond(c, code, "text/plain; charset=utf-8", b, b ? strlen(b) : 0, 0);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **ctx) {
    dc_status *st = cls;
    static int first_call;
    dc_status_viewer viewer;
    bool metrics;
    char *body;
    size_t len = 0;
    uint64_t stale;
    (void)version;
    (void)upload_data;

    if (*ctx == NULL) { /* headers only so far; answer on the next call */
        *ctx = &first_call;
        return MHD_YES;
    }
    if (*upload_size) {
        *upload_size = 0; /* ignore request bodies */
        return MHD_YES;
    }
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET is served here\n");
    if (strcmp(url, "/metrics") == 0) metrics = true;
    else if (strcmp(url, "/status") == 0) metrics = false;
    else if (strcmp(url, "/") == 0)
        return text(c, MHD_HTTP_OK,
                    "dpclipd status: GET /status (JSON), GET /metrics "
                    "(Prometheus)\n");
    else return text(c, MHD_HTTP_NOT_FOUND, "not found: GET /status or /metrics\n");

    viewer_of(c, &viewer);
    body = fetch(st, &viewer, metrics, &len, &stale);
    if (!body) return text(c, MHD_HTTP_SERVICE_UNAVAILABLE, "no status rendered yet\n");
    return respond(c, MHD_HTTP_OK,
                   metrics ? "text/plain; version=0.0.4; charset=utf-8" : "application/json", body,
                   len, stale);
}

/* libmicrohttpd's own messages (a client that hung up mid-request, say):
 * what clients do is no error of the daemon's, so at debug level. */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
    char msg[256];
    (void)cls;
    vsnprintf(msg, sizeof msg, fmt, ap);
    msg[strcspn(msg, "\n")] = '\0';
    dc_log_debug("status: %s", msg);
}

static void *start_http(dc_status *st, int fd, const dc_status_opts *o) {
    /* epoll, not select: the daemon may hold more than FD_SETSIZE sockets.
     * Slow clients hold a connection for timeout_s of silence at most, and
     * max_connections of them at once. */
    return MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_USE_ERROR_LOG, 0,
                            NULL, NULL, on_request, st, MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd,
                            MHD_OPTION_THREAD_POOL_SIZE, 2u, MHD_OPTION_CONNECTION_LIMIT,
                            o->max_connections ? o->max_connections : DC_STATUS_MAX_CONNECTIONS,
                            MHD_OPTION_CONNECTION_TIMEOUT,
                            o->timeout_s ? o->timeout_s : DC_STATUS_TIMEOUT_S,
                            MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL, MHD_OPTION_END);
}

int dc_status_start(dc_status *st, uv_loop_t *loop, const dc_status_opts *o,
                    const dc_status_provider *provider, void *arg, dc_err *err) {
    pthread_condattr_t ca;
    bool want_unix = o->unix_path && o->unix_path[0];

    memset(st, 0, sizeof *st);
    st->fds[0] = st->fds[1] = -1;
    if (!want_unix && !o->tcp_port) return 0;
    st->provider = provider;
    st->arg = arg;

    if (want_unix) {
        snprintf(st->unix_path, sizeof st->unix_path, "%s", o->unix_path);
        if ((st->fds[0] = dc_sd_take_unix(o->unix_path)) < 0) {
            if ((st->fds[0] = dc_listen_unix(o->unix_path, o->unix_mode, o->unix_gid, err)) < 0)
                return err ? (int)err->code : DC_EUNAVAIL;
            st->unix_owned = true;
        }
    }
    if (o->tcp_port) {
        if ((st->fds[1] = dc_sd_take_tcp(o->tcp_port)) < 0 &&
            (st->fds[1] = dc_listen_tcp_local(o->tcp_port, err)) < 0)
            goto fail;
    }
    pthread_mutex_init(&st->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&st->cv, &ca);
    pthread_condattr_destroy(&ca);
    uv_async_init(loop, &st->async, on_async);
    st->async.data = st;
    st->running = true;
    for (int i = 0; i < 2; i++) {
        if (st->fds[i] < 0) continue;
        if (!(st->http[i] = start_http(st, st->fds[i], o))) {
            dc_err_set(err, DC_EINTERNAL, "status", "libmicrohttpd could not serve %s",
                       i ? "the TCP status port" : st->unix_path);
            dc_status_stop(st);
            return DC_EINTERNAL;
        }
    }
    dc_log_info("status: http on %s%s%s", want_unix ? st->unix_path : "",
                want_unix && o->tcp_port ? " and " : "", o->tcp_port ? "127.0.0.1" : "");
    return 0;
fail:
    if (st->fds[0] >= 0) close(st->fds[0]);
    if (st->unix_owned) unlink(st->unix_path);
    st->fds[0] = -1;
    return err ? (int)err->code : DC_EUNAVAIL;
}

void dc_status_stop(dc_status *st) {
    if (!st->running) return;
    st->running = false;
    pthread_mutex_lock(&st->mu);
    st->closing = true; /* no uv_async_send from now on */
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    for (int i = 0; i < 2; i++) {
        /* MHD_stop_daemon joins its threads and closes the listening socket
         * it was given; a socket it never got is ours to close. */
        if (st->http[i]) MHD_stop_daemon(st->http[i]);
        else if (st->fds[i] >= 0) close(st->fds[i]);
        st->http[i] = NULL;
        st->fds[i] = -1;
    }
    if (st->unix_owned) unlink(st->unix_path);
    uv_close((uv_handle_t *)&st->async, NULL);
    snap_unref(st, st->snap); /* no HTTP thread holds one any more */
    st->snap = NULL;
    /* mu and cv are destroyed with the status by its owner's memory: no
     * thread can touch them once the HTTP daemons are stopped. */
    pthread_cond_destroy(&st->cv);
    pthread_mutex_destroy(&st->mu);
}

#else /* !DPCLIP_HAVE_MHD */

int dc_status_start(dc_status *st, uv_loop_t *loop, const dc_status_opts *o,
                    const dc_status_provider *provider, void *arg, dc_err *err) {
    (void)loop;
    (void)provider;
    (void)arg;
    (void)err;
    memset(st, 0, sizeof *st);
    st->fds[0] = st->fds[1] = -1;
    if (o->asked)
        dc_log_warn("status: this dpclipd was built without libmicrohttpd; no status socket");
    else if ((o->unix_path && o->unix_path[0]) || o->tcp_port)
        dc_log_info("status: built without libmicrohttpd; no status socket");
    return 0;
}

void dc_status_stop(dc_status *st) { (void)st; }
#endif
