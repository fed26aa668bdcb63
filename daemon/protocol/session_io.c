/* A session's connection and life (session.h): its frames in, one at a
 * time to the request handlers that the session was opened with
 * (session_requests.c: the handlers sit above this file and are reached only
 * through that pointer), its replies out, its deadlines, and its end: the
 * handles closed, its group left, everything it owns freed. */
#include "session.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dpclip.pb-c.h"
#include "host.h"
#include "log.h"
#include "peek.h"
#include "session_int.h"
#include "step_logical.h"
#include "step_pass.h"
#include "step_validate.h"

/* Failed steps: at most one log line per session per period. */
#define DC_SESSION_LOG_PERIOD_NS 1000000000ull

/* One packed reply frame waiting to be written. */
struct dc_wbuf {
    dc_wbuf *next;
    size_t len, off;
    uint8_t data[];
};

int dc_session_busy(const dc_session *s) { return s->call != NULL || s->async_ops > 0; }
static void session_update_poll(dc_session *s);
static void on_timer(uv_timer_t *t);
static uint64_t seconds_ms(double sec);

/* Replies the client has not read yet past limits.max_reply_queue: its next
 * request waits (and reading stops), so the kernel's socket buffer pushes
 * back on a client that pipelines requests without reading the replies,
 * instead of our memory growing by a reply per request. */
static bool replies_pile_up(const dc_session *s) {
    return s->w_head && s->w_bytes >= s->host->cfg.max_reply_queue;
}

/* The longest frame the session may send now. */
static uint32_t frame_max(const dc_session *s) {
    uint32_t max = s->host->limits->max_frame;
    return s->hello_done || max < DC_SESSION_HELLO_MAX_FRAME ? max : DC_SESSION_HELLO_MAX_FRAME;
}

/* --- writing ----------------------------------------------------------- */

static void session_flush(dc_session *s) {
    while (s->w_head && !s->gone) {
        dc_wbuf *w = s->w_head;
        uint64_t t0 = uv_hrtime();
        ssize_t n = send(s->fd, w->data + w->off, w->len - w->off, MSG_NOSIGNAL | MSG_DONTWAIT);
        s->last_send_ns = uv_hrtime() - t0;
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            dc_log_debug("session %llu: write failed: %s", (unsigned long long)s->id,
                         strerror(errno));
            dc_session_close(s);
            return;
        }
        w->off += (size_t)n;
        s->w_bytes -= (size_t)n;
        if (w->off == w->len) {
            s->w_head = w->next;
            if (!s->w_head) s->w_tail = NULL;
            free(w);
        }
    }
}

void dc_session_send(dc_session *s, Dpclip__Reply *reply) {
    size_t n;
    dc_wbuf *w;

    if (s->gone) return;
    reply->insecure = s->host->cfg.fixed_seed; /* every reply says it */
    n = dpclip__reply__get_packed_size(reply);
    w = malloc(sizeof *w + DC_FRAME_HEADER + n);
    if (!w) {
        dc_log_error("session %llu: out of memory for a reply; closing", (unsigned long long)s->id);
        dc_session_close(s);
        return;
    }
    w->next = NULL;
    w->len = DC_FRAME_HEADER + n;
    w->off = 0;
    dc_frame_put_len(w->data, (uint32_t)n);
    dpclip__reply__pack(reply, w->data + DC_FRAME_HEADER);
    if (s->w_tail) s->w_tail->next = w;
    else s->w_head = w;
    s->w_tail = w;
    s->w_bytes += w->len;
    session_flush(s);
}

/* A failed step is what an operator looks for when a trainer misbehaves:
 * at info, naming the error; a trainer failing every step gets one line a
 * second (with the count held back), not one per step. */
static void log_failed_step(dc_session *s, const dc_err *e) {
    uint64_t skipped;
    char more[96] = "";
    if (!dc_log_limit_pass(&s->fail_log, uv_hrtime(), DC_SESSION_LOG_PERIOD_NS, &skipped)) return;
    if (skipped)
        snprintf(more, sizeof more, " (%llu more failed steps since the previous line)",
                 (unsigned long long)skipped);
    dc_log_info("session %llu: step failed (%s%s%s): %s%s", (unsigned long long)s->id,
                dc_code_name(e->code), e->field[0] ? ", " : "", e->field, e->msg, more);
}

