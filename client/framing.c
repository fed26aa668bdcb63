/* Framing over the Unix socket: u32 little-endian length + packed protobuf
 * (common/dc_frame.h). The socket is non-blocking and every wait goes
 * through poll(), so that connect/handshake, dpclip_wait and dpclip_poll can
 * honour timeouts with one code path. The caller holds c->mu. */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "dc_frame.h"
#include "internal.h"

int64_t cl_deadline(int timeout_ms) {
    if (timeout_ms < 0) return -1;
    return dc_clock_ms() + timeout_ms;
}

/* Milliseconds left for poll(): -1 forever, 0 when past. */
static int time_left(int64_t deadline) {
    int64_t left;
    if (deadline < 0) return -1;
    left = deadline - dc_clock_ms();
    if (left <= 0) return 0;
    return left > 1000000 ? 1000000 : (int)left;
}

/* Appends whatever the socket has now to rbuf, without blocking.
 * 1: read something, 0: nothing available, <0: EOF or error (errno kept). */
static int read_some(dpclip_client *c) {
    ssize_t n;
    if (c->rcap - c->rlen < 4096) {
        size_t cap = c->rcap ? c->rcap * 2 : 65536;
        uint8_t *nb = realloc(c->rbuf, cap);
        if (!nb) {
            errno = ENOMEM;
            return -1;
        }
        c->rbuf = nb;
        c->rcap = cap;
    }
    for (;;) {
        n = recv(c->fd, c->rbuf + c->rlen, c->rcap - c->rlen, MSG_DONTWAIT);
        if (n > 0) {
            c->rlen += (size_t)n;
            return 1;
        }
        if (n == 0) {
            errno = ECONNRESET;
            return -2;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        return -1;
    }
}

/* Writes [buf, buf+len) fully; `fd_pass` goes with the first byte. */
/* The daemon may refuse a connection (one Error frame, then close: a
 * connection limit, out of descriptors) before our request reaches it, so
 * that the send fails with EPIPE: the refusal is still queued here. Returns
 * its code with its words (the connection closed), or 0 if there is none. */
static int refusal(dpclip_client *c) {
    uint8_t buf[DC_FRAME_HEADER + 4096];
    size_t got = 0;
    Dpclip__Reply *r;
    int rc = 0;
    while (got < sizeof buf) {
        ssize_t n = recv(c->fd, buf + got, sizeof buf - got, MSG_DONTWAIT);
        if (n <= 0) break;
        got += (size_t)n;
    }
    if (got < DC_FRAME_HEADER || dc_frame_get_len(buf) > got - DC_FRAME_HEADER) return 0;
    r = dpclip__reply__unpack(NULL, dc_frame_get_len(buf), buf + DC_FRAME_HEADER);
    if (!r) return 0;
    if (cl_keep_notice(c, r)) {
        rc = cl_die(c, "dpclipd closed the connection"); /* with the notice's words */
    } else if (r->body_case == DPCLIP__REPLY__BODY_ERROR && r->error) {
        (void)cl_die(c, "dpclipd closed the connection");
        rc = cl_fail(c, cl_daemon_code(r->error->code), r->error->field, "%s",
                     r->error->message ? r->error->message : "");
    }
    dpclip__reply__free_unpacked(r, NULL);
    return rc;
}

static int write_all(dpclip_client *c, const uint8_t *buf, size_t len, int fd_pass,
                     int64_t deadline) {
    size_t off = 0;
    while (off < len) {
        ssize_t n;
        if (fd_pass >= 0) {
            union {
                struct cmsghdr h;
                char buf[CMSG_SPACE(sizeof(int))];
            } cm;
            struct iovec iov = {(void *)(buf + off), len - off};
            struct msghdr msg;
            struct cmsghdr *h;
            memset(&msg, 0, sizeof msg);
            memset(&cm, 0, sizeof cm);
            msg.msg_iov = &iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cm.buf;
            msg.msg_controllen = sizeof cm.buf;
            h = CMSG_FIRSTHDR(&msg);
            h->cmsg_level = SOL_SOCKET;
            h->cmsg_type = SCM_RIGHTS;
            h->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(h), &fd_pass, sizeof(int));
            n = sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        } else {
            n = send(c->fd, buf + off, len - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        if (n > 0) {
            off += (size_t)n;
            fd_pass = -1; /* the descriptor went with the bytes just sent */
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) {
            int e = errno, rc = refusal(c);
            if (rc) return rc;
            return cl_die(c, "send to dpclipd: %s", strerror(e));
        }
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return cl_die(c, "send to dpclipd: %s", strerror(errno));
        /* Socket full. The daemon may be blocked writing replies we have
         * not read (a client pipelining many submits): read them into rbuf
         * while waiting, or both sides would wait forever. */
        struct pollfd p = {c->fd, POLLOUT | POLLIN, 0};
        int r = poll(&p, 1, time_left(deadline));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return cl_die(c, "poll: %s", strerror(errno));
        if (r == 0) return cl_die(c, "timed out sending to dpclipd");
        if (p.revents & POLLIN) {
            int rr = read_some(c);
            if (rr == -2) return cl_die(c, "dpclipd closed the connection");
            if (rr < 0) return cl_die(c, "recv from dpclipd: %s", strerror(errno));
        } else if (p.revents & (POLLERR | POLLHUP | POLLNVAL)) {
            return cl_die(c, "connection to dpclipd lost");
        }
    }
    return 0;
}

/* Checks a request of n payload bytes against the daemon's max_frame and
 * makes the send buffer hold its frame. */
static int frame_reserve(dpclip_client *c, size_t n) {
    size_t need = DC_FRAME_HEADER + n;
    if ((c->info.max_frame && n > c->info.max_frame) || n > UINT32_MAX)
        return cl_fail(c, DPCLIP_EARG, "frame.length",
                       "the request needs %zu bytes, more than the daemon's max_frame %u "
                       "(fewer layers per step, or start dpclipd with a larger --max-frame)",
                       n, c->info.max_frame);
    if (need > c->scap) {
        size_t cap = c->scap ? c->scap : 4096;
        uint8_t *nb;
        while (cap < need) cap *= 2;
        nb = realloc(c->sbuf, cap);
        if (!nb) return cl_fail(c, DPCLIP_ENOMEM, "", "out of memory for a %zu-byte request", need);
        c->sbuf = nb;
        c->scap = cap;
    }
    return 0;
}

int cl_send_request(dpclip_client *c, Dpclip__Request *req, int pass_fd, int64_t deadline) {
    size_t n;
    int rc;

    if (c->fd < 0) return cl_closed(c);
    req->id = ++c->next_req_id;
    n = dpclip__request__get_packed_size(req);
    if ((rc = frame_reserve(c, n))) return rc;
    dc_frame_put_len(c->sbuf, (uint32_t)n);
    dpclip__request__pack(req, c->sbuf + DC_FRAME_HEADER);
    return write_all(c, c->sbuf, DC_FRAME_HEADER + n, pass_fd, deadline);
}

int cl_send_body(dpclip_client *c, const uint8_t *body, size_t len, int64_t deadline,
                 uint64_t *id) {
    uint8_t head[DC_FRAME_HEADER + 11];
    size_t h = DC_FRAME_HEADER, n;
    uint64_t v;
    int rc;

    if (c->fd < 0) return cl_closed(c);
    *id = v = ++c->next_req_id;
    head[h++] = 0x08; /* field 1 (id), varint */
    do {
        head[h] = (uint8_t)(v & 0x7f);
        v >>= 7;
        if (v) head[h] |= 0x80;
        h++;
    } while (v);
    n = h - DC_FRAME_HEADER + len;
    if ((rc = frame_reserve(c, n))) return rc;
    dc_frame_put_len(head, (uint32_t)n);
    memcpy(c->sbuf, head, h);
    memcpy(c->sbuf + h, body, len);
    return write_all(c, c->sbuf, DC_FRAME_HEADER + n, -1, deadline);
}

/* Inside the spin window: poll without sleeping. Before it: sleep until it
 * opens (ppoll has sub-millisecond resolution), bounded by the deadline. */
static int wait_readable(dpclip_client *c, int64_t deadline) {
    struct pollfd p = {c->fd, POLLIN, 0};
    uint64_t now = c->spin_to_ns ? dc_clock_ns() : 0;
    if (now && now < c->spin_to_ns) {
        if (now >= c->spin_from_ns) return poll(&p, 1, 0) == 0 ? 1 : 0;
        uint64_t wait = c->spin_from_ns - now;
        int left = time_left(deadline);
        if (left >= 0 && (uint64_t)left * 1000000u < wait) wait = (uint64_t)left * 1000000u;
        struct timespec ts = {(time_t)(wait / 1000000000u), (long)(wait % 1000000000u)};
        int r = ppoll(&p, 1, &ts, NULL);
        if (r < 0) return -1;
        return r == 0 && left == 0 ? -2 : 1; /* re-check; -2: deadline passed */
    }
    int r = poll(&p, 1, time_left(deadline));
    if (r < 0) return -1;
    return r == 0 ? -2 : 1;
}

int cl_read_reply(dpclip_client *c, int64_t deadline, Dpclip__Reply **out) {
    *out = NULL;
    for (;;) {
        if (c->fd < 0) return cl_closed(c);
        if (c->rlen >= DC_FRAME_HEADER) {
            uint32_t n = dc_frame_get_len(c->rbuf);
            if (n > CL_MAX_REPLY)
                return cl_die(c, "dpclipd sent a %u-byte frame; the stream is corrupt", n);
            if (c->rlen - DC_FRAME_HEADER >= n) {
                Dpclip__Reply *r = dpclip__reply__unpack(NULL, n, c->rbuf + DC_FRAME_HEADER);
                size_t used = DC_FRAME_HEADER + (size_t)n;
                memmove(c->rbuf, c->rbuf + used, c->rlen - used);
                c->rlen -= used;
                if (!r) return cl_die(c, "dpclipd sent a reply that does not decode");
                if (r->insecure) c->insecure = 1;
                if (cl_keep_notice(c, r)) { /* answers no request */
                    dpclip__reply__free_unpacked(r, NULL);
                    continue;
                }
                *out = r;
                return 0;
            }
        }
        int rr = read_some(c);
        if (rr == -2) return cl_die(c, "dpclipd closed the connection");
        if (rr < 0) return cl_die(c, "recv from dpclipd: %s", strerror(errno));
        if (rr > 0) continue;
        int pr = wait_readable(c, deadline);
        if (pr == -1 && errno == EINTR) continue;
        if (pr == -1) return cl_die(c, "poll: %s", strerror(errno));
        if (pr == -2) return DPCLIP_EAGAIN;
    }
}
