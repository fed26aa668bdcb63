/* libFuzzer target: request frames into a real session, in process: frame
 * reading and decoding (daemon/protocol/frame.c), dispatch (session_requests.c), the step
 * cache's fast path (peek.c, session_step.c), validation, the ledger and the
 * CPU backend.
 *
 * One server for the whole run (dc_server_init on a socket in a temporary
 * directory, one CPU worker, in-memory ledger, no status socket); each input
 * is one connection to it, driven by running the loop here until the daemon
 * has closed it.
 *
 * Input: a flags byte, then frame payloads separated by FZ_SEP (so that
 * bytes inserted into one leave the others whole; tests/fuzz/frame.dict
 * has it, and the wire's tags and varints, for libFuzzer's -dict).
 *   FZ_NO_PREAMBLE: the input's frames are the first the session sees; else
 *     they follow a Hello (id 1, job "fuzz") and the registration of a
 *     16 KiB sealed memfd (id 2), which becomes buffer 1.
 *   FZ_FILL: that buffer holds the input's bytes over and over (NaNs, bad
 *     indices, ...), else zeros.
 *
 * Oracles, besides the sanitizers (a failure aborts: a crash for libFuzzer):
 *   - every frame the cache's fast path would take (dc_peek_step_key)
 *     decodes, with protobuf-c, to the id it read and to the same ClipStep
 *     as its clip_step field alone, or fails to decode in both forms, and
 *     reads as a clip_step to dc_peek_body;
 *   - one reply per frame, in order, with the id protobuf-c decodes from the
 *     frame; a frame that does not decode gets a PROTOCOL error with id 0;
 *     a Hello of another protocol version ends the session after its reply. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "dc_frame.h"
#include "dpclip.pb-c.h"
#include "peek.h"
#include "server.h"

#define FZ_NO_PREAMBLE 0x01u
#define FZ_FILL 0x02u
#define FZ_SEP "\xde\xc0\xad\xde"
#define FZ_SEP_LEN 4u
#define FZ_MAX_FRAMES 64
#define FZ_BUFFER_BYTES (16u << 10)

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uv_loop_t g_loop;
static dc_server g_srv;
static dc_config g_cfg;
static char g_dir[64];

static void fz_fail(const char *what, size_t frame) {
    fprintf(stderr, "fuzz_frame: frame %zu: %s\n", frame, what);
    abort();
}

static void fz_cleanup(void) {
    unlink(g_cfg.socket);
    rmdir(g_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    dc_err err;
    (void)argc;
    (void)argv;
    snprintf(g_dir, sizeof g_dir, "%s/dpclip-fuzz-XXXXXX",
             getenv("TMPDIR") && strlen(getenv("TMPDIR")) < 32 ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_dir)) {
        perror("fuzz_frame: mkdtemp");
        abort();
    }
    dc_config_defaults(&g_cfg);
    snprintf(g_cfg.socket, sizeof g_cfg.socket, "%s/d.sock", g_dir);
    snprintf(g_cfg.status_socket, sizeof g_cfg.status_socket, "none");
    g_cfg.workers = 1;
    g_cfg.blas_threads = 1;
    g_cfg.spin_us = 0;
    g_cfg.gpu = false;
    g_cfg.max_batch = 64;
    g_cfg.max_layers = 16;
    g_cfg.ledger_dir[0] = '\0';
    g_cfg.fixed_seed = true;
    g_cfg.seed = 1;
    g_cfg.log_level = DC_LOG_ERROR;
    dc_log_set_level(DC_LOG_ERROR);
    atexit(fz_cleanup);
    if (uv_loop_init(&g_loop) || dc_server_init(&g_srv, &g_loop, &g_cfg, NULL, NULL, &err)) {
        fprintf(stderr, "fuzz_frame: cannot start the server: %s\n", err.msg);
        abort();
    }
    return 0;
}

/* --- the client side -------------------------------------------------------- */

