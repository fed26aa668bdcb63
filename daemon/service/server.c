#include "server.h"

#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "listen.h"
#include "log.h"
#include "report.h"
#include "sdnotify.h"
#include "session.h"
#include "step_logical.h"

static int cpu_factory(void *arg, int index, dc_backend **out, dc_err *err) {
    (void)arg;
    (void)index;
    return dc_cpu_backend_create(1, out, err);
}

/* --- accepting ------------------------------------------------------------------ */

/* Descriptors kept free for what must not fail while clients hold all the
 * others: the ledger's writes (a temp file and its directory), the status
 * socket's connections, the buffers passed with requests. A connection
 * that would take one of them is refused. */
#define DC_SERVER_FD_RESERVE 64
/* How long accepting rests once out of descriptors: accept would fail again
 * at once (a loop at full CPU), and only sessions closing free them. */
#define DC_SERVER_ACCEPT_PAUSE_MS 250
/* At most one line per this for a condition that recurs per connection. */
#define DC_SERVER_LOG_PERIOD_NS (10ull * 1000000000u)

void dc_server_uid_usage(const dc_server *srv, uint32_t uid, dc_uid_usage *mine,
                         dc_uid_usage *all) {
    memset(mine, 0, sizeof *mine);
    if (all) memset(all, 0, sizeof *all);
    for (const dc_session *s = srv->sessions; s; s = s->next) {
        dc_uid_usage *u[2] = {(uint32_t)s->peer_uid == uid ? mine : NULL, all};
        for (int k = 0; k < 2; k++) {
            if (!u[k]) continue;
            u[k]->connections++;
            u[k]->buffers += s->reg.n;
            u[k]->shm_bytes += s->reg.shm_bytes;
            u[k]->pass_bytes += s->pass_bytes;
            u[k]->acc_bytes += dc_logical_bytes(s);
        }
    }
}

/* A connection of a user who holds limits.max_connections_per_uid already
 * is answered and closed (true). */
static bool uid_refused(dc_server *srv, int fd) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    dc_uid_usage u;
    uint64_t skipped;
    dc_err e;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
    dc_server_uid_usage(srv, (uint32_t)cred.uid, &u, NULL);
    if (u.connections < srv->cfg.max_connections_per_uid) return false;
    dc_err_set(&e, DC_ENOSPACE, "limits.max_connections_per_uid",
               "uid %u has %u connections open, its limit (limits.max_connections_per_uid): "
               "close some, or ask the operator to raise it",
               (unsigned)cred.uid, u.connections);
    dc_session_refuse(fd, &e);
    srv->metrics.sessions_refused++;
    if (dc_log_limit_pass(&srv->refuse_log, uv_hrtime(), DC_SERVER_LOG_PERIOD_NS, &skipped))
        dc_log_warn("refusing a connection of uid %u: %u open, limits.max_connections_per_uid "
                    "(%llu more refused since the last such line)",
                    (unsigned)cred.uid, u.connections, (unsigned long long)skipped);
    return true;
}

static void on_accept(uv_poll_t *h, int status, int events);

static void on_accept_resume(uv_timer_t *t) {
    dc_server *srv = t->data;
    if (srv->stopping || srv->listen_fd < 0) return;
    uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);
}

static uint64_t fd_limit(void) {
    struct rlimit rl;
    return getrlimit(RLIMIT_NOFILE, &rl) == 0 ? (uint64_t)rl.rlim_cur : 1024;
}

/* Out of descriptors: accept failed with errnum (EMFILE, ENFILE), or fd
 * (>= 0) was accepted into the reserve. The peer waiting is told, and
 * accepting rests. */