void dc_session_send_error(dc_session *s, uint64_t id, const dc_err *e) {
    Dpclip__Reply reply = DPCLIP__REPLY__INIT;
    Dpclip__Error er = DPCLIP__ERROR__INIT;
    er.code = (Dpclip__ErrorCode)e->code;
    er.field = (char *)e->field;
    er.message = (char *)e->msg;
    reply.id = id;
    reply.body_case = DPCLIP__REPLY__BODY_ERROR;
    reply.error = &er;
    /* Replies go in request order and a step holds back the requests after
     * it: an error for the last ClipStep's id is that step's. */
    if (id && id == s->step_req_id) log_failed_step(s, e);
    else
        dc_log_debug("session %llu: request %llu: error %d %s: %s", (unsigned long long)s->id,
                     (unsigned long long)id, (int)e->code, e->field, e->msg);
    dc_session_send(s, &reply);
}

void dc_session_reject(dc_session *s, uint64_t id, const dc_err *e) {
    dc_metrics_error(s->host->metrics, e->code);
    dc_session_send_error(s, id, e);
}

/* --- requests ---------------------------------------------------------- */

/* Consumes complete frames while no step is in flight and the client reads
 * its replies. */
void dc_session_process(dc_session *s) {
    bool held = false;
    dc_frame f;

    while (!dc_session_busy(s) && !s->closing && !s->gone && dc_frame_started(&s->in)) {
        dc_frame_status st;
        uint32_t max = frame_max(s);
        if (replies_pile_up(s)) {
            held = true;
            break;
        }
        st = dc_frame_next(&s->in, max, &f);
        if (st == DC_FRAME_TOO_LONG) {
            dc_err e;
            if (s->hello_done)
                dc_err_set(&e, DC_EPROTO, "frame.length",
                           "frame of %u bytes exceeds the maximum of %u; closing", f.len, max);
            else
                dc_err_set(&e, DC_EPROTO, "frame.length",
                           "frame of %u bytes before Hello "
                           "exceeds the %u a connection may send before its Hello; closing",
                           f.len, max);
            dc_session_reject(s, 0, &e);
            s->closing = true;
            dc_frame_drop(&s->in);
            break;
        }
        if (st == DC_FRAME_NONE) break;
        s->dispatch(s, &f);
        /* The registry dup'd nothing: it mapped the fd, so ours can go. */
        dc_frame_release(&f);
    }
    if (s->gone) return;
    /* A member whose client ended its stream sends no further group step:
     * its step waiting for the others (for as long as the group's timeout)
     * would only hold the connection. It leaves now, which fails that step
     * on every member, and the session closes once the step is answered. */
    if (s->in.eof && s->group && s->call && s->call->grouped) {
        dc_session_group_leave(s, "its client closed the connection");
        if (s->gone) return; /* the failed step's reply ended the session */
    }
    dc_frame_compact(&s->in);
    /* (Held frames are whole: they are answered once the client reads.) */
    if (s->in.eof && !dc_session_busy(s) && !s->closing && !held) {
        if (dc_frame_buffered(&s->in)) {
            dc_err e;
            dc_err_set(&e, DC_EPROTO, "frame",
                       "truncated frame: connection ended after %zu of a frame's bytes",
                       dc_frame_buffered(&s->in));
            dc_session_reject(s, 0, &e);
        }
        s->closing = true;
    }
    session_update_poll(s);
}

void dc_session_check_stall(dc_session *s, uint64_t now_ns) {
    const uint8_t *p;
    uint32_t n;
    const dc_step_call *c = s->call;
    if (!c || s->gone || s->stall_warned == c->t_frame || now_ns - c->t_frame < DC_SESSION_STALL_NS)
        return;
    /* steps sent ahead are the trainer's schedule, not a wait on a reply */
    size_t pos = 0;
    uint32_t body = DC_WIRE_BODY_CLIP_STEP;
    while (body == DC_WIRE_BODY_CLIP_STEP && dc_frame_peek(&s->in, &pos, &p, &n))
        body = dc_peek_body(p, n);
    if (body == DC_WIRE_BODY_CLIP_STEP) return;
    s->stall_warned = c->t_frame;
    dc_log_warn("session %llu (pid %d, uid %u): a %s request waits behind its step in "
                "flight, which has run for %.0f s%s; requests are answered in order, so if "
                "the client waits for that reply before it lets the step finish (a norm group "
                "member registering memory while its step waits on work queued after that), "
                "both wait for good (docs/groups.md, \"A member never blocks mid-schedule\")",
                (unsigned long long)s->id, (int)s->peer_pid, (unsigned)s->peer_uid,
                dc_wire_body_name(body), (double)(now_ns - c->t_frame) / 1e9,
                c->grouped ? " (a norm group's)" : "");
}

static void on_poll(uv_poll_t *h, int status, int events) {
    dc_session *s = h->data;
    if (status < 0) {
        dc_session_close(s);
        return;
    }
    if (events & UV_WRITABLE) {
        session_flush(s);
        if (s->gone) return;
    }
    if ((events & UV_READABLE) &&
        dc_frame_read(&s->in, s->fd, (size_t)frame_max(s) + DC_FRAME_HEADER) != 0) {
        dc_session_close(s);
        return;
    }
    /* New frames, or room in the reply queue for held ones. */
    dc_session_process(s);
}