typedef struct fz_bytes {
    uint8_t *p;
    size_t n, cap;
} fz_bytes;

static void fz_put(fz_bytes *b, const void *p, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = (b->n + n) * 2;
        uint8_t *q = realloc(b->p, cap);
        if (!q) abort();
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}

static void fz_put_frame(fz_bytes *b, const uint8_t *p, size_t n) {
    uint8_t hdr[DC_FRAME_HEADER];
    dc_frame_put_len(hdr, (uint32_t)n);
    fz_put(b, hdr, sizeof hdr);
    fz_put(b, p, n);
}

static void fz_put_request(fz_bytes *b, const Dpclip__Request *req) {
    size_t n = dpclip__request__get_packed_size(req);
    uint8_t *p = malloc(n ? n : 1);
    if (!p) abort();
    dpclip__request__pack(req, p);
    fz_put_frame(b, p, n);
    free(p);
}

static void fz_send_all(int fd, const uint8_t *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) abort();
        p += w;
        n -= (size_t)w;
    }
}

/* Bytes [0, n) of the stream go with fd attached to their first byte. */
static void fz_send_with_fd(int fd, const uint8_t *p, size_t n, int pass) {
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } cm;
    struct iovec iov = {(void *)p, n};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.b, .msg_controllen = sizeof cm.b};
    struct cmsghdr *h = CMSG_FIRSTHDR(&msg);
    ssize_t w;
    memset(&cm, 0, sizeof cm);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(h), &pass, sizeof(int));
    do w = sendmsg(fd, &msg, MSG_NOSIGNAL);
    while (w < 0 && errno == EINTR);
    if (w <= 0) abort();
    fz_send_all(fd, p + w, n - (size_t)w);
}

/* Hello, then the registration of a memfd (its bytes: the input repeated,
 * or zeros), sent with the fd. */
static void fz_preamble(int fd, const uint8_t *data, size_t size, int fill) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Hello hello = DPCLIP__HELLO__INIT;
    Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
    fz_bytes b = {0};
    int mfd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    uint8_t *m;

    if (mfd < 0 || ftruncate(mfd, FZ_BUFFER_BYTES) || fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK))
        abort();
    if (fill && size) {
        m = mmap(NULL, FZ_BUFFER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
        if (m == MAP_FAILED) abort();
        for (size_t i = 0; i < FZ_BUFFER_BYTES; i++) m[i] = data[i % size];
        munmap(m, FZ_BUFFER_BYTES);
    }
    hello.protocol_version = DC_PROTOCOL_VERSION;
    hello.client_name = "fuzz";
    hello.job_id = "fuzz";
    req.id = 1;
    req.body_case = DPCLIP__REQUEST__BODY_HELLO;
    req.hello = &hello;
    fz_put_request(&b, &req);
    fz_send_all(fd, b.p, b.n);
    b.n = 0;
    rb.kind = DPCLIP__BUFFER_KIND__SHM_FD;
    rb.size = FZ_BUFFER_BYTES;
    req.id = 2;
    req.body_case = DPCLIP__REQUEST__BODY_REGISTER_BUFFER;
    req.register_buffer = &rb;
    fz_put_request(&b, &req);
    fz_send_with_fd(fd, b.p, b.n, mfd);
    close(mfd);
    free(b.p);
}

/* Sends out (then ends the stream) while running the loop, until the daemon
 * has closed the connection and freed the session; what it sent is
 * appended to *in. Nothing here blocks: the daemon reads as we write. */
static void fz_drive(int fd, const fz_bytes *out, fz_bytes *in) {
    size_t sent = 0;
    int eof = 0, shut = 0;
    uint8_t buf[4096];
    while (!eof || g_srv.n_sessions) {
        if (sent < out->n) {
            ssize_t w = send(fd, out->p + sent, out->n - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (w > 0) sent += (size_t)w;
            else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                sent = out->n; /* the daemon closed: the rest goes nowhere */
        }
        if (sent == out->n && !shut) {
            shutdown(fd, SHUT_WR);
            shut = 1;
        }
        uv_run(&g_loop, UV_RUN_ONCE);
        while (!eof) {
            ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            if (r > 0) fz_put(in, buf, (size_t)r);
            else if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) eof = 1;
            else break;
        }
    }
}