static void accept_exhausted(dc_server *srv, int errnum, int fd) {
    uint64_t skipped;
    dc_err e;

    if (fd < 0 && srv->reserve_fd >= 0) {
        close(srv->reserve_fd);
        srv->reserve_fd = -1;
        fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    }
    dc_err_set(&e, DC_ENOSPACE, "limits.max_connections",
               "the daemon is out of file descriptors (RLIMIT_NOFILE %llu): try again later; "
               "its operator may raise LimitNOFILE or lower limits.max_connections",
               (unsigned long long)fd_limit());
    if (fd >= 0) {
        dc_session_refuse(fd, &e);
        srv->metrics.sessions_refused++;
    }
    if (srv->reserve_fd < 0) srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    uv_poll_stop(&srv->listen_poll);
    uv_timer_start(&srv->accept_timer, on_accept_resume, DC_SERVER_ACCEPT_PAUSE_MS, 0);
    if (dc_log_limit_pass(&srv->fd_log, uv_hrtime(), DC_SERVER_LOG_PERIOD_NS, &skipped))
        dc_log_warn("accept: out of file descriptors (%s; RLIMIT_NOFILE %llu, the last %d kept "
                    "for the ledger and status) with %zu sessions: refusing connections, "
                    "accepting again every %d ms (%llu more times since the last such line)",
                    errnum ? strerror(errnum) : "a connection took one of the reserve",
                    (unsigned long long)fd_limit(), DC_SERVER_FD_RESERVE, srv->n_sessions,
                    DC_SERVER_ACCEPT_PAUSE_MS, (unsigned long long)skipped);
}

static void on_accept(uv_poll_t *h, int status, int events) {
    dc_server *srv = h->data;
    uint64_t skipped;
    dc_err e;
    (void)events;
    if (status < 0 || srv->stopping) return;
    for (int i = 0; i < 64; i++) {
        int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        dc_session *s;
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno == EMFILE || errno == ENFILE) accept_exhausted(srv, errno, -1);
            else if (errno != EAGAIN && errno != EWOULDBLOCK &&
                     dc_log_limit_pass(&srv->fd_log, uv_hrtime(), DC_SERVER_LOG_PERIOD_NS,
                                       &skipped))
                dc_log_warn("accept: %s", strerror(errno));
            return;
        }
        /* Descriptors are handed out lowest first: past this one, fewer
         * than the reserve are left. */
        if ((uint64_t)fd + DC_SERVER_FD_RESERVE >= fd_limit()) {
            accept_exhausted(srv, 0, fd);
            return;
        }
        if (srv->n_sessions >= srv->cfg.max_connections) {
            dc_err_set(&e, DC_ENOSPACE, "limits.max_connections",
                       "the daemon serves %zu connections, its limit (limits.max_connections): "
                       "try again later",
                       srv->n_sessions);
            dc_session_refuse(fd, &e);
            srv->metrics.sessions_refused++;
            if (dc_log_limit_pass(&srv->refuse_log, uv_hrtime(), DC_SERVER_LOG_PERIOD_NS, &skipped))
                dc_log_warn("refusing a connection: %zu open, limits.max_connections (%llu more "
                            "refused since the last such line)",
                            srv->n_sessions, (unsigned long long)skipped);
            continue;
        }
        if (uid_refused(srv, fd)) continue;
        if (dc_session_start(&srv->host, fd, &s) != 0) {
            dc_log_error("cannot start a session (out of memory?)");
            continue;
        }
        s->next = srv->sessions;
        if (srv->sessions) srv->sessions->prev = s;
        srv->sessions = s;
        srv->n_sessions++;
        srv->metrics.sessions_total++;
        dc_log_debug("session %llu: connected (pid %d uid %u)", (unsigned long long)s->id,
                     (int)s->peer_pid, (unsigned)s->peer_uid);
    }
}

/* --- polling windows ---------------------------------------------------------- */

static void on_spin(uv_idle_t *h);

static void tfd_set(dc_server *srv, uint64_t at_ns) {
    struct itimerspec it;
    memset(&it, 0, sizeof it);
    it.it_value.tv_sec = (time_t)(at_ns / 1000000000u);
    it.it_value.tv_nsec = (long)(at_ns % 1000000000u);
    (void)timerfd_settime(srv->spin_tfd, TFD_TIMER_ABSTIME, &it, NULL); /* 0: disarmed */
}

static void poll_activate(dc_server *srv) {
    if (srv->pend_any_to > srv->spin_any_to) srv->spin_any_to = srv->pend_any_to;
    if (srv->pend_busy_to > srv->spin_busy_to) srv->spin_busy_to = srv->pend_busy_to;
    srv->pend_from = srv->pend_any_to = srv->pend_busy_to = 0;
    if (srv->spin_tfd >= 0) tfd_set(srv, 0);
    else uv_timer_stop(&srv->spin_timer);
    if (!srv->stopping) uv_idle_start(&srv->spin, on_spin);
}

