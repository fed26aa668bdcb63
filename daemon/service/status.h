/* The status endpoint: HTTP on a Unix socket (and optionally TCP on
 * 127.0.0.1), served by libmicrohttpd on its own threads so that it answers
 * while the loop and the workers are fully busy.
 *
 *   GET /metrics  Prometheus text exposition format 0.0.4
 *   GET /status   JSON
 *
 * The data belong to the loop thread. An HTTP thread asks the loop for a
 * fresh snapshot (uv_async_send) and waits for it up to DC_STATUS_WAIT_MS;
 * the loop only copies its state (no formatting: microseconds), and the HTTP
 * thread renders the body from the snapshot for its caller. A loop that is
 * stuck still gets an answer: from the last snapshot, marked with its age in
 * an `X-Dpclip-Stale-Ms` header (systemd's watchdog restarts such a daemon).
 * Requests at the same time share one snapshot.
 *
 * Callers: on the Unix socket the caller's uid and groups come from
 * SO_PEERCRED / SO_PEERGROUPS, and the renderer decides what that caller
 * may see; a TCP caller is anonymous. A connection idle for timeout_s is
 * closed, and at most max_connections are open at once.
 *
 * Ownership: dc_status owns its sockets (Unix socket file included, unless
 * systemd handed it over), the HTTP daemons and the last snapshot. */
#ifndef DC_STATUS_H
#define DC_STATUS_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "dc_err.h"
#include "metrics.h"

#define DC_STATUS_WAIT_MS 40

#define DC_STATUS_MAX_GROUPS 64

/* Who asks. */
typedef struct dc_status_viewer {
    bool known; /* Unix socket: from SO_PEERCRED; TCP: false */
    uint32_t uid, gid;
    uint32_t groups[DC_STATUS_MAX_GROUPS]; /* supplementary (SO_PEERGROUPS) */
    size_t n_groups;
} dc_status_viewer;

/* What is served: snapshot() runs on the loop thread and returns an owned
 * copy of the state (NULL when out of memory); render() and release() run
 * on HTTP threads, render() once per request (metrics: /metrics, else
 * /status), release() when no request uses the snapshot any more. */
typedef struct dc_status_provider {
    void *(*snapshot)(void *arg);
    void (*render)(const void *snap, const dc_status_viewer *v, bool metrics, dc_sbuf *out);
    void (*release)(void *snap);
} dc_status_provider;

typedef struct dc_status_opts {
    const char *unix_path; /* "" or NULL: no Unix socket */
    unsigned unix_mode;
    int unix_gid;             /* chown the socket to this group; -1: leave */
    unsigned tcp_port;        /* 0: no TCP */
    bool asked;               /* configured explicitly (not a derived default) */
    unsigned max_connections; /* status.max_connections; 0 = the default */
    unsigned timeout_s;       /* status.timeout_s; 0 = the default */
} dc_status_opts;

#define DC_STATUS_MAX_CONNECTIONS 256
#define DC_STATUS_TIMEOUT_S 5

typedef struct dc_status_snap dc_status_snap;

typedef struct dc_status {
    void *http[2]; /* struct MHD_Daemon *: Unix, TCP */
    int fds[2];
    char unix_path[108];
    bool unix_owned; /* we created the file: unlink it at stop */
    uv_async_t async;
    bool running;
    const dc_status_provider *provider;
    void *arg;

    pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv;
    uint64_t want, have;  /* snapshots asked for / taken */
    dc_status_snap *snap; /* the last one (reference counted) */
    uint64_t rendered_ns; /* uv_hrtime of the last snapshot */
    bool closing;
    uint64_t served; /* HTTP requests answered */
} dc_status;

/* Binds (or takes from systemd) the sockets and starts serving. With nothing
 * to serve (no path, no port) it does nothing and returns 0; without
 * libmicrohttpd at build time it logs that and returns 0. */
int dc_status_start(dc_status *st, uv_loop_t *loop, const dc_status_opts *o,
                    const dc_status_provider *provider, void *arg, dc_err *err);
/* Stops the HTTP threads, removes the socket file, closes the async handle
 * (st must stay valid until the loop has run the close). Idempotent. */
void dc_status_stop(dc_status *st);

#endif
