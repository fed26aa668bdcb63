/* daemon/protocol/frame.c: a connection's bytes cut into whole frames, whatever the
 * reads they arrive in; the descriptors passed with a frame's bytes go with
 * that frame and no other; a frame over the maximum is reported, not
 * buffered; descriptors no frame claims are closed; a frame decodes into a
 * dpclip.Request or is refused naming "request"; frames buffered can be
 * looked at without being taken. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "dc_frame.h"
#include "dpclip.pb-c.h"
#include "frame.h"
#include "peek.h"

/* Open descriptors of this process (a leak shows as a larger count). */
static int open_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    assert_non_null(d);
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

static void pair(int sv[2]) {
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    assert_int_equal(fcntl(sv[1], F_SETFL, fcntl(sv[1], F_GETFL) | O_NONBLOCK), 0);
}

/* Writes n bytes to the socket, with fds attached when nfd > 0. */
static void send_bytes(int fd, const void *p, size_t n, const int *fds, int nfd) {
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int) * 32)];
    } cm;
    struct iovec iov = {(void *)p, n};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    memset(&cm, 0, sizeof cm);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (nfd > 0) {
        struct cmsghdr *c;
        msg.msg_control = cm.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfd);
        c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfd);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfd);
    }
    assert_int_equal(sendmsg(fd, &msg, MSG_NOSIGNAL), (ssize_t)n);
}

/* A frame of `len` payload bytes, each byte its offset plus `seed`. */
static size_t make_frame(uint8_t *out, uint32_t len, uint8_t seed) {
    dc_frame_put_len(out, len);
    for (uint32_t i = 0; i < len; i++) out[DC_FRAME_HEADER + i] = (uint8_t)(i + seed);
    return DC_FRAME_HEADER + len;
}

static void assert_payload(const dc_frame *f, uint32_t len, uint8_t seed) {
    assert_int_equal(f->len, len);
    for (uint32_t i = 0; i < len; i++) assert_int_equal(f->payload[i], (uint8_t)(i + seed));
}

/* A frame written a few bytes at a time is whole only once its last byte
 * is read; two frames in one write are two frames. */
static void test_split_frames(void **state) {
    (void)state;
    int sv[2];
    dc_frame_in in;
    dc_frame f;
    uint8_t buf[3 * (DC_FRAME_HEADER + 300)];
    size_t n1, n2, n3;

    pair(sv);
    dc_frame_in_init(&in);
    n1 = make_frame(buf, 300, 1);
    /* three bytes: not even the length yet */
    send_bytes(sv[0], buf, 3, NULL, 0);
    assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);
    assert_false(dc_frame_started(&in));
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_NONE);
    /* the length and part of the payload */
    send_bytes(sv[0], buf + 3, 100, NULL, 0);
    assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);
    assert_true(dc_frame_started(&in));
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_NONE);
    assert_int_equal(dc_frame_buffered(&in), 103);
    /* the rest, and two more frames in the same write */
    n2 = make_frame(buf + n1, 0, 0);
    n3 = make_frame(buf + n1 + n2, 17, 9);
    send_bytes(sv[0], buf + 103, n1 + n2 + n3 - 103, NULL, 0);
    assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_OK);
    assert_payload(&f, 300, 1);
    assert_int_equal(f.nfds, 0);
    dc_frame_release(&f);
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_OK);
    assert_int_equal(f.len, 0);
    dc_frame_release(&f);
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_OK);
    assert_payload(&f, 17, 9);
    dc_frame_release(&f);
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_NONE);
    assert_int_equal(dc_frame_buffered(&in), 0);
    dc_frame_compact(&in);
    assert_int_equal(in.len, 0);
    assert_int_equal(in.base, n1 + n2 + n3);
    assert_false(in.eof);

    /* the peer ends in the middle of a frame: the bytes stay, eof is set */
    send_bytes(sv[0], buf, 10, NULL, 0);
    close(sv[0]);
    assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);
    assert_true(in.eof);
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_NONE);
    assert_int_equal(dc_frame_buffered(&in), 10);
    dc_frame_in_free(&in);
    close(sv[1]);
}

/* The frames buffered can be looked at without being taken (the stall
 * log's dc_frame_peek): each whole one in order, none that is not whole;
 * dc_peek_body says which request each is, past an optional id. */
