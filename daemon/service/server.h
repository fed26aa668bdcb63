/* The daemon's listening socket, its sessions, its worker pools, the
 * privacy ledger and the status endpoint: one libuv loop owns all of it. The
 * loop thread never blocks: sockets are non-blocking and polled with
 * uv_poll_t, compute runs in worker pools, ledger writes (fsync) on libuv's
 * thread pool, and completions come back through uv_async_t / uv_work_t.
 *
 * Signals: SIGTERM/SIGINT stop gracefully (stop accepting and unlink the
 * socket unless systemd owns it; sessions with a step in flight finish it and
 * get their reply; then every session closes, the pools stop and the loop
 * runs out of handles, so uv_run returns). SIGHUP reloads the configuration
 * through the owner's reload callback and applies what may change at run
 * time.
 *
 * systemd: READY=1 once listening, STATUS= lines, WATCHDOG=1 keep-alives
 * from a loop timer (a stuck loop stops them and gets restarted), RELOADING /
 * STOPPING around reloads and shutdown. */
#ifndef DC_SERVER_H
#define DC_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "gpu.h"
#include "group.h"
#include "host.h"
#include "ledger.h"
#include "log.h"
#include "metrics.h"
#include "registry.h"
#include "status.h"
#include "validate.h"
#include "worker.h"

typedef struct dc_session dc_session;

/* Produces the configuration a reload should apply (main.c: defaults, the
 * file, the same flags again). */
typedef int (*dc_server_reload_fn)(void *arg, dc_config *out, dc_err *err);

typedef struct dc_server {
    uv_loop_t *loop;
    dc_config cfg;    /* effective; reloadable fields change on SIGHUP */
    dc_limits limits; /* from cfg, what validation reads */
    int workers;      /* CPU workers (cfg.workers resolved) */
    uint64_t spin_ns;
    dc_server_reload_fn reload;
    void *reload_arg;
    char socket_path[108];
    int listen_fd;
    bool listen_activated; /* systemd owns the socket file */
    uv_poll_t listen_poll;
    /* Out of file descriptors: accept rests on a timer (not a loop at full
     * CPU), and reserve_fd (/dev/null) is closed for a moment to accept and
     * tell the peer waiting. */
    uv_timer_t accept_timer;
    int reserve_fd;
    dc_log_limit fd_log, refuse_log;
    dc_registry_totals buf_totals; /* every session's buffers, against the daemon's caps */
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t stop_timer; /* forces sessions closed if they never drain */
    uv_timer_t tick;       /* watchdog keep-alive and STATUS= */
    /* Polling windows (dc_server_poll): while `spin` is active the loop
     * polls until spin_any_to, or while tasks are in flight until spin_busy_to.
     * One later window waits on spin_tfd, a timerfd precise to
     * microseconds (or, where none could be made, on spin_timer: libuv
     * timers have millisecond resolution). uv_hrtime ns. */
    uv_idle_t spin;
    uint64_t spin_any_to, spin_busy_to;
    uv_timer_t spin_timer;
    int spin_tfd; /* -1: none */
    uv_poll_t spin_tpoll;
    uint64_t pend_from, pend_any_to, pend_busy_to; /* pend_from 0: none */
    dc_worker_pool cpu_pool;
    bool pool_ready;
    dc_gpu gpu;                          /* zero GPUs without CUDA */
    uint64_t gpu_workspace[DC_MAX_GPUS]; /* the last step's view, for the advice on gpu.workspace
                                          * (/status reads the worker's: dc_worker_pool_held) */
    dc_session *sessions;                /* doubly linked, owned */
    size_t n_sessions;
    uint64_t next_session_id;
    uint64_t next_buffer_id;
    uint64_t noise_key;   /* from getrandom, or the fixed test seed */
    uint64_t noise_steps; /* steps drawn so far: the noise counter */
    dc_groups groups;     /* norm groups (group.c) */
    dc_ledger ledger;
    dc_status status;
    dc_metrics metrics;
    uint64_t start_ns;  /* uv_hrtime at start */
    int64_t start_time; /* wall clock at start (s since epoch) */
    bool stopping;
    bool closed;
    /* What the sessions see of all this (protocol/host.h): filled by
     * dc_server_init, its settings again on reload. */
    dc_host host;
} dc_server;

/* Opens the ledger, binds (or takes from systemd) and listens, starts the
 * worker pools, the status endpoint and the signal handlers, and tells
 * systemd it is ready. `reload` may be NULL (SIGHUP then only logs). */
int dc_server_init(dc_server *srv, uv_loop_t *loop, const dc_config *cfg,
                   dc_server_reload_fn reload, void *reload_arg, dc_err *err);
/* Begins the graceful stop described above; idempotent. */
void dc_server_shutdown(dc_server *srv);
/* After uv_run has returned: frees what outlives the loop's handles (the
 * ledger). */
void dc_server_free(dc_server *srv);
/* Applies a new configuration's run-time settings (SIGHUP); settings that
 * need a restart are reported in the log and left as they are. */
void dc_server_apply_config(dc_server *srv, const dc_config *cfg);

/* The loop polls instead of sleeping from from_ns to to_ns (uv_hrtime), so
 * that what is expected then (a step's completion, a trainer's next
 * request) is picked up without a thread wake-up: tens of microseconds on
 * an idle core, more in VMs. `idle` false: the window closes early once
 * nothing is in flight (it waits for completions); true: it stays open
 * (it waits for a request). Overlapping windows merge. No-op when
 * daemon.spin_us is 0. */
void dc_server_poll(dc_server *srv, uint64_t from_ns, uint64_t to_ns, bool idle);
/* The next spin_ns (daemon.spin_us): after submitting a task (idle false)
 * or replying (idle true: a trainer's next request often follows within
 * microseconds). */
void dc_server_spin(dc_server *srv, bool idle);
/* The windows' handles on loop (precise: with the timerfd, else the uv
 * timer alone), their close, and whether a later window is armed. */
void dc_server_windows_init(dc_server *srv, uv_loop_t *loop, bool precise);
void dc_server_windows_close(dc_server *srv);
bool dc_server_window_pending(const dc_server *srv);

/* What one user's (uid's) sessions hold, and all sessions (dc_uid_usage,
 * host.h): counted over the server's list of sessions. */
void dc_server_uid_usage(const dc_server *srv, uint32_t uid, dc_uid_usage *mine, dc_uid_usage *all);

#endif
