/* The status endpoint: HTTP on a Unix socket (and optionally TCP on
 * 127.0.0.1), served by libmicrohttpd on its own threads so that it answers
 * while the loop and the workers are fully busy.
 *
 *   GET /metrics  Prometheus text exposition format 0.0.4
 *   GET /status   JSON
 *
 * The data belong to the loop thread. An HTTP thread asks the loop for a
 * fresh rendering (uv_async_send) and waits for it up to DC_STATUS_WAIT_MS;
 * a loop that never blocks renders within microseconds, and a loop that is
 * stuck still gets an answer: the last rendering, marked with its age in an
 * `X-Dpclip-Stale-Ms` header (systemd's watchdog restarts such a daemon).
 *
 * Ownership: dc_status owns its sockets (Unix socket file included, unless
 * systemd handed it over), the HTTP daemons and the last rendering. */
#ifndef DC_STATUS_H
#define DC_STATUS_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "dc_err.h"
#include "metrics.h"

#define DC_STATUS_WAIT_MS 40

/* Loop thread: fill both bodies. */
typedef void (*dc_status_render_fn)(void *arg, dc_sbuf *status_json, dc_sbuf *metrics_text);

typedef struct dc_status_opts {
    const char *unix_path;     /* "" or NULL: no Unix socket */
    unsigned unix_mode;
    int unix_gid;              /* chown the socket to this group; -1: leave */
    unsigned tcp_port;         /* 0: no TCP */
    bool asked;                /* configured explicitly (not a derived default) */
} dc_status_opts;

typedef struct dc_status {
    void *http[2];             /* struct MHD_Daemon *: Unix, TCP */
    int fds[2];
    char unix_path[108];
    bool unix_owned;           /* we created the file: unlink it at stop */
    uv_async_t async;
    bool running;
    dc_status_render_fn render;
    void *arg;

    pthread_mutex_t mu;        /* guards everything below */
    pthread_cond_t cv;
    uint64_t want, have;       /* renderings asked for / done */
    char *status_body, *metrics_body;
    size_t status_len, metrics_len;
    uint64_t rendered_ns;      /* uv_hrtime of the last rendering */
    bool closing;
    uint64_t served;           /* HTTP requests answered */
} dc_status;

/* Binds (or takes from systemd) the sockets and starts serving. With nothing
 * to serve (no path, no port) it does nothing and returns 0; without
 * libmicrohttpd at build time it logs that and returns 0. */
int dc_status_start(dc_status *st, uv_loop_t *loop, const dc_status_opts *o,
                    dc_status_render_fn render, void *arg, dc_err *err);
/* Stops the HTTP threads, removes the socket file, closes the async handle
 * (st must stay valid until the loop has run the close). Idempotent. */
void dc_status_stop(dc_status *st);

#endif