static void session_update_poll(dc_session *s) {
    int ev = 0;
    size_t limit = (size_t)frame_max(s) + DC_FRAME_HEADER;

    if (s->gone) return;
    if (s->closing && !s->w_head && !dc_session_busy(s)) {
        dc_session_close(s);
        return;
    }
    if (s->closing && !s->drain_armed) {
        /* Its last replies wait for a client that may never read them: it
         * has as long as a handshake, then the connection goes. */
        s->drain_armed = true;
        uv_timer_start(&s->timer, on_timer, seconds_ms(s->host->cfg.handshake_timeout), 0);
    }
    if (!s->in.eof && !s->closing && s->in.len < limit && !replies_pile_up(s)) ev |= UV_READABLE;
    if (s->w_head) ev |= UV_WRITABLE;
    if (ev == s->poll_events) return;
    s->poll_events = ev;
    if (ev) uv_poll_start(&s->poll, ev, on_poll);
    else uv_poll_stop(&s->poll);
}

/* --- deadlines ----------------------------------------------------------- */

static uint64_t seconds_ms(double sec) {
    double ms = sec * 1000.0 + 0.5;
    return ms < 1.0 ? 1 : (uint64_t)ms;
}

/* An Error naming the setting, what of it the socket takes now, and the
 * end: the client is not reading, or is not there. */
static void session_expire(dc_session *s, dc_code code, const char *setting, const char *what,
                           double sec) {
    dc_err e;
    dc_err_set(&e, code, setting, "%s for %g s (%s); closing", what, sec, setting);
    dc_log_info("session %llu: pid %d uid %u: %s", (unsigned long long)s->id, (int)s->peer_pid,
                (unsigned)s->peer_uid, e.msg);
    dc_session_reject(s, 0, &e);
    dc_session_close(s);
}

static void on_timer(uv_timer_t *t) {
    dc_session *s = t->data;
    const dc_host_cfg *c = &s->host->cfg;
    uint64_t now = uv_hrtime(), last, idle_ns;

    if (s->gone) return;
    if (s->closing) {
        if (dc_session_busy(s)) uv_timer_start(&s->timer, on_timer, 1000, 0); /* its reply first */
        else dc_session_close(s);
        return;
    }
    if (!s->hello_done) {
        session_expire(s, DC_EPRECOND, "limits.handshake_timeout", "connected without a Hello",
                       c->handshake_timeout);
        return;
    }
    if (c->idle_timeout <= 0) return;
    idle_ns = seconds_ms(c->idle_timeout) * 1000000u;
    /* A step in flight is not idleness; the last request or step reply is
     * activity (both stamped anyway, so requests cost no timer call). */
    last = s->t_frame > s->last_step_ns ? s->t_frame : s->last_step_ns;
    if (last < s->connected_ns) last = s->connected_ns;
    if (dc_session_busy(s)) last = now;
    if (now - last >= idle_ns) {
        session_expire(s, DC_EUNAVAIL, "limits.idle_timeout", "no request and no step in flight",
                       c->idle_timeout);
        return;
    }
    uv_timer_start(&s->timer, on_timer, (last + idle_ns - now) / 1000000u + 1, 0);
}

void dc_session_limits_changed(dc_session *s) {
    const dc_host_cfg *c = &s->host->cfg;
    if (s->gone || s->drain_armed) return;
    if (!s->hello_done) {
        uint64_t ms = seconds_ms(c->handshake_timeout);
        uint64_t spent = (uv_hrtime() - s->connected_ns) / 1000000u;
        uv_timer_start(&s->timer, on_timer, spent < ms ? ms - spent : 0, 0);
    } else if (c->idle_timeout > 0) {
        uv_timer_start(&s->timer, on_timer, seconds_ms(c->idle_timeout), 0);
    } else {
        uv_timer_stop(&s->timer);
    }
}

/* --- lifecycle ---------------------------------------------------------- */

void dc_session_refuse(int fd, const dc_err *e) {
    Dpclip__Reply reply = DPCLIP__REPLY__INIT;
    Dpclip__Error er = DPCLIP__ERROR__INIT;
    uint8_t buf[DC_FRAME_HEADER + 1024];
    size_t n;
    er.code = (Dpclip__ErrorCode)e->code;
    er.field = (char *)e->field;
    er.message = (char *)e->msg;
    reply.body_case = DPCLIP__REPLY__BODY_ERROR;
    reply.error = &er;
    n = dpclip__reply__get_packed_size(&reply);
    if (n <= sizeof buf - DC_FRAME_HEADER) {
        dc_frame_put_len(buf, (uint32_t)n);
        dpclip__reply__pack(&reply, buf + DC_FRAME_HEADER);
        /* A fresh socket's buffer takes it; if not, the close says enough. */
        ssize_t w = send(fd, buf, DC_FRAME_HEADER + n, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)w;
    }
    close(fd);
}

