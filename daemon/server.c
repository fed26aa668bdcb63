#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "log.h"
#include "session.h"

static int cpu_factory(void *arg, int index, dc_backend **out, dc_err *err) {
    (void)arg;
    (void)index;
    return dc_cpu_backend_create(1, out, err);
}

/* A socket file left by a crashed daemon is stale and may be replaced; one a
 * live daemon answers on must not be stolen. */
static int socket_in_use(const struct sockaddr_un *addr) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int live;
    if (fd < 0) return 0;
    live = connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0;
    close(fd);
    return live;
}

static void on_accept(uv_poll_t *h, int status, int events) {
    dc_server *srv = h->data;
    (void)events;
    if (status < 0 || srv->stopping) return;
    for (int i = 0; i < 64; i++) {
        int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        dc_session *s;
        if (fd < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                dc_log_warn("accept: %s", strerror(errno));
            return;
        }
        if (dc_session_start(srv, fd, &s) != 0) {
            dc_log_error("cannot start a session (out of memory?)");
            continue;
        }
        s->next = srv->sessions;
        if (srv->sessions) srv->sessions->prev = s;
        srv->sessions = s;
        srv->n_sessions++;
        srv->stats.sessions_total++;
        dc_log_debug("session %llu: connected (pid %d uid %u)", (unsigned long long)s->id,
                     (int)s->peer_pid, (unsigned)s->peer_uid);
    }
}

static void on_spin(uv_idle_t *h) {
    dc_server *srv = h->data;
    if (uv_hrtime() >= srv->spin_until ||
        dc_worker_pool_busy(&srv->cpu_pool) + dc_gpu_busy(&srv->gpu) == 0)
        uv_idle_stop(h);
}

void dc_server_spin(dc_server *srv) {
    if (!srv->cfg.spin_ns || srv->stopping) return;
    srv->spin_until = uv_hrtime() + srv->cfg.spin_ns;
    uv_idle_start(&srv->spin, on_spin);
}

static void on_spin_timer(uv_timer_t *t) {
    dc_server *srv = t->data;
    srv->spin_at = 0;
    if (!srv->stopping) uv_idle_start(&srv->spin, on_spin);
}

void dc_server_spin_expect(dc_server *srv, uint64_t expect_ns) {
    uint64_t now = uv_hrtime(), margin, start, end;
    if (!srv->cfg.spin_ns || srv->stopping) return;
    /* libuv timers have millisecond resolution: open the window a bit more
     * than a millisecond early, close it well after. */
    margin = expect_ns / 20 > 1500000u ? expect_ns / 20 : 1500000u;
    if (expect_ns <= margin) {
        srv->spin_until = now + expect_ns + margin;
        uv_idle_start(&srv->spin, on_spin);
        return;
    }
    start = now + expect_ns - margin;
    end = now + expect_ns + 2 * margin;
    if (end > srv->spin_until) srv->spin_until = end;
    if (uv_is_active((uv_handle_t *)&srv->spin)) return;   /* already polling */
    if (srv->spin_at && srv->spin_at <= start) return;      /* an earlier window opens first */
    srv->spin_at = start;
    uv_timer_start(&srv->spin_timer, on_spin_timer, (start - now) / 1000000u, 0);
}

static void maybe_finish(dc_server *srv) {
    if (!srv->stopping || srv->n_sessions || srv->closed) return;
    srv->closed = true;
    uv_timer_stop(&srv->stop_timer);
    uv_close((uv_handle_t *)&srv->stop_timer, NULL);
    uv_close((uv_handle_t *)&srv->spin, NULL);
    uv_close((uv_handle_t *)&srv->spin_timer, NULL);
    uv_close((uv_handle_t *)&srv->sig_term, NULL);
    uv_close((uv_handle_t *)&srv->sig_int, NULL);
    if (srv->pool_ready) dc_worker_pool_close(&srv->cpu_pool);
    srv->pool_ready = false;
    dc_gpu_close(&srv->gpu);
    dc_log_info("stopped: %llu sessions, %llu steps served, %llu failed",
                (unsigned long long)srv->stats.sessions_total,
                (unsigned long long)srv->stats.steps_ok,
                (unsigned long long)srv->stats.steps_failed);
}

void dc_server_session_gone(dc_server *srv, dc_session *s) {
    if (s->prev) s->prev->next = s->next;
    else srv->sessions = s->next;
    if (s->next) s->next->prev = s->prev;
    srv->n_sessions--;
    maybe_finish(srv);
}

static void on_stop_timer(uv_timer_t *t) {
    dc_server *srv = t->data;
    dc_log_warn("shutdown: %zu sessions did not drain in time; closing them",
                srv->n_sessions);
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
    if (srv->listen_fd >= 0) {
        uv_poll_stop(&srv->listen_poll);
        uv_close((uv_handle_t *)&srv->listen_poll, NULL);
        close(srv->listen_fd);
        srv->listen_fd = -1;
        unlink(srv->socket_path);
    }
    uv_timer_start(&srv->stop_timer, on_stop_timer, 10000, 0);
    /* dc_session_shutdown may free a session (via the poll close callback,
     * later), never synchronously: iterating with `next` is safe. */
    for (s = srv->sessions; s; s = next) {
        next = s->next;
        dc_session_shutdown(s);
    }
    maybe_finish(srv);
}