static void test_peek_frames(void **state) {
    (void)state;
    int sv[2];
    dc_frame_in in;
    dc_frame f;
    uint8_t buf[64];
    const uint8_t *p;
    uint32_t len;
    size_t pos = 0, n = 0;
    /* [id 5] clip_step {}; ping {} without an id; then half a frame */
    static const uint8_t step[] = {0x08, 0x05, 0x6a, 0x00}, ping[] = {0x72, 0x00};
    dc_frame_put_len(buf, sizeof step);
    memcpy(buf + DC_FRAME_HEADER, step, sizeof step);
    n = DC_FRAME_HEADER + sizeof step;
    dc_frame_put_len(buf + n, sizeof ping);
    memcpy(buf + n + DC_FRAME_HEADER, ping, sizeof ping);
    n += DC_FRAME_HEADER + sizeof ping;
    n += make_frame(buf + n, 20, 3) - 10; /* its last 10 bytes not sent */
    pair(sv);
    dc_frame_in_init(&in);
    send_bytes(sv[0], buf, n, NULL, 0);
    assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);
    assert_true(dc_frame_peek(&in, &pos, &p, &len));
    assert_int_equal(len, sizeof step);
    assert_int_equal(dc_peek_body(p, len), DC_WIRE_BODY_CLIP_STEP);
    assert_true(dc_frame_peek(&in, &pos, &p, &len));
    assert_int_equal(dc_peek_body(p, len), DC_WIRE_BODY_PING);
    assert_string_equal(dc_wire_body_name(dc_peek_body(p, len)), "ping");
    assert_false(dc_frame_peek(&in, &pos, &p, &len)); /* not whole */
    /* nothing was taken: the first frame is still next */
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_OK);
    assert_int_equal(f.len, sizeof step);
    dc_frame_release(&f);
    pos = 0;
    assert_true(dc_frame_peek(&in, &pos, &p, &len));
    assert_int_equal(dc_peek_body(p, len), DC_WIRE_BODY_PING);
    /* no body, an id alone, an id whose varint does not end */
    static const uint8_t id_only[] = {0x08, 0x01}, bad[] = {0x08, 0xff, 0xff};
    assert_int_equal(dc_peek_body(id_only, 0), DC_WIRE_BODY_NONE);
    assert_int_equal(dc_peek_body(id_only, sizeof id_only), DC_WIRE_BODY_NONE);
    assert_int_equal(dc_peek_body(bad, sizeof bad), DC_WIRE_BODY_NONE);
    assert_string_equal(dc_wire_body_name(99), "request");
    dc_frame_in_free(&in);
    close(sv[0]);
    close(sv[1]);
}

/* A frame longer than the maximum is reported with its length as soon as
 * the length is read, not buffered; one exactly at it is whole. */
static void test_oversize_frame(void **state) {
    (void)state;
    int sv[2];
    dc_frame_in in;
    dc_frame f;
    uint8_t hdr[DC_FRAME_HEADER];
    uint8_t *buf = malloc(DC_FRAME_HEADER + 4096);

    assert_non_null(buf);
    pair(sv);
    dc_frame_in_init(&in);
    send_bytes(sv[0], buf, make_frame(buf, 4096, 3), NULL, 0);
    assert_int_equal(dc_frame_read(&in, sv[1], 4096 + DC_FRAME_HEADER), 0);
    assert_int_equal(dc_frame_next(&in, 4096, &f), DC_FRAME_OK);
    assert_payload(&f, 4096, 3);
    dc_frame_release(&f);
    dc_frame_compact(&in);

    dc_frame_put_len(hdr, 4097);
    send_bytes(sv[0], hdr, sizeof hdr, NULL, 0);
    assert_int_equal(dc_frame_read(&in, sv[1], 4096 + DC_FRAME_HEADER), 0);
    assert_int_equal(dc_frame_next(&in, 4096, &f), DC_FRAME_TOO_LONG);
    assert_int_equal(f.len, 4097);
    /* under a larger maximum the same bytes are a frame still to come */
    assert_int_equal(dc_frame_next(&in, 8192, &f), DC_FRAME_NONE);
    dc_frame_drop(&in);
    assert_int_equal(dc_frame_buffered(&in), 0);
    dc_frame_in_free(&in);
    close(sv[0]);
    close(sv[1]);
    free(buf);
}