static void on_spin_timer(uv_timer_t *t) { poll_activate(t->data); }

static void on_spin_tfd(uv_poll_t *h, int status, int events) {
    dc_server *srv = h->data;
    uint64_t n;
    (void)status;
    (void)events;
    if (read(srv->spin_tfd, &n, sizeof n) == (ssize_t)sizeof n) poll_activate(srv);
}

/* uv_hrtime is CLOCK_MONOTONIC: the timerfd fires at pend_from itself. */
static void arm_pending(dc_server *srv, uint64_t now) {
    if (srv->spin_tfd >= 0) {
        tfd_set(srv, srv->pend_from > now ? srv->pend_from : now + 1);
        return;
    }
    uint64_t ms = srv->pend_from > now ? (srv->pend_from - now) / 1000000u : 0;
    uv_timer_start(&srv->spin_timer, on_spin_timer, ms, 0);
}

static void on_spin(uv_idle_t *h) {
    dc_server *srv = h->data;
    uint64_t now = uv_hrtime();
    if (srv->pend_from && srv->pend_from <= now) poll_activate(srv);
    if (now < srv->spin_any_to) return;
    if (now < srv->spin_busy_to && dc_worker_pool_busy(&srv->cpu_pool) + dc_gpu_busy(&srv->gpu))
        return;
    uv_idle_stop(h);
    srv->spin_any_to = srv->spin_busy_to = 0;
    if (srv->pend_from) arm_pending(srv, now);
}

void dc_server_poll(dc_server *srv, uint64_t from_ns, uint64_t to_ns, bool idle) {
    uint64_t now = uv_hrtime();
    if (!srv->spin_ns || srv->stopping || to_ns <= now) return;
    if (from_ns <= now) {
        uint64_t *end = idle ? &srv->spin_any_to : &srv->spin_busy_to;
        if (to_ns > *end) *end = to_ns;
        uv_idle_start(&srv->spin, on_spin);
        return;
    }
    if (!srv->pend_from || from_ns < srv->pend_from) srv->pend_from = from_ns;
    uint64_t *end = idle ? &srv->pend_any_to : &srv->pend_busy_to;
    if (to_ns > *end) *end = to_ns;
    /* While polling, on_spin opens the pending window when it is due. */
    if (!uv_is_active((uv_handle_t *)&srv->spin)) arm_pending(srv, now);
}

void dc_server_windows_init(dc_server *srv, uv_loop_t *loop, bool precise) {
    uv_idle_init(loop, &srv->spin);
    srv->spin.data = srv;
    uv_timer_init(loop, &srv->spin_timer);
    srv->spin_timer.data = srv;
    srv->spin_tfd = precise ? timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC) : -1;
    if (srv->spin_tfd >= 0 && uv_poll_init(loop, &srv->spin_tpoll, srv->spin_tfd) != 0) {
        close(srv->spin_tfd);
        srv->spin_tfd = -1;
    }
    if (srv->spin_tfd >= 0) {
        srv->spin_tpoll.data = srv;
        uv_poll_start(&srv->spin_tpoll, UV_READABLE, on_spin_tfd);
    }
}

static void on_tpoll_closed(uv_handle_t *h) {
    dc_server *srv = h->data;
    close(srv->spin_tfd);
    srv->spin_tfd = -1;
}

void dc_server_windows_close(dc_server *srv) {
    uv_close((uv_handle_t *)&srv->spin, NULL);
    uv_close((uv_handle_t *)&srv->spin_timer, NULL);
    if (srv->spin_tfd >= 0) uv_close((uv_handle_t *)&srv->spin_tpoll, on_tpoll_closed);
}

bool dc_server_window_pending(const dc_server *srv) {
    if (srv->spin_tfd < 0) return uv_is_active((const uv_handle_t *)&srv->spin_timer);
    struct itimerspec it;
    return timerfd_gettime(srv->spin_tfd, &it) == 0 &&
           (it.it_value.tv_sec != 0 || it.it_value.tv_nsec != 0);
}

void dc_server_spin(dc_server *srv, bool idle) {
    uint64_t now = uv_hrtime();
    dc_server_poll(srv, now, now + srv->spin_ns, idle);
}

/* --- lifecycle ------------------------------------------------------------------ */