/* --- the oracles ---------------------------------------------------------- */

static uint8_t *fz_pack_step(const Dpclip__ClipStep *m, size_t *n) {
    uint8_t *p;
    *n = dpclip__clip_step__get_packed_size(m);
    if (!(p = malloc(*n ? *n : 1))) abort();
    dpclip__clip_step__pack(m, p);
    return p;
}

/* What the fast path reads from a frame must be what protobuf-c decodes. */
static void fz_check_wire(const uint8_t *p, size_t n, const Dpclip__Request *req, size_t frame) {
    uint64_t id;
    size_t k, na, nb;
    Dpclip__Request *alone;
    uint8_t *a, *b;

    const uint32_t body = dc_peek_body(p, n); /* the stall log's reading: in bounds */
    if (!dc_peek_step_key(p, n, &id, &k)) return;
    if (k >= n || p[k] != DC_WIRE_TAG_CLIP_STEP) fz_fail("the key is not a clip_step field", frame);
    if (body != DC_WIRE_BODY_CLIP_STEP) fz_fail("a keyed frame peeks as another request", frame);
    alone = dpclip__request__unpack(NULL, n - k, p + k);
    if (!req != !alone) fz_fail("the key decodes alone but not in its frame, or back", frame);
    if (req) {
        if (req->id != id) fz_fail("the fast path reads another id than protobuf-c", frame);
        if (req->body_case != DPCLIP__REQUEST__BODY_CLIP_STEP ||
            alone->body_case != DPCLIP__REQUEST__BODY_CLIP_STEP || alone->id != 0)
            fz_fail("a keyed frame that is not one ClipStep", frame);
        a = fz_pack_step(req->clip_step, &na);
        b = fz_pack_step(alone->clip_step, &nb);
        if (na != nb || memcmp(a, b, na) != 0)
            fz_fail("the same key decodes to different steps", frame);
        free(a);
        free(b);
    }
    if (alone) dpclip__request__free_unpacked(alone, NULL);
}

/* DPCLIP_FUZZ_TRACE=1: each frame and its reply on stderr (to read what an
 * input does, e.g. a crash's). */
static void fz_trace(size_t i, const Dpclip__Request *req, const Dpclip__Reply *r) {
    static int on = -1;
    if (on < 0) on = getenv("DPCLIP_FUZZ_TRACE") && getenv("DPCLIP_FUZZ_TRACE")[0] == '1';
    if (!on) return;
    fprintf(stderr, "frame %zu: %s %llu (body %d) -> reply %llu: body %d", i,
            req ? "request" : "undecodable", req ? (unsigned long long)req->id : 0ull,
            req ? (int)req->body_case : -1, (unsigned long long)r->id, (int)r->body_case);
    if (r->body_case == DPCLIP__REPLY__BODY_ERROR)
        fprintf(stderr, ", error %d %s: %s", (int)r->error->code, r->error->field,
                r->error->message);
    fputc('\n', stderr);
}

