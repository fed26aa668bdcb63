/* The daemon's listening socket, its sessions and its worker pools: one
 * libuv loop owns all of it. The loop thread never blocks: sockets are
 * non-blocking and polled with uv_poll_t, compute runs in worker pools, and
 * completions come back through uv_async_t.
 *
 * Shutdown (SIGTERM/SIGINT or dc_server_shutdown): stop accepting and unlink
 * the socket; sessions with a step in flight finish it and get their reply;
 * then every session closes, the pools stop and the loop runs out of handles,
 * so uv_run returns. */
#ifndef DC_SERVER_H
#define DC_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "gpu.h"
#include "validate.h"
#include "worker.h"

typedef struct dc_session dc_session;

typedef struct dc_server_config {
    const char *socket_path;
    unsigned socket_mode;        /* e.g. 0660 */
    int workers;                 /* CPU worker threads (>= 1) */
    dc_limits limits;
    uint32_t max_buffers;        /* per session */
    int ready_fd;                /* write "READY\n" here once listening; -1: none */
    bool use_gpu;                /* serve CUDA buffers on the GPUs found */
    uint64_t spin_ns;            /* idle workers and the loop poll this long */
    bool fixed_seed;             /* test-only: deterministic noise */
    uint64_t seed;
} dc_server_config;

typedef struct dc_server_stats {
    uint64_t sessions_total;
    uint64_t steps_ok;
    uint64_t steps_failed;
    uint64_t requests_rejected;  /* error replies other than failed steps */
    uint64_t samples_total;
    uint64_t compute_ns_total;
} dc_server_stats;

typedef struct dc_server {
    uv_loop_t *loop;
    dc_server_config cfg;
    char socket_path[108];
    int listen_fd;
    uv_poll_t listen_poll;
    uv_signal_t sig_term, sig_int;
    uv_timer_t stop_timer;        /* forces sessions closed if they never drain */
    uv_idle_t spin;               /* keeps the loop polling while steps are short */
    uint64_t spin_until;          /* uv_hrtime() deadline of that polling */
    uv_timer_t spin_timer;        /* starts polling shortly before a long step ends */
    uint64_t spin_at;             /* when spin_timer fires (uv_hrtime), 0 = idle */
    dc_worker_pool cpu_pool;
    bool pool_ready;
    dc_gpu gpu;                   /* zero GPUs without CUDA */
    dc_session *sessions;         /* doubly linked, owned */
    size_t n_sessions;
    uint64_t next_session_id;
    uint64_t next_buffer_id;
    uint64_t noise_key;           /* from getrandom, or the fixed test seed */
    uint64_t noise_steps;         /* steps drawn so far: the noise counter */
    bool stopping;
    bool closed;
    dc_server_stats stats;
} dc_server;

/* Binds and listens (refusing to steal a live daemon's socket), starts the
 * worker pools and the signal handlers. */
int dc_server_init(dc_server *srv, uv_loop_t *loop, const dc_server_config *cfg, dc_err *err);
/* Begins the graceful stop described above; idempotent. */
void dc_server_shutdown(dc_server *srv);

/* Called by session.c after submitting a job: for the next spin_ns the loop
 * polls instead of sleeping, so a short step's completion is picked up
 * without a thread wake-up (tens of microseconds on an idle core). */
void dc_server_spin(dc_server *srv);
/* For a GPU step expected to take expect_ns (the session's previous steps):
 * the loop polls from shortly before until shortly after that, so the
 * completion and the reply go out without waking the loop. */
void dc_server_spin_expect(dc_server *srv, uint64_t expect_ns);

/* Called by session.c when a session has fully closed. */
void dc_server_session_gone(dc_server *srv, dc_session *s);

#endif