static void post_status(dc_server *srv) {
    dc_sd_status("%zu sessions, %llu steps (%llu failed), %zu jobs in the ledger%s",
                 srv->n_sessions, (unsigned long long)srv->metrics.steps_ok,
                 (unsigned long long)srv->metrics.steps_failed, srv->ledger.n_accounts,
                 srv->stopping ? ", stopping" : "");
}

static void on_tick(uv_timer_t *t) {
    dc_server *srv = t->data;
    const uint64_t now = uv_hrtime();
    /* From the loop itself: if the loop stops turning, the keep-alives stop
     * and systemd restarts the daemon. */
    dc_sd_watchdog();
    post_status(srv);
    /* logical steps left open past limits.logical_step_timeout; requests
     * stalled behind a step */
    for (dc_session *s = srv->sessions; s; s = s->next) {
        dc_logical_expire(s, now);
        dc_session_check_stall(s, now);
    }
}

static void maybe_finish(dc_server *srv) {
    if (!srv->stopping || srv->n_sessions || srv->closed) return;
    srv->closed = true;
    uv_timer_stop(&srv->stop_timer);
    uv_close((uv_handle_t *)&srv->stop_timer, NULL);
    uv_close((uv_handle_t *)&srv->accept_timer, NULL);
    if (srv->reserve_fd >= 0) close(srv->reserve_fd);
    srv->reserve_fd = -1;
    dc_server_windows_close(srv);
    uv_close((uv_handle_t *)&srv->tick, NULL);
    uv_close((uv_handle_t *)&srv->sig_term, NULL);
    uv_close((uv_handle_t *)&srv->sig_int, NULL);
    uv_close((uv_handle_t *)&srv->sig_hup, NULL);
    /* Closing the watchers restores the default dispositions: a second
     * SIGTERM (systemd, a test, an impatient operator) would then kill a
     * daemon that is already stopping cleanly. We are on our way out. */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    dc_groups_close(&srv->groups);
    dc_status_stop(&srv->status);
    if (srv->pool_ready) dc_worker_pool_close(&srv->cpu_pool);
    srv->pool_ready = false;
    dc_gpu_close(&srv->gpu);
    dc_log_info("stopped: %llu sessions, %llu steps served, %llu failed",
                (unsigned long long)srv->metrics.sessions_total,
                (unsigned long long)srv->metrics.steps_ok,
                (unsigned long long)srv->metrics.steps_failed);
}

/* A session has fully closed (the host's session_gone). */
static void session_gone(dc_server *srv, dc_session *s) {
    if (s->prev) s->prev->next = s->next;
    else srv->sessions = s->next;
    if (s->next) s->next->prev = s->prev;
    srv->n_sessions--;
    maybe_finish(srv);
}

/* --- the sessions' host (protocol/host.h) ----------------------------------- */

/* The protocol layer calls the server only through these: it sits below
 * the server and cannot name it. */
static void host_uid_usage(void *ctx, uint32_t uid, dc_uid_usage *mine, dc_uid_usage *all) {
    dc_server_uid_usage(ctx, uid, mine, all);
}
static void host_session_gone(void *ctx, dc_session *s) { session_gone(ctx, s); }
static void host_poll(void *ctx, uint64_t from_ns, uint64_t to_ns, bool idle) {
    dc_server_poll(ctx, from_ns, to_ns, idle);
}
static void host_spin(void *ctx, bool idle) { dc_server_spin(ctx, idle); }
/* an exchange's answer, which no task in flight waits for: an idle window */
static void groups_poll(void *ctx, uint64_t from_ns, uint64_t to_ns) {
    dc_server_poll(ctx, from_ns, to_ns, true);
}

static const dc_host_ops host_ops = {
    .uid_usage = host_uid_usage,
    .session_gone = host_session_gone,
    .poll = host_poll,
    .spin = host_spin,
};

_Static_assert(DC_CONFIG_MAX_IDS <= DC_HOST_MAX_IDS, "every [access] list fits the host's");

/* The settings the sessions read, from the effective configuration: at
 * start, and after a reload has changed it. */