static int listen_on(dc_server *srv, dc_err *err) {
    struct sockaddr_un addr;
    int fd;

    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (strlen(srv->cfg.socket_path) >= sizeof addr.sun_path)
        return dc_err_set(err, DC_EINVAL, "socket", "socket path longer than %zu bytes",
                          sizeof addr.sun_path - 1);
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", srv->cfg.socket_path);
    snprintf(srv->socket_path, sizeof srv->socket_path, "%s", srv->cfg.socket_path);

    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return dc_err_set(err, DC_EINTERNAL, "socket", "socket: %s", strerror(errno));
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        struct stat st;
        if (errno != EADDRINUSE) goto fail_bind;
        if (socket_in_use(&addr)) {
            close(fd);
            return dc_err_set(err, DC_EUNAVAIL, "socket",
                              "%s: another dpclipd is already serving this socket",
                              srv->cfg.socket_path);
        }
        /* Replace a stale socket, but never some other kind of file. */
        if (lstat(srv->cfg.socket_path, &st) != 0 || !S_ISSOCK(st.st_mode)) {
            errno = EEXIST;
            goto fail_bind;
        }
        unlink(srv->cfg.socket_path);
        if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) goto fail_bind;
    }
    /* Group members (the trainers' group) may connect; nobody else. */
    if (chmod(srv->cfg.socket_path, srv->cfg.socket_mode) != 0) {
        dc_err_set(err, DC_EINTERNAL, "socket", "chmod %s: %s", srv->cfg.socket_path,
                   strerror(errno));
        goto fail_unlink;
    }
    if (listen(fd, 128) != 0) {
        dc_err_set(err, DC_EINTERNAL, "socket", "listen: %s", strerror(errno));
        goto fail_unlink;
    }
    srv->listen_fd = fd;
    return 0;

fail_bind:
    dc_err_set(err, DC_EUNAVAIL, "socket", "bind %s: %s", srv->cfg.socket_path, strerror(errno));
    close(fd);
    return err ? (int)err->code : DC_EUNAVAIL;
fail_unlink:
    unlink(srv->cfg.socket_path);
    close(fd);
    return err ? (int)err->code : DC_EINTERNAL;
}

int dc_server_init(dc_server *srv, uv_loop_t *loop, const dc_server_config *cfg, dc_err *err) {
    int rc;

    memset(srv, 0, sizeof *srv);
    srv->loop = loop;
    srv->cfg = *cfg;
    srv->listen_fd = -1;
    if (cfg->fixed_seed) {
        srv->noise_key = cfg->seed;
        dc_log_warn("--insecure-fixed-seed: noise is predictable; for tests only, never for "
                    "private training");
    } else if (getrandom(&srv->noise_key, sizeof srv->noise_key, 0) != sizeof srv->noise_key) {
        return dc_err_set(err, DC_EINTERNAL, "", "getrandom: %s", strerror(errno));
    }

    if ((rc = dc_worker_pool_init(&srv->cpu_pool, loop, "cpu", cfg->workers, cpu_factory, NULL,
                                  err)))
        return rc;
    srv->pool_ready = true;
    dc_worker_pool_set_spin(&srv->cpu_pool, cfg->spin_ns);
    if ((rc = dc_gpu_init(&srv->gpu, loop, cfg->use_gpu, err))) goto fail_pool;

    if ((rc = listen_on(srv, err))) goto fail_pool;
    uv_poll_init(loop, &srv->listen_poll, srv->listen_fd);
    srv->listen_poll.data = srv;
    uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);

    uv_timer_init(loop, &srv->stop_timer);
    srv->stop_timer.data = srv;
    uv_idle_init(loop, &srv->spin);
    srv->spin.data = srv;
    uv_timer_init(loop, &srv->spin_timer);
    srv->spin_timer.data = srv;
    uv_signal_init(loop, &srv->sig_term);
    uv_signal_init(loop, &srv->sig_int);
    srv->sig_term.data = srv->sig_int.data = srv;
    uv_signal_start(&srv->sig_term, on_signal, SIGTERM);
    uv_signal_start(&srv->sig_int, on_signal, SIGINT);

    dc_log_info("dpclipd %s listening on %s (cpu: %d workers; gpus: %d; max batch %u)",
                DPCLIP_VERSION, srv->socket_path, cfg->workers, srv->gpu.n,
                cfg->limits.max_batch);
    if (cfg->ready_fd >= 0) {
        static const char ready[] = "READY\n";
        ssize_t n = write(cfg->ready_fd, ready, sizeof ready - 1);
        (void)n;
        close(cfg->ready_fd);
    }
    return 0;

fail_pool:
    dc_gpu_close(&srv->gpu);
    dc_worker_pool_close(&srv->cpu_pool);
    srv->pool_ready = false;
    return rc;
}