/* Reading stops once `limit` bytes are buffered: a client cannot make the
 * daemon buffer more than a frame's worth ahead of processing. */
static void test_read_limit(void **state) {
    (void)state;
    int sv[2];
    dc_frame_in in;
    static uint8_t buf[64 * 1024];

    pair(sv);
    dc_frame_in_init(&in);
    memset(buf, 0x55, sizeof buf);
    send_bytes(sv[0], buf, sizeof buf, NULL, 0);
    assert_int_equal(dc_frame_read(&in, sv[1], 1000), 0);
    assert_true(dc_frame_buffered(&in) >= 1000);
    assert_true(dc_frame_buffered(&in) < sizeof buf);
    dc_frame_in_free(&in);
    close(sv[0]);
    close(sv[1]);
}

static bool same_file(int a, int b) {
    struct stat sa, sb;
    assert_int_equal(fstat(a, &sa), 0);
    assert_int_equal(fstat(b, &sb), 0);
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* Descriptors go with the frame whose bytes they came with: not the frame
 * before, not the one after. Those that came with a frame the reader
 * dropped, or with bytes no whole frame holds, are closed, never leaked. */
static void test_fds_follow_their_frame(void **state) {
    (void)state;
    int sv[2], fd_a, fd_b, base;
    dc_frame_in in;
    dc_frame f;
    uint8_t buf[3 * (DC_FRAME_HEADER + 8)];
    size_t n1, n2, n3;
    char tmpl[] = "/tmp/dpclip-frame-XXXXXX";

    base = open_fds();
    fd_a = mkstemp(tmpl);
    assert_true(fd_a >= 0);
    unlink(tmpl);
    fd_b = open("/dev/null", O_RDONLY | O_CLOEXEC);
    assert_true(fd_b >= 0);
    pair(sv);
    dc_frame_in_init(&in);
    n1 = make_frame(buf, 8, 0);
    n2 = make_frame(buf + n1, 8, 1);
    n3 = make_frame(buf + n1 + n2, 8, 2);
    send_bytes(sv[0], buf, n1, NULL, 0);           /* frame 1: none */
    send_bytes(sv[0], buf + n1, n2, &fd_a, 1);     /* frame 2: fd_a */
    send_bytes(sv[0], buf + n1 + n2, n3, NULL, 0); /* frame 3: none */
    for (int i = 0; i < 3; i++) assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);

    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_OK);
    assert_payload(&f, 8, 0);
    assert_int_equal(f.nfds, 0);
    dc_frame_release(&f);
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_OK);
    assert_payload(&f, 8, 1);
    assert_int_equal(f.nfds, 1);
    assert_true(same_file(f.fds[0], fd_a));
    dc_frame_release(&f); /* closes the frame's copy */
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_OK);
    assert_payload(&f, 8, 2);
    assert_int_equal(f.nfds, 0);
    dc_frame_release(&f);
    dc_frame_compact(&in);

    /* fds with half a frame whose connection then ends: nothing takes
     * them; freeing the reader closes them */
    send_bytes(sv[0], buf, 6, &fd_b, 1);
    close(sv[0]);
    assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);
    assert_true(in.eof);
    assert_int_equal(in.nfds, 1);
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_NONE);
    dc_frame_in_free(&in);
    close(sv[1]);
    close(fd_a);
    close(fd_b);
    assert_int_equal(open_fds(), base);
}

/* fds of a frame that is then dropped (a reader at its end, or a frame
 * over the maximum) do not go to the next frame read. */
static void test_fds_of_dropped_bytes(void **state) {
    (void)state;
    int sv[2], fd_a, base;
    dc_frame_in in;
    dc_frame f;
    uint8_t hdr[DC_FRAME_HEADER], buf[DC_FRAME_HEADER + 8];

    base = open_fds();
    fd_a = open("/dev/null", O_RDONLY | O_CLOEXEC);
    assert_true(fd_a >= 0);
    pair(sv);
    dc_frame_in_init(&in);
    dc_frame_put_len(hdr, 1000);
    send_bytes(sv[0], hdr, sizeof hdr, &fd_a, 1);
    assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);
    assert_int_equal(dc_frame_next(&in, 100, &f), DC_FRAME_TOO_LONG);
    dc_frame_drop(&in);
    dc_frame_compact(&in);
    send_bytes(sv[0], buf, make_frame(buf, 8, 5), NULL, 0);
    assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);
    assert_int_equal(dc_frame_next(&in, 100, &f), DC_FRAME_OK);
    assert_payload(&f, 8, 5);
    assert_int_equal(f.nfds, 0); /* fd_a came with the dropped bytes */
    assert_int_equal(in.nfds, 0);
    dc_frame_release(&f);
    dc_frame_in_free(&in);
    close(sv[0]);
    close(sv[1]);
    close(fd_a);
    assert_int_equal(open_fds(), base);
}