static void host_cfg_copy(dc_host_cfg *h, const dc_config *c) {
    h->fixed_seed = c->fixed_seed;
    h->max_buffers = c->max_buffers;
    h->max_buffers_per_uid = c->max_buffers_per_uid;
    h->max_mapped_bytes_per_uid = c->max_mapped_bytes_per_uid;
    h->max_events = c->max_events;
    h->max_pass_memory = c->max_pass_memory;
    h->max_pass_memory_per_uid = c->max_pass_memory_per_uid;
    h->max_micro_batches = c->max_micro_batches;
    h->max_accumulator_memory = c->max_accumulator_memory;
    h->max_accumulator_memory_per_uid = c->max_accumulator_memory_per_uid;
    h->logical_step_timeout = c->logical_step_timeout;
    h->handshake_timeout = c->handshake_timeout;
    h->idle_timeout = c->idle_timeout;
    h->max_reply_queue = c->max_reply_queue;
    h->group_fuse = c->group_fuse;
    h->gpu_workspace = c->gpu_workspace;
    memcpy(h->allowed_uids, c->allowed_uids, sizeof c->allowed_uids);
    h->n_allowed_uids = c->n_allowed_uids;
    memcpy(h->allowed_gids, c->allowed_gids, sizeof c->allowed_gids);
    h->n_allowed_gids = c->n_allowed_gids;
    h->budget_epsilon = c->budget_epsilon;
    h->budget_delta = c->budget_delta;
    h->require_sample_rate = c->require_sample_rate;
}

/* The host every session gets: the server's own state by pointer (its
 * address is fixed from dc_server_init on), its settings by value. */
static void host_init(dc_server *srv) {
    dc_host *h = &srv->host;
    h->ops = &host_ops;
    h->ctx = srv;
    h->loop = srv->loop;
    host_cfg_copy(&h->cfg, &srv->cfg);
    h->limits = &srv->limits;
    h->workers = srv->workers;
    h->spin_ns = srv->spin_ns;
    h->noise_key = srv->noise_key;
    h->metrics = &srv->metrics;
    h->ledger = &srv->ledger;
    h->groups = &srv->groups;
    h->gpu = &srv->gpu;
    h->cpu_pool = &srv->cpu_pool;
    h->buf_totals = &srv->buf_totals;
    h->gpu_workspace = srv->gpu_workspace;
    h->next_session_id = &srv->next_session_id;
    h->next_buffer_id = &srv->next_buffer_id;
    h->noise_steps = &srv->noise_steps;
}

static void on_stop_timer(uv_timer_t *t) {
    dc_server *srv = t->data;
    dc_log_warn("shutdown: %zu sessions did not drain in time; closing them", srv->n_sessions);
    for (dc_session *s = srv->sessions; s; s = s->next) dc_session_close(s);
}

static void on_signal(uv_signal_t *h, int signum) {
    dc_server *srv = h->data;
    dc_log_info("signal %d: finishing in-flight steps and stopping", signum);
    dc_server_shutdown(srv);
}

void dc_server_shutdown(dc_server *srv) {
    dc_session *s, *next;
    if (srv->stopping) return;
    srv->stopping = true;
    dc_sd_stopping();
    uv_timer_stop(&srv->accept_timer);
    if (srv->listen_fd >= 0) {
        uv_poll_stop(&srv->listen_poll);
        uv_close((uv_handle_t *)&srv->listen_poll, NULL);
        close(srv->listen_fd);
        srv->listen_fd = -1;
        /* systemd's socket stays: connections queue there until we are back. */
        if (!srv->listen_activated) unlink(srv->socket_path);
    }
    uv_timer_start(&srv->stop_timer, on_stop_timer, 10000, 0);
    /* dc_session_shutdown may free a session (via the poll close callback,
     * later), never synchronously: iterating with `next` is safe. */
    for (s = srv->sessions; s; s = next) {
        next = s->next;
        dc_session_notify_shutdown(s);
        dc_session_shutdown(s);
    }
    maybe_finish(srv);
}

/* The step-cost limits validation reads (limits.max_step_*). */
static void set_step_limits(dc_limits *l, const dc_config *c) {
    l->max_step_samples = c->max_step_samples;
    l->max_step_memory = c->max_step_memory;
    l->max_step_gflop = c->max_step_gflop;
    l->max_gpu_step_gflop = c->max_gpu_step_gflop;
}