int dc_session_open(dc_host *host, int fd, dc_session_dispatch dispatch, dc_session **out) {
    dc_session *s = calloc(1, sizeof *s);
    struct ucred cred;
    socklen_t len = sizeof cred;

    if (!s) {
        close(fd);
        return DC_ENOSPACE;
    }
    s->host = host;
    s->dispatch = dispatch;
    s->fd = fd;
    s->id = ++*host->next_session_id;
    s->connected_ns = uv_hrtime();
    dc_frame_in_init(&s->in);
    dc_registry_init(&s->reg);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
        s->peer_pid = cred.pid;
        s->peer_uid = cred.uid;
        s->peer_gid = cred.gid;
    }
    if (uv_poll_init(host->loop, &s->poll, fd) != 0) {
        close(fd);
        free(s);
        return DC_EINTERNAL;
    }
    s->poll.data = s;
    s->poll_events = UV_READABLE;
    uv_poll_start(&s->poll, UV_READABLE, on_poll);
    uv_timer_init(host->loop, &s->timer);
    s->timer.data = s;
    s->handles_open = 2;
    s->reg.totals = host->buf_totals;
    dc_session_limits_changed(s); /* the handshake's deadline */
    *out = s;
    return 0;
}

static void on_handle_closed(uv_handle_t *h) {
    dc_session *s = h->data;
    if (--s->handles_open > 0) return;
    s->poll_closed = true;
    close(s->fd);
    s->fd = -1;
    if (!dc_session_busy(s)) dc_session_destroy(s);
}

/* Frees everything; only once the poll handle is closed and no step runs. */
void dc_session_destroy(dc_session *s) {
    if (!s->poll_closed || dc_session_busy(s)) return;
    for (size_t i = 0; i < s->n_events; i++)
        dc_gpu_close_event(s->host->gpu, s->events[i].device, s->events[i].event);
    free(s->events);
    /* A session that said Hello was logged at info: so is its end. */
    dc_log(s->hello_done ? DC_LOG_INFO : DC_LOG_DEBUG,
           "session %llu: closed after %llu steps done, %llu failed running; pid %d uid %u "
           "job '%s'",
           (unsigned long long)s->id, (unsigned long long)s->steps,
           (unsigned long long)s->steps_failed, (int)s->peer_pid, (unsigned)s->peer_uid, s->job_id);
    while (s->w_head) {
        dc_wbuf *w = s->w_head;
        s->w_head = w->next;
        free(w);
    }
    dc_session_plan_drop(s);
    dc_pass_free(s->pass);
    s->pass = NULL;
    s->pass_bytes = 0;
    dc_logical_free(s);
    free(s->prewait);
    dc_registry_destroy(&s->reg);
    if (s->account) s->account->sessions--;
    dc_frame_in_free(&s->in);
    dc_host_session_gone(s->host, s);
    free(s);
}

void dc_session_close(dc_session *s) {
    if (s->gone) return;
    s->gone = true;
    uv_poll_stop(&s->poll);
    uv_close((uv_handle_t *)&s->poll, on_handle_closed);
    uv_close((uv_handle_t *)&s->timer, on_handle_closed);
    /* last: the group fails the steps waiting for this member at once */
    dc_session_group_leave(s, "disconnected");
}

void dc_session_notify_shutdown(dc_session *s) {
    dc_err e;
    if (s->gone) return;
    dc_err_set(&e, DC_EUNAVAIL, "daemon", "dpclipd is shutting down");
    dc_session_send_error(s, 0, &e);
}

void dc_session_shutdown(dc_session *s) {
    if (s->gone) return;
    s->closing = true;
    /* Drop requests not started yet; the step in flight (if any) replies. */
    dc_frame_drop(&s->in);
    session_update_poll(s);
}

void dc_session_plan_drop(dc_session *s) {
    dc_step_plan_free(s->plan);
    s->plan = NULL;
}

void dc_session_group_leave(dc_session *s, const char *why) {
    if (!s->group) return;
    dc_log_info("session %llu: leaves norm group '%s' (%s)", (unsigned long long)s->id,
                dc_group_name(s->group), why);
    dc_group *g = s->group;
    s->group = NULL;
    dc_group_leave(g, s->group_rank, why);
}