/* More descriptors than a frame may carry: the reader keeps at most
 * DC_FRAME_MAX_FDS, and every one is closed in the end. */
static void test_too_many_fds(void **state) {
    (void)state;
    int sv[2], fds[DC_FRAME_MAX_FDS + 4], base;
    dc_frame_in in;
    dc_frame f;
    uint8_t buf[DC_FRAME_HEADER + 4];

    base = open_fds();
    for (int i = 0; i < DC_FRAME_MAX_FDS + 4; i++) {
        fds[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
        assert_true(fds[i] >= 0);
    }
    pair(sv);
    dc_frame_in_init(&in);
    send_bytes(sv[0], buf, make_frame(buf, 4, 0), fds, DC_FRAME_MAX_FDS + 4);
    assert_int_equal(dc_frame_read(&in, sv[1], 1 << 20), 0);
    assert_int_equal(dc_frame_next(&in, 1 << 20, &f), DC_FRAME_OK);
    assert_true(f.nfds >= 1);
    assert_true(f.nfds <= DC_FRAME_MAX_FDS);
    dc_frame_release(&f);
    dc_frame_in_free(&in);
    close(sv[0]);
    close(sv[1]);
    for (int i = 0; i < DC_FRAME_MAX_FDS + 4; i++) close(fds[i]);
    assert_int_equal(open_fds(), base);
}

/* A frame's payload decodes into a Request, and the metrics' kind is that
 * of its body; bytes that are no Request are refused naming "request". */
static void test_decode(void **state) {
    (void)state;
    Dpclip__Request req = DPCLIP__REQUEST__INIT, *got;
    Dpclip__Ping ping = DPCLIP__PING__INIT;
    uint8_t buf[64];
    static const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                   0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
    dc_frame f;
    dc_err e;

    memset(&f, 0, sizeof f);
    req.id = 42;
    req.body_case = DPCLIP__REQUEST__BODY_PING;
    req.ping = &ping;
    ping.nonce = 7;
    f.len = (uint32_t)dpclip__request__pack(&req, buf);
    f.payload = buf;
    got = dc_frame_decode(&f, &e);
    assert_non_null(got);
    assert_int_equal(got->id, 42);
    assert_int_equal(got->body_case, DPCLIP__REQUEST__BODY_PING);
    assert_int_equal(got->ping->nonce, 7);
    assert_int_equal(dc_frame_kind(got), DC_REQ_PING);
    dpclip__request__free_unpacked(got, NULL);

    /* an id and no body: decodes; its kind is OTHER */
    req.body_case = DPCLIP__REQUEST__BODY__NOT_SET;
    f.len = (uint32_t)dpclip__request__pack(&req, buf);
    got = dc_frame_decode(&f, &e);
    assert_non_null(got);
    assert_int_equal(got->id, 42);
    assert_int_equal(dc_frame_kind(got), DC_REQ_OTHER);
    dpclip__request__free_unpacked(got, NULL);

    f.payload = junk;
    f.len = sizeof junk;
    assert_null(dc_frame_decode(&f, &e));
    assert_int_equal(e.code, DC_EPROTO);
    assert_string_equal(e.field, "request");
    assert_int_equal(dc_frame_kind(NULL), DC_REQ_OTHER);

    /* an empty frame is no request either */
    f.len = 0;
    assert_null(dc_frame_decode(&f, &e));
    assert_int_equal(e.code, DC_EPROTO);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_split_frames),           cmocka_unit_test(test_peek_frames),
        cmocka_unit_test(test_oversize_frame),         cmocka_unit_test(test_read_limit),
        cmocka_unit_test(test_fds_follow_their_frame), cmocka_unit_test(test_fds_of_dropped_bytes),
        cmocka_unit_test(test_too_many_fds),           cmocka_unit_test(test_decode),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