/* gpu.idle_release_s, at start and on a reload, into each GPU's pool. */
static void set_gpu_release(dc_server *srv, uint32_t seconds) {
    for (int i = 0; i < srv->gpu.n; i++)
        dc_worker_pool_set_release(&srv->gpu.pools[i], (uint64_t)seconds * 1000000000u);
}

static void note_restart(void *arg, const char *name) {
    (void)arg;
    dc_log_warn("reload: %s changed; it takes effect at the next restart", name);
}

void dc_server_apply_config(dc_server *srv, const dc_config *n) {
    dc_config *c = &srv->cfg;
    dc_config_restart_needed(c, n, note_restart, NULL);
    c->log_level = n->log_level;
    dc_log_set_level(n->log_level);
    c->max_batch = srv->limits.max_batch = n->max_batch;
    c->max_layers = srv->limits.max_layers = n->max_layers;
    c->max_buffers = n->max_buffers;
    c->max_step_samples = n->max_step_samples;
    c->max_step_memory = n->max_step_memory;
    c->max_step_gflop = n->max_step_gflop;
    c->max_gpu_step_gflop = n->max_gpu_step_gflop;
    set_step_limits(&srv->limits, n);
    c->max_connections = n->max_connections;
    c->max_connections_per_uid = n->max_connections_per_uid;
    c->handshake_timeout = n->handshake_timeout;
    c->idle_timeout = n->idle_timeout;
    c->max_buffers_total = n->max_buffers_total;
    c->max_buffers_per_uid = n->max_buffers_per_uid;
    c->max_mapped_bytes = n->max_mapped_bytes;
    c->max_mapped_bytes_per_uid = n->max_mapped_bytes_per_uid;
    c->max_pass_memory = n->max_pass_memory;
    c->max_pass_memory_per_uid = n->max_pass_memory_per_uid;
    c->max_micro_batches = n->max_micro_batches;
    c->max_accumulator_memory = n->max_accumulator_memory;
    c->max_accumulator_memory_per_uid = n->max_accumulator_memory_per_uid;
    c->logical_step_timeout = n->logical_step_timeout;
    c->max_reply_queue = n->max_reply_queue;
    c->max_group_size = srv->groups.max_size = n->max_group_size;
    c->max_group_links = srv->groups.max_links = n->max_group_links;
    c->max_group_timeout_ms = srv->groups.max_timeout_ms = n->max_group_timeout_ms;
    c->group_timeout_ms = srv->groups.timeout_ms = n->group_timeout_ms;
    c->gpu_idle_release_s = n->gpu_idle_release_s;
    set_gpu_release(srv, n->gpu_idle_release_s);
    srv->buf_totals.max_buffers = c->max_buffers_total;
    srv->buf_totals.max_shm_bytes = c->max_mapped_bytes;
    memcpy(c->allowed_uids, n->allowed_uids, sizeof c->allowed_uids);
    c->n_allowed_uids = n->n_allowed_uids;
    memcpy(c->allowed_gids, n->allowed_gids, sizeof c->allowed_gids);
    c->n_allowed_gids = n->n_allowed_gids;
    c->delta = srv->ledger.default_delta = n->delta;
    c->budget_epsilon = n->budget_epsilon;
    c->budget_delta = n->budget_delta;
    c->require_sample_rate = n->require_sample_rate;
    c->ledger_max_jobs_per_uid = n->ledger_max_jobs_per_uid;
    c->ledger_job_idle_s = n->ledger_job_idle_s;
    dc_ledger_set_limits(&srv->ledger, n->ledger_max_jobs_per_uid, n->ledger_job_idle_s);
    memcpy(c->status_ops_group, n->status_ops_group, sizeof c->status_ops_group);
    snprintf(c->config_path, sizeof c->config_path, "%s", n->config_path);
    /* the sessions' copy, then their deadlines re-armed from it */
    host_cfg_copy(&srv->host.cfg, c);
    for (dc_session *s = srv->sessions; s; s = s->next) dc_session_limits_changed(s);
}