/* The replies in *in against the frames sent. */
static void fz_check_replies(const fz_bytes *in, int preamble, const uint8_t *const *fp,
                             const size_t *fn, size_t nframes) {
    size_t off = 0, k = 0;
    int hello = preamble, ended = 0;
    Dpclip__Reply *r;

    for (size_t i = 0; i < (preamble ? 2u : 0u) + nframes && !ended; i++) {
        size_t f = i - (preamble ? 2u : 0u); /* the input's frame, when i >= 2 */
        Dpclip__Request *req = NULL;
        uint32_t len;

        if (in->n - off < DC_FRAME_HEADER) fz_fail("a request got no reply", i);
        len = dc_frame_get_len(in->p + off);
        if (in->n - off - DC_FRAME_HEADER < len) fz_fail("a reply frame is cut short", i);
        r = dpclip__reply__unpack(NULL, len, in->p + off + DC_FRAME_HEADER);
        off += DC_FRAME_HEADER + len;
        k++;
        if (!r) fz_fail("a reply that does not decode", i);
        if (preamble && i < 2) {
            if (r->id != i + 1 ||
                r->body_case !=
                    (i ? DPCLIP__REPLY__BODY_REGISTER_BUFFER : DPCLIP__REPLY__BODY_HELLO) ||
                (i && r->register_buffer->buffer_id != 1))
                fz_fail("the preamble failed", i);
            dpclip__reply__free_unpacked(r, NULL);
            continue;
        }
        if (fn[f]) req = dpclip__request__unpack(NULL, fn[f], fp[f]);
        fz_trace(i, req, r);
        fz_check_wire(fp[f], fn[f], req, i);
        if (!req) {
            if (r->id != 0 || r->body_case != DPCLIP__REPLY__BODY_ERROR ||
                r->error->code != DPCLIP__ERROR_CODE__PROTOCOL)
                fz_fail("a frame that does not decode was not refused as PROTOCOL, id 0", i);
        } else {
            if (r->id != req->id) fz_fail("a reply carries another id than its request", i);
            if (req->body_case == DPCLIP__REQUEST__BODY_HELLO && !hello) {
                if (req->hello->protocol_version != DC_PROTOCOL_VERSION) ended = 1;
                else hello = 1;
            } else if (!hello && r->body_case != DPCLIP__REPLY__BODY_ERROR) {
                fz_fail("served before the handshake", i);
            }
            dpclip__request__free_unpacked(req, NULL);
        }
        if (r->body_case == DPCLIP__REPLY__BODY_ERROR && (!r->error->message[0] || !r->error->code))
            fz_fail("an error without a code or message", i);
        dpclip__reply__free_unpacked(r, NULL);
    }
    if (off != in->n) fz_fail("more replies than requests", k);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *fp[FZ_MAX_FRAMES];
    size_t fn[FZ_MAX_FRAMES], nframes = 0;
    const uint8_t *p, *end = data + size;
    fz_bytes out = {0}, in = {0};
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    dc_err err;
    int fd, preamble;

    if (size < 1) return 0;
    preamble = !(data[0] & FZ_NO_PREAMBLE);
    for (p = data + 1; nframes < FZ_MAX_FRAMES;) {
        const uint8_t *sep = memmem(p, (size_t)(end - p), FZ_SEP, FZ_SEP_LEN);
        if (!sep) sep = end;
        if (sep == end && p == end && nframes) break; /* a separator at the end */
        fp[nframes] = p;
        fn[nframes++] = (size_t)(sep - p);
        if (sep == end) break;
        p = sep + FZ_SEP_LEN;
    }

    /* Buffer ids are daemon-wide; restarting them keeps inputs independent
     * (the last input's session is gone, so no id can alias). */
    g_srv.next_buffer_id = 0;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", g_cfg.socket);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa)) abort();
    if (preamble) fz_preamble(fd, data, size, data[0] & FZ_FILL);
    for (size_t i = 0; i < nframes; i++) fz_put_frame(&out, fp[i], fn[i]);
    fz_drive(fd, &out, &in);
    close(fd);
    fz_check_replies(&in, preamble, fp, fn, nframes);
    free(out.p);
    free(in.p);
    /* A fresh ledger per input: a budget one input lowered must not refuse
     * the next one's steps. */
    dc_ledger_close(&g_srv.ledger);
    if (dc_ledger_open(&g_srv.ledger, "", g_cfg.delta, &err)) abort();
    return 0;
}
