#include "frame.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

void dc_frame_in_init(dc_frame_in *in) { memset(in, 0, sizeof *in); }

void dc_frame_in_free(dc_frame_in *in) {
    for (int i = 0; i < in->nfds; i++) close(in->fds[i].fd);
    in->nfds = 0;
    free(in->buf);
    in->buf = NULL;
    in->len = in->cap = in->off = 0;
}

size_t dc_frame_buffered(const dc_frame_in *in) { return in->len - in->off; }

bool dc_frame_started(const dc_frame_in *in) { return in->len - in->off >= DC_FRAME_HEADER; }

int dc_frame_read(dc_frame_in *in, int fd, size_t limit) {
    for (int rounds = 0; rounds < 16; rounds++) {
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int) * DC_FRAME_MAX_FDS)];
        } cm;
        struct iovec iov;
        struct msghdr msg;
        ssize_t n;

        if (in->len >= limit) return 0; /* a full frame is buffered: process first */
        if (in->cap - in->len < 4096) {
            size_t cap = in->cap ? in->cap * 2 : 16384;
            if (cap > limit + 65536) cap = limit + 65536;
            if (cap <= in->len) return 0;
            uint8_t *nb = realloc(in->buf, cap);
            if (!nb) return -1;
            in->buf = nb;
            in->cap = cap;
        }
        iov.iov_base = in->buf + in->len;
        iov.iov_len = in->cap - in->len;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cm.buf;
        msg.msg_controllen = sizeof cm.buf;
        n = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return -1;
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            int cnt = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < cnt; i++) {
                int pfd;
                memcpy(&pfd, CMSG_DATA(c) + i * sizeof(int), sizeof pfd);
                if (in->nfds == DC_FRAME_MAX_FDS || n == 0) {
                    close(pfd);
                    continue;
                }
                /* The kernel ends a read at the message that carried fds, so
                 * they belong to the frame holding the last byte read. */
                in->fds[in->nfds].fd = pfd;
                in->fds[in->nfds].pos = in->base + in->len + (uint64_t)n - 1;
                in->nfds++;
            }
        }
        if (n == 0) {
            in->eof = true;
            return 0;
        }
        in->len += (size_t)n;
    }
    return 0;
}

/* Takes the fds that arrived with the frame [start, end) of the stream;
 * fds that arrived with earlier frames were not claimed by them: close. */
static int take_fds(dc_frame_in *in, uint64_t start, uint64_t end, int *out, int max) {
    int n = 0, keep = 0;
    for (int i = 0; i < in->nfds; i++) {
        if (in->fds[i].pos < start) {
            close(in->fds[i].fd);
        } else if (in->fds[i].pos < end) {
            if (n < max) out[n++] = in->fds[i].fd;
            else close(in->fds[i].fd);
        } else {
            in->fds[keep++] = in->fds[i];
        }
    }
    in->nfds = keep;
    return n;
}

bool dc_frame_peek(const dc_frame_in *in, size_t *pos, const uint8_t **payload, uint32_t *len) {
    const size_t at = in->off + *pos;
    if (at > in->len || in->len - at < DC_FRAME_HEADER) return false;
    const uint32_t n = dc_frame_get_len(in->buf + at);
    if (in->len - at - DC_FRAME_HEADER < n) return false;
    *payload = in->buf + at + DC_FRAME_HEADER;
    *len = n;
    *pos += DC_FRAME_HEADER + (size_t)n;
    return true;
}

dc_frame_status dc_frame_next(dc_frame_in *in, uint32_t max, dc_frame *f) {
    uint64_t start;
    uint32_t n;

    if (!dc_frame_started(in)) return DC_FRAME_NONE;
    n = dc_frame_get_len(in->buf + in->off);
    if (n > max) {
        f->len = n;
        f->nfds = 0;
        return DC_FRAME_TOO_LONG;
    }
    if (in->len - in->off - DC_FRAME_HEADER < n) return DC_FRAME_NONE;
    start = in->base + in->off;
    f->payload = in->buf + in->off + DC_FRAME_HEADER;
    f->len = n;
    f->nfds = take_fds(in, start, start + DC_FRAME_HEADER + n, f->fds, DC_FRAME_MAX_FDS);
    in->off += DC_FRAME_HEADER + n;
    return DC_FRAME_OK;
}

void dc_frame_release(dc_frame *f) {
    for (int i = 0; i < f->nfds; i++) close(f->fds[i]);
    f->nfds = 0;
}

void dc_frame_compact(dc_frame_in *in) {
    if (!in->off) return;
    memmove(in->buf, in->buf + in->off, in->len - in->off);
    in->len -= in->off;
    in->base += in->off;
    in->off = 0;
}

void dc_frame_drop(dc_frame_in *in) {
    in->off = in->len;
    dc_frame_compact(in);
}

Dpclip__Request *dc_frame_decode(const dc_frame *f, dc_err *e) {
    Dpclip__Request *req = f->len ? dpclip__request__unpack(NULL, f->len, f->payload) : NULL;
    if (!req) dc_err_set(e, DC_EPROTO, "request", "the frame does not decode as a dpclip.Request");
    return req;
}

dc_req_kind dc_frame_kind(const Dpclip__Request *req) {
    static const dc_req_kind kinds[] = {[DPCLIP__REQUEST__BODY_HELLO] = DC_REQ_HELLO,
                                        [DPCLIP__REQUEST__BODY_REGISTER_BUFFER] = DC_REQ_REGISTER,
                                        [DPCLIP__REQUEST__BODY_RELEASE_BUFFER] = DC_REQ_RELEASE,
                                        [DPCLIP__REQUEST__BODY_CLIP_STEP] = DC_REQ_STEP,
                                        [DPCLIP__REQUEST__BODY_PING] = DC_REQ_PING,
                                        [DPCLIP__REQUEST__BODY_REGISTER_EVENT] = DC_REQ_EVENT,
                                        [DPCLIP__REQUEST__BODY_JOIN_GROUP] = DC_REQ_OTHER};
    unsigned bc = req ? (unsigned)req->body_case : 0;
    return bc < sizeof kinds / sizeof kinds[0] && bc ? kinds[bc] : DC_REQ_OTHER;
}