static void on_hup(uv_signal_t *h, int signum) {
    dc_server *srv = h->data;
    dc_config n;
    dc_err e;
    (void)signum;
    if (srv->stopping) return;
    dc_sd_reloading();
    if (!srv->reload) {
        dc_log_warn("SIGHUP: nothing to reload from");
    } else if (srv->reload(srv->reload_arg, &n, &e) != 0) {
        srv->metrics.reload_errors++;
        dc_log_error("reload failed, keeping the running configuration: %s", e.msg);
    } else {
        dc_server_apply_config(srv, &n);
        srv->metrics.reloads++;
        dc_log_info("configuration reloaded%s%s", n.config_path[0] ? " from " : "", n.config_path);
    }
    dc_sd_ready();
    post_status(srv);
}

static int resolve_gid(const char *group) {
    uint32_t gid;
    if (!group[0] || dc_config_group_id(group, &gid) != 0) return -1;
    return (int)gid;
}

static int listen_main(dc_server *srv, dc_err *err) {
    int fd;
    snprintf(srv->socket_path, sizeof srv->socket_path, "%s", srv->cfg.socket);
    if ((fd = dc_sd_take_unix(srv->cfg.socket)) >= 0) {
        /* systemd made it (SocketMode/SocketGroup apply); it may be blocking. */
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        srv->listen_activated = true;
    } else if ((fd = dc_listen_unix(srv->cfg.socket, srv->cfg.socket_mode,
                                    resolve_gid(srv->cfg.socket_group), err)) < 0) {
        return err ? (int)err->code : DC_EUNAVAIL;
    }
    srv->listen_fd = fd;
    return 0;
}

int dc_server_init(dc_server *srv, uv_loop_t *loop, const dc_config *cfg,
                   dc_server_reload_fn reload, void *reload_arg, dc_err *err) {
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    char status_path[128];
    dc_status_opts so;
    int rc;

    memset(srv, 0, sizeof *srv);
    srv->loop = loop;
    srv->cfg = *cfg;
    srv->reload = reload;
    srv->reload_arg = reload_arg;
    srv->listen_fd = -1;
    srv->reserve_fd = -1;
    srv->spin_tfd = -1;
    srv->ledger.lock_fd = -1;
    srv->buf_totals.max_buffers = cfg->max_buffers_total;
    srv->buf_totals.max_shm_bytes = cfg->max_mapped_bytes;
    srv->limits.max_batch = cfg->max_batch;
    srv->limits.max_layers = cfg->max_layers;
    srv->limits.max_frame = cfg->max_frame;
    set_step_limits(&srv->limits, cfg);
    srv->workers = cfg->workers > 0 ? cfg->workers : ncpu > 0 ? (int)ncpu : 1;
    srv->spin_ns = (uint64_t)cfg->spin_us * 1000u;
    srv->start_ns = uv_hrtime();
    srv->start_time = (int64_t)time(NULL);
    if (cfg->fixed_seed) {
        srv->noise_key = cfg->seed;
        dc_log_warn("--insecure-fixed-seed: noise is predictable; for tests only, never for "
                    "private training");
    } else if (getrandom(&srv->noise_key, sizeof srv->noise_key, 0) != sizeof srv->noise_key) {
        return dc_err_set(err, DC_EINTERNAL, "", "getrandom: %s", strerror(errno));
    }
    host_init(srv);

    dc_groups_init(&srv->groups, loop, srv->noise_key, cfg->max_group_size, cfg->group_timeout_ms,
                   cfg->max_group_timeout_ms);
    srv->groups.max_links = cfg->max_group_links;
    if (srv->spin_ns) { /* (daemon.spin_us = 0: no polling windows at all) */
        srv->groups.poll = groups_poll;
        srv->groups.poll_ctx = srv;
    }

    /* The ledger first: a daemon that cannot account must not serve steps. */
    if ((rc = dc_ledger_open(&srv->ledger, cfg->ledger_dir, cfg->delta, err))) return rc;
    dc_ledger_store_init(&srv->ledger, loop, &srv->metrics);
    dc_ledger_set_limits(&srv->ledger, cfg->ledger_max_jobs_per_uid, cfg->ledger_job_idle_s);
    srv->ledger.insecure = cfg->fixed_seed;
    if ((rc = dc_worker_pool_init(&srv->cpu_pool, loop, "cpu", srv->workers, cpu_factory, NULL,
                                  err)))
        goto fail_ledger;
    srv->pool_ready = true;
    dc_worker_pool_set_spin(&srv->cpu_pool, srv->spin_ns);
    if ((rc = dc_gpu_init(&srv->gpu, loop, cfg->gpu, cfg->gpu_workspace, cfg->gpu_workspace_max,
                          cfg->gpu_sample_grads_max, err)))
        goto fail_pool;
    for (int i = 0; i < srv->gpu.n; i++) dc_worker_pool_set_spin(&srv->gpu.pools[i], srv->spin_ns);
    set_gpu_release(srv, cfg->gpu_idle_release_s);

    {
        /* systemd's LimitNOFILE sets both limits; started by hand, the soft
         * one is often 1024: sessions get what the hard one allows. */
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
            rl.rlim_cur = rl.rlim_max;
            setrlimit(RLIMIT_NOFILE, &rl);
        }
    }
    if ((srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0) {
        rc = dc_err_set(err, DC_EINTERNAL, "", "/dev/null: %s", strerror(errno));
        goto fail_pool;
    }

    dc_sd_listen_init();
    if ((rc = listen_main(srv, err))) goto fail_pool;
    dc_config_status_path(cfg, status_path, sizeof status_path);
    so.unix_path = status_path;
    so.unix_mode = cfg->status_mode;
    so.unix_gid = resolve_gid(cfg->status_group);
    so.tcp_port = cfg->status_port;
    so.asked = cfg->status_socket[0] || cfg->status_port;
    so.max_connections = cfg->status_max_connections;
    so.timeout_s = cfg->status_timeout_s;
    if ((rc = dc_status_start(&srv->status, loop, &so, &dc_server_status, srv, err)))
        goto fail_listen;
    dc_sd_listen_done();

    uv_poll_init(loop, &srv->listen_poll, srv->listen_fd);
    srv->listen_poll.data = srv;
    uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);

    uv_timer_init(loop, &srv->stop_timer);
    srv->stop_timer.data = srv;
    uv_timer_init(loop, &srv->accept_timer);
    srv->accept_timer.data = srv;
    dc_server_windows_init(srv, loop, true);
    uv_timer_init(loop, &srv->tick);
    srv->tick.data = srv;
    {
        /* Keep-alives at a third of systemd's watchdog period, status lines
         * every few seconds without one. */
        uint64_t wd = dc_sd_watchdog_usec(), period = wd ? wd / 3000 : 5000;
        if (period < 100) period = 100;
        uv_timer_start(&srv->tick, on_tick, period, period);
    }
    uv_signal_init(loop, &srv->sig_term);
    uv_signal_init(loop, &srv->sig_int);
    uv_signal_init(loop, &srv->sig_hup);
    srv->sig_term.data = srv->sig_int.data = srv->sig_hup.data = srv;
    uv_signal_start(&srv->sig_term, on_signal, SIGTERM);
    uv_signal_start(&srv->sig_int, on_signal, SIGINT);
    uv_signal_start(&srv->sig_hup, on_hup, SIGHUP);

    dc_log_info("dpclipd %s listening on %s%s (cpu: %d workers; gpus: %d%s; max batch %u; "
                "ledger: %s)",
                DPCLIP_VERSION, srv->socket_path, srv->listen_activated ? " (from systemd)" : "",
                srv->workers, srv->gpu.n, srv->gpu.mps_active ? ", MPS" : "", srv->limits.max_batch,
                cfg->ledger_dir[0] ? cfg->ledger_dir : "in memory only");
    if (cfg->ready_fd >= 0) {
        static const char ready[] = "READY\n";
        ssize_t n = write(cfg->ready_fd, ready, sizeof ready - 1);
        (void)n;
        close(cfg->ready_fd);
    }
    dc_sd_ready();
    post_status(srv);
    return 0;

fail_listen:
    close(srv->listen_fd);
    if (!srv->listen_activated) unlink(srv->socket_path);
    srv->listen_fd = -1;
fail_pool:
    if (srv->reserve_fd >= 0) close(srv->reserve_fd);
    srv->reserve_fd = -1;
    dc_gpu_close(&srv->gpu);
    dc_worker_pool_close(&srv->cpu_pool);
    srv->pool_ready = false;
fail_ledger:
    dc_ledger_close(&srv->ledger);
    return rc;
}

void dc_server_free(dc_server *srv) {
    /* uv_run has returned: no ledger write is in flight any more. */
    dc_ledger_close(&srv->ledger);
}
