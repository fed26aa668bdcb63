/* Hostile input: while one well-behaved client keeps running steps (each
 * checked against the reference), other connections send broken frames,
 * undecodable or out-of-order requests, references to memory they do not
 * own, impossible shapes, bad data, and vanish mid-step. Each must get an
 * Error naming the field (docs/protocol.md) or be closed; the good client's
 * results must stay exact and the daemon must keep serving. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "dc_frame.h"
#include "harness.h"

#define MAX_BATCH 64
#define MAX_FRAME 65536

static dc_harness g_h;
/* The attacks' clipping config: sum reduction, no noise. */
static const dpclip_clip_config k_sum = {.max_grad_norm = 1.0f, .reduction = DPCLIP_SUM};

/* --- the well-behaved client ---------------------------------------------- */

static pthread_t g_good;
static atomic_int g_stop;
static atomic_int g_good_ok, g_good_bad, g_good_failed;
static atomic_ullong g_good_buf;   /* its buffer id, for the foreign-id test */
static char g_good_why[256];

static void *good_client(void *arg) {
    (void)arg;
    const uint32_t B = 8;
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f, .reduction = DPCLIP_MEAN};
    dc_test_layer_spec lin = {DC_LAYER_LINEAR, B, 5, 12, 8, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec emb = {DC_LAYER_EMBEDDING, B, 5, 6, 17, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec ln = {DC_LAYER_LAYERNORM, B, 5, 12, 0, DC_BF16, 1, DC_ALGO_AUTO, 1, 0};
    dpclip_client *c = NULL;
    dc_test_rng r;
    dc_shm_step s;

    dc_test_rng_seed(&r, 4242);
    if (dpclip_connect(g_h.sock, NULL, &c) || dc_shm_step_init(&s, c, 1u << 20, B, &cfg) ||
        dc_shm_step_add(&s, &lin, &r, 1.0f) < 0 || dc_shm_step_add(&s, &emb, &r, 1.0f) < 0 ||
        dc_shm_step_add(&s, &ln, &r, 1.0f) < 0 || dc_shm_step_add_outputs(&s, 1, 1)) {
        snprintf(g_good_why, sizeof g_good_why, "setup: %s", dpclip_errmsg(c));
        g_good_failed++;
        atomic_store(&g_good_buf, 1); /* unblock the waiter */
        dpclip_disconnect(c);
        return NULL;
    }
    cfg.max_grad_norm = (float)dc_shm_step_median_norm(&s);
    dc_shm_step_set_config(&s, &cfg);
    atomic_store(&g_good_buf, s.buf_id);
    while (!atomic_load(&g_stop)) {
        dpclip_result res;
        dc_shm_step_refill(&s, &r);
        if (dpclip_run(c, s.step, &res)) {
            snprintf(g_good_why, sizeof g_good_why, "run: %s", dpclip_errmsg(c));
            g_good_failed++;
            break;
        }
        if (dc_shm_step_check(&s, &res, dc_test_rtol(DC_BF16), 1e-7) > 1.0) g_good_bad++;
        else g_good_ok++;
        dpclip_result_free(&res);
    }
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    return NULL;
}

static int group_setup(void **state) {
    (void)state;
    char args[128];
    snprintf(args, sizeof args, "--workers 2 --max-batch %d --max-frame %d", MAX_BATCH, MAX_FRAME);
    if (dc_harness_start(&g_h, args)) return -1;
    if (pthread_create(&g_good, NULL, good_client, NULL)) return -1;
    while (!atomic_load(&g_good_buf)) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

static int group_teardown(void **state) {
    (void)state;
    if (!atomic_load(&g_stop)) { /* a test failed before stopping it */
        atomic_store(&g_stop, 1);
        pthread_join(g_good, NULL);
    }
    /* normally stopped (and checked) by test_clean_shutdown; this only
     * cleans up after a failure */
    if (g_h.pid) dc_harness_stop(&g_h);
    return 0;
}

/* --- helpers ----------------------------------------------------------------- */

static int raw_hello(void) {
    int fd = dc_raw_connect(g_h.sock);
    assert_true(fd >= 0);
    assert_int_equal(dc_raw_hello(fd, 1), 0);
    return fd;
}

static void send_frame(int fd, uint32_t len, const void *body, size_t n) {
    uint8_t hdr[4];
    dc_frame_put_len(hdr, len);
    assert_int_equal(dc_raw_send(fd, hdr, 4), 0);
    if (n) assert_int_equal(dc_raw_send(fd, body, n), 0);
}

/* Reads one reply and checks it is an Error with `code` whose field
 * contains `field` (NULL: any). */
static void expect_error(int fd, Dpclip__ErrorCode code, const char *field) {
    Dpclip__Reply *r = dc_raw_read_reply(fd, 10000);
    const Dpclip__Error *e = dc_raw_error(r);
    if (!e) fprintf(stderr, "expected an error %d, got %s\n", (int)code, r ? "another reply" : "EOF");
    assert_non_null(e);
    if (e->code != code || (field && !strstr(e->field, field)))
        fprintf(stderr, "got error %d field '%s': %s\n", (int)e->code, e->field, e->message);
    assert_int_equal(e->code, code);
    if (field) assert_non_null(strstr(e->field, field));
    assert_true(strlen(e->message) > 0);
    dpclip__reply__free_unpacked(r, NULL);
}

static void expect_pong(int fd, uint64_t id) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Ping ping = DPCLIP__PING__INIT;
    Dpclip__Reply *r;
    ping.nonce = id * 7;
    req.id = id;
    req.body_case = DPCLIP__REQUEST__BODY_PING;
    req.ping = &ping;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    r = dc_raw_read_reply(fd, 10000);
    assert_non_null(r);
    assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_PONG);
    assert_int_equal(r->id, id);
    assert_int_equal(r->pong->nonce, id * 7);
    dpclip__reply__free_unpacked(r, NULL);
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static dpclip_client *lib_connect(void) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "hostile"};
    assert_int_equal(dpclip_connect(g_h.sock, &o, &c), 0);
    return c;
}

/* A linear step on buffer `buf`: activations [B,T,d] at 0, grads [B,T,p]
 * right after; callers then break one thing. */
typedef struct lin_desc {
    uint32_t B;
    dpclip_linear l;
} lin_desc;

static lin_desc lin_on(uint64_t buf, uint32_t B, int64_t T, int64_t d, int64_t p) {
    lin_desc x;
    memset(&x, 0, sizeof x);
    x.B = B;
    x.l.name = "victim";
    x.l.activations = (dpclip_tensor){buf, 0, DPCLIP_F32, 3, {B, T, d}};
    x.l.output_grad = (dpclip_tensor){buf, (uint64_t)(B * T * d * 4), DPCLIP_F32, 3, {B, T, p}};
    return x;
}

/* Runs a one-layer step and returns the status; the handle keeps errfield. */
static int run_linear(dpclip_client *c, const lin_desc *x) {
    dpclip_clip_config cfg = k_sum;
    dpclip_step *s = dpclip_step_new(x->B, &cfg);
    dpclip_result res;
    int rc;
    assert_non_null(s);
    assert_int_equal(dpclip_step_add_linear(s, &x->l), 0);
    rc = dpclip_run(c, s, &res);
    dpclip_result_free(&res);
    dpclip_step_free(s);
    return rc;
}

/* --- framing ----------------------------------------------------------------- */

static void test_truncated_frame(void **state) {
    (void)state;
    uint8_t junk[50];
    int fd = raw_hello();
    Dpclip__Reply *r;
    memset(junk, 0x11, sizeof junk);
    send_frame(fd, 100, junk, sizeof junk);
    shutdown(fd, SHUT_WR);
    /* either an Error{PROTOCOL, "frame"} or just the close */
    r = dc_raw_read_reply(fd, 10000);
    if (r) {
        const Dpclip__Error *e = dc_raw_error(r);
        assert_non_null(e);
        assert_int_equal(e->code, DPCLIP__ERROR_CODE__PROTOCOL);
        assert_string_equal(e->field, "frame");
        dpclip__reply__free_unpacked(r, NULL);
    }
    assert_int_equal(dc_raw_wait_eof(fd, 10000), 1);
    close(fd);

    /* half a header, then gone */
    fd = raw_hello();
    assert_int_equal(dc_raw_send(fd, junk, 2), 0);
    close(fd);
}

static void test_frame_too_long(void **state) {
    (void)state;
    int fd = raw_hello();
    send_frame(fd, MAX_FRAME + 1, NULL, 0);
    expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "frame.length");
    assert_int_equal(dc_raw_wait_eof(fd, 10000), 1); /* the stream cannot resync */
    close(fd);
    /* also before the handshake, and with the largest length there is */
    fd = dc_raw_connect(g_h.sock);
    assert_true(fd >= 0);
    send_frame(fd, UINT32_MAX, NULL, 0);
    expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "frame.length");
    assert_int_equal(dc_raw_wait_eof(fd, 10000), 1);
    close(fd);
}

static void test_undecodable(void **state) {
    (void)state;
    static const uint8_t bad_varint[] = {0x08, 0xff, 0xff};          /* truncated varint */
    static const uint8_t bad_wiretype[] = {0x0f, 0x01, 0x02, 0x03};  /* wire type 7 */
    static const uint8_t bad_len[] = {0x6a, 0x7f, 0x08};             /* clip_step longer than the frame */
    int fd = raw_hello();
    send_frame(fd, sizeof bad_varint, bad_varint, sizeof bad_varint);
    expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    send_frame(fd, sizeof bad_wiretype, bad_wiretype, sizeof bad_wiretype);
    expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    send_frame(fd, sizeof bad_len, bad_len, sizeof bad_len);
    expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    send_frame(fd, 0, NULL, 0); /* N = 0 is an undecodable request */
    expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    expect_pong(fd, 9); /* the connection survives all of them */
    close(fd);
}

static void test_empty_body(void **state) {
    (void)state;
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Reply *r;
    int fd = raw_hello();
    req.id = 77;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    r = dc_raw_read_reply(fd, 10000);
    assert_non_null(dc_raw_error(r));
    assert_int_equal(r->id, 77);
    assert_int_equal(r->error->code, DPCLIP__ERROR_CODE__UNIMPLEMENTED);
    assert_string_equal(r->error->field, "request.body");
    dpclip__reply__free_unpacked(r, NULL);
    expect_pong(fd, 78);
    close(fd);
}

static void test_before_handshake(void **state) {
    (void)state;
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__ClipStep cs = DPCLIP__CLIP_STEP__INIT;
    Dpclip__Ping ping = DPCLIP__PING__INIT;
    Dpclip__Hello hello = DPCLIP__HELLO__INIT;
    int fd = dc_raw_connect(g_h.sock);
    assert_true(fd >= 0);

    cs.batch_size = 4;
    req.id = 5;
    req.body_case = DPCLIP__REQUEST__BODY_CLIP_STEP;
    req.clip_step = &cs;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    expect_error(fd, DPCLIP__ERROR_CODE__FAILED_PRECONDITION, "request");
    req.body_case = DPCLIP__REQUEST__BODY_PING;
    req.ping = &ping;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    expect_error(fd, DPCLIP__ERROR_CODE__FAILED_PRECONDITION, "request");
    /* the connection stays open: the handshake still works */
    assert_int_equal(dc_raw_hello(fd, 6), 0);
    expect_pong(fd, 7);
    /* a second Hello is an error too */
    hello.protocol_version = DC_PROTOCOL_VERSION;
    req.body_case = DPCLIP__REQUEST__BODY_HELLO;
    req.hello = &hello;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    expect_error(fd, DPCLIP__ERROR_CODE__FAILED_PRECONDITION, NULL);
    close(fd);

    /* a protocol version from the future: refused, then closed */
    fd = dc_raw_connect(g_h.sock);
    assert_true(fd >= 0);
    hello.protocol_version = DC_PROTOCOL_VERSION + 1;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    expect_error(fd, DPCLIP__ERROR_CODE__FAILED_PRECONDITION, "hello.protocol_version");
    assert_int_equal(dc_raw_wait_eof(fd, 10000), 1);
    close(fd);
}

static void test_garbage_stream(void **state) {
    (void)state;
    dc_test_rng r;
    uint8_t *junk = malloc(256 * 1024);
    assert_non_null(junk);
    dc_test_rng_seed(&r, 99);
    for (int round = 0; round < 4; round++) {
        int fd = dc_raw_connect(g_h.sock);
        assert_true(fd >= 0);
        for (size_t i = 0; i < 256 * 1024; i++) junk[i] = (uint8_t)dc_test_next(&r);
        /* small lengths so that several frames parse before a big one */
        junk[0] = 3;
        junk[1] = junk[2] = junk[3] = 0;
        dc_raw_send(fd, junk, 256 * 1024); /* may fail once the daemon closes */
        assert_int_equal(dc_raw_wait_eof(fd, 10000), 1);
        close(fd);
    }
    free(junk);
}

/* --- buffers ------------------------------------------------------------------ */

static void test_register_abuse(void **state) {
    (void)state;
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
    dpclip_client *c = lib_connect();
    uint64_t id;
    int p[2], mfd, fd;

    /* no descriptor attached */
    fd = raw_hello();
    rb.kind = DPCLIP__BUFFER_KIND__SHM_FD;
    rb.size = 4096;
    req.id = 2;
    req.body_case = DPCLIP__REQUEST__BODY_REGISTER_BUFFER;
    req.register_buffer = &rb;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "register_buffer");
    /* a pipe is not shared memory */
    assert_int_equal(pipe(p), 0);
    assert_int_equal(dc_raw_send_request_fd(fd, &req, p[0]), 0);
    expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "register_buffer");
    close(p[0]);
    close(p[1]);
    expect_pong(fd, 3);
    close(fd);

    /* a size beyond the object, a memfd that may still shrink */
    mfd = memfd_create("abuse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(mfd >= 0);
    assert_int_equal(ftruncate(mfd, 4096), 0);
    assert_int_equal(dpclip_buffer_register_fd(c, mfd, 4096, &id), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "register_buffer"));
    assert_int_equal(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    assert_int_equal(dpclip_buffer_register_fd(c, mfd, 1u << 20, &id), DPCLIP_EINVAL);
    assert_string_equal(dpclip_errfield(c), "register_buffer.size");
    close(mfd);
    assert_int_equal(dpclip_ping(c), 0);
    dpclip_disconnect(c);
}

static void test_unregistered_buffer(void **state) {
    (void)state;
    dpclip_client *c = lib_connect();
    lin_desc x = lin_on(987654321, 4, 2, 8, 8);
    assert_int_equal(run_linear(c, &x), DPCLIP_ENOTFOUND);
    assert_true(ends_with(dpclip_errfield(c), "buffer_id"));
    assert_non_null(strstr(dpclip_errfield(c), "activations"));
    dpclip_disconnect(c);
}

static void test_foreign_buffer(void **state) {
    (void)state;
    dpclip_client *c = lib_connect();
    uint64_t theirs = atomic_load(&g_good_buf), mine;
    void *mem;
    lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 1u << 16, &mine, &mem), 0);
    /* another session's id: exactly like an id that never existed */
    x = lin_on(theirs, 2, 2, 4, 4);
    assert_int_equal(run_linear(c, &x), DPCLIP_ENOTFOUND);
    assert_true(ends_with(dpclip_errfield(c), "buffer_id"));
    /* inputs ours, output theirs: still refused before anything is written */
    x = lin_on(mine, 2, 2, 4, 4);
    x.l.weight_grad_out = (dpclip_tensor){theirs, 0, DPCLIP_F32, 2, {4, 4, 0}};
    assert_int_equal(run_linear(c, &x), DPCLIP_ENOTFOUND);
    assert_non_null(strstr(dpclip_errfield(c), "weight_grad_out.buffer_id"));
    /* nor can it be released */
    assert_int_equal(dpclip_buffer_release(c, theirs), DPCLIP_ENOTFOUND);
    assert_string_equal(dpclip_errfield(c), "release_buffer.buffer_id");
    dpclip_disconnect(c);
}

static void test_past_the_end(void **state) {
    (void)state;
    dpclip_client *c = lib_connect();
    uint64_t buf;
    void *mem;
    lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 4096, &buf, &mem), 0);
    x = lin_on(buf, 8, 2, 16, 8);
    x.l.activations.offset = 4000; /* 1 KiB of activations from byte 4000 */
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "activations"));

    x = lin_on(buf, 8, 2, 16, 8);
    x.l.output_grad.offset = 4096 - 8; /* just past the end */
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "output_grad"));

    /* offset + size wrapping around 2^64 */
    x = lin_on(buf, 8, 2, 16, 8);
    x.l.activations.offset = UINT64_MAX - 63;
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "activations"));

    /* an output past the end */
    x = lin_on(buf, 8, 2, 16, 8);
    x.l.weight_grad_out = (dpclip_tensor){buf, 4096 - 64, DPCLIP_F32, 2, {8, 16, 0}};
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "weight_grad_out"));

    /* norms_out past the end */
    {
        dpclip_clip_config cfg = k_sum;
        dpclip_step *s = dpclip_step_new(8, &cfg);
        dpclip_tensor no = {buf, 4096 - 16, DPCLIP_F32, 1, {8, 0, 0}};
        dpclip_result res;
        x = lin_on(buf, 8, 1, 8, 8);
        assert_int_equal(dpclip_step_add_linear(s, &x.l), 0);
        assert_int_equal(dpclip_step_set_outputs(s, &no, NULL), 0);
        assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EINVAL);
        assert_non_null(strstr(dpclip_errfield(c), "norms_out"));
        dpclip_step_free(s);
    }
    dpclip_disconnect(c);
}

static void test_shape_overflow(void **state) {
    (void)state;
    dpclip_client *c = lib_connect();
    uint64_t buf;
    void *mem;
    lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 4096, &buf, &mem), 0);
    x = lin_on(buf, 4, 2, 4, 4);
    x.l.activations.shape[1] = (int64_t)1 << 32;
    x.l.activations.shape[2] = (int64_t)1 << 32; /* 4 * 2^64 elements */
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(ends_with(dpclip_errfield(c), ".shape"));
    assert_non_null(strstr(dpclip_errfield(c), "activations"));

    /* numel fits, bytes do not */
    x = lin_on(buf, 4, 2, 4, 4);
    x.l.output_grad.shape[1] = (int64_t)1 << 30;
    x.l.output_grad.shape[2] = (int64_t)1 << 31;
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "output_grad"));

    /* negative and zero dimensions */
    x = lin_on(buf, 4, 2, 4, 4);
    x.l.activations.shape[2] = -4;
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(ends_with(dpclip_errfield(c), "activations.shape"));
    x = lin_on(buf, 4, 2, 4, 4);
    x.l.output_grad.shape[1] = 0;
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(ends_with(dpclip_errfield(c), "output_grad.shape"));
    dpclip_disconnect(c);
}

static void test_inconsistent_shapes(void **state) {
    (void)state;
    dpclip_client *c = lib_connect();
    uint64_t buf;
    void *mem;
    lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 1u << 16, &buf, &mem), 0);
    /* sequence lengths differ */
    x = lin_on(buf, 4, 3, 4, 4);
    x.l.output_grad.shape[1] = 2;
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "output_grad"));
    /* batch dimension differs from batch_size */
    x = lin_on(buf, 4, 3, 4, 4);
    x.B = 3;
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "activations"));
    /* 2D activations, 3D grads */
    x = lin_on(buf, 4, 3, 4, 4);
    x.l.activations.ndim = 2;
    x.l.activations.shape[1] = 4;
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "output_grad"));
    /* weight output [p, d] given as [d, p] */
    x = lin_on(buf, 4, 3, 4, 6);
    x.l.weight_grad_out = (dpclip_tensor){buf, 8192, DPCLIP_F32, 2, {4, 6, 0}};
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(ends_with(dpclip_errfield(c), "weight_grad_out.shape"));
    /* bias output without a bias */
    x = lin_on(buf, 4, 3, 4, 6);
    x.l.bias_grad_out = (dpclip_tensor){buf, 8192, DPCLIP_F32, 1, {6, 0, 0}};
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "bias_grad_out"));
    /* integer activations */
    x = lin_on(buf, 4, 3, 4, 4);
    x.l.activations.dtype = DPCLIP_I32;
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(ends_with(dpclip_errfield(c), "activations.dtype"));
    /* a layer norm whose grad has another width */
    {
        dpclip_clip_config cfg = k_sum;
        dpclip_step *s = dpclip_step_new(4, &cfg);
        dpclip_norm_layer n = {.name = "ln", .eps = 1e-5f,
                               .input = {buf, 0, DPCLIP_F32, 2, {4, 8, 0}},
                               .output_grad = {buf, 4096, DPCLIP_F32, 2, {4, 7, 0}}};
        dpclip_result res;
        assert_int_equal(dpclip_step_add_layernorm(s, &n), 0);
        assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EINVAL);
        assert_non_null(strstr(dpclip_errfield(c), "layer_norm.output_grad"));
        dpclip_step_free(s);
    }
    dpclip_disconnect(c);
}

static void test_batch_bounds(void **state) {
    (void)state;
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__ClipStep cs = DPCLIP__CLIP_STEP__INIT;
    Dpclip__ClipConfig cc = DPCLIP__CLIP_CONFIG__INIT;
    Dpclip__Layer layer = DPCLIP__LAYER__INIT, *layers[1] = {&layer};
    Dpclip__LinearLayer lin = DPCLIP__LINEAR_LAYER__INIT;
    Dpclip__TensorRef a = DPCLIP__TENSOR_REF__INIT, g = DPCLIP__TENSOR_REF__INIT;
    int64_t shape[2] = {1, 4};
    dpclip_client *c = lib_connect();
    uint64_t buf;
    void *mem;
    lin_desc x;
    int fd = raw_hello();

    /* B = 0 cannot be built with the library (local check): raw wire */
    buf = dc_raw_register_memfd(fd, 2, 4096, NULL);
    assert_true(buf != 0);
    a.buffer_id = g.buffer_id = buf;
    a.dtype = g.dtype = DPCLIP__DTYPE__F32;
    a.n_shape = g.n_shape = 2;
    a.shape = g.shape = shape;
    g.offset = 64;
    lin.activations = &a;
    lin.output_grad = &g;
    layer.kind_case = DPCLIP__LAYER__KIND_LINEAR;
    layer.linear = &lin;
    cc.max_grad_norm = 1.0f;
    cc.loss_reduction = DPCLIP__LOSS_REDUCTION__SUM;
    cs.batch_size = 0;
    cs.n_layers = 1;
    cs.layers = layers;
    cs.clip = &cc;
    req.id = 3;
    req.body_case = DPCLIP__REQUEST__BODY_CLIP_STEP;
    req.clip_step = &cs;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "clip_step.batch_size");
    /* the same request with B = 1 is fine: the error was the batch size */
    cs.batch_size = 1;
    req.id = 4;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    {
        Dpclip__Reply *r = dc_raw_read_reply(fd, 10000);
        assert_non_null(r);
        assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_CLIP_STEP);
        dpclip__reply__free_unpacked(r, NULL);
    }
    /* no layers, no clip config */
    cs.n_layers = 0;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "clip_step.layers");
    cs.n_layers = 1;
    cs.clip = NULL;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "clip_step.clip");
    close(fd);

    /* above max_batch */
    assert_int_equal(dpclip_buffer_alloc(c, 1u << 16, &buf, &mem), 0);
    x = lin_on(buf, MAX_BATCH + 1, 1, 4, 4);
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_string_equal(dpclip_errfield(c), "clip_step.batch_size");
    x = lin_on(buf, UINT32_MAX, 1, 4, 4);
    assert_int_equal(run_linear(c, &x), DPCLIP_EINVAL);
    assert_string_equal(dpclip_errfield(c), "clip_step.batch_size");
    dpclip_disconnect(c);
}

/* --- data the backend must refuse -------------------------------------------- */

static int all_equal(const float *p, int64_t n, float v) {
    for (int64_t i = 0; i < n; i++)
        if (p[i] != v) return 0;
    return 1;
}

static void test_embedding_out_of_range(void **state) {
    (void)state;
    const uint32_t B = 4;
    dpclip_client *c = lib_connect();
    dpclip_clip_config cfg = k_sum;
    uint64_t buf;
    void *mem;
    int32_t *idx;
    float *g, *w;
    dpclip_step *s;
    dpclip_result res;
    const int T = 3, d = 4, V = 10;

    assert_int_equal(dpclip_buffer_alloc(c, 1u << 16, &buf, &mem), 0);
    idx = mem;
    g = (float *)((char *)mem + 1024);
    w = (float *)((char *)mem + 4096);
    for (int i = 0; i < (int)B * T; i++) idx[i] = i % V;
    for (int i = 0; i < (int)B * T * d; i++) g[i] = 0.01f * (float)(i % 7);
    for (int i = 0; i < V * d; i++) w[i] = 123.0f;
    {
        dpclip_embedding e = {.name = "emb", .num_embeddings = (uint64_t)V,
                              .indices = {buf, 0, DPCLIP_I32, 2, {B, T, 0}},
                              .output_grad = {buf, 1024, DPCLIP_F32, 3, {B, T, d}},
                              .weight_grad_out = {buf, 4096, DPCLIP_F32, 2, {V, d, 0}}};
        s = dpclip_step_new(B, &cfg);
        assert_int_equal(dpclip_step_add_embedding(s, &e), 0);
    }
    /* a sane step works */
    assert_int_equal(dpclip_run(c, s, &res), 0);
    dpclip_result_free(&res);
    for (int i = 0; i < V * d; i++) w[i] = 123.0f;

    idx[5] = V; /* one past the vocabulary */
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "indices"));
    assert_true(all_equal(w, V * d, 123.0f));
    idx[5] = -1;
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "indices"));
    assert_true(all_equal(w, V * d, 123.0f));
    idx[5] = INT32_MAX;
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "indices"));
    assert_true(all_equal(w, V * d, 123.0f));
    dpclip_step_free(s);
    dpclip_disconnect(c);
}

static void test_nonfinite(void **state) {
    (void)state;
    const uint32_t B = 6;
    dpclip_client *c = lib_connect();
    dpclip_clip_config cfg = k_sum;
    dc_test_layer_spec lin = {DC_LAYER_LINEAR, B, 3, 8, 5, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec ln = {DC_LAYER_LAYERNORM, B, 3, 8, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_rng r;
    dc_shm_step s;
    dpclip_result res;
    float *act, *grad, *lnx, *out;
    int64_t n;

    dc_test_rng_seed(&r, 5);
    assert_int_equal(dc_shm_step_init(&s, c, 1u << 20, B, &cfg), 0);
    assert_int_equal(dc_shm_step_add(&s, &lin, &r, 1.0f), 0);
    assert_int_equal(dc_shm_step_add(&s, &ln, &r, 1.0f), 1);
    assert_int_equal(dc_shm_step_add_outputs(&s, 1, 1), 0);
    act = s.ref.layers[0].input.data;
    grad = s.ref.layers[0].grad.data;
    lnx = s.ref.layers[1].input.data;
    n = dc_shm_step_outputs(&s, NULL);
    out = malloc((size_t)n * sizeof *out);
    assert_non_null(out);

    const struct {
        float *p;
        size_t i;
        float v;
        const char *field;
    } cases[] = {
        {act, 17, NAN, NULL},
        {act, 0, INFINITY, NULL},
        {grad, 29, -INFINITY, NULL},
        {lnx, 40, NAN, NULL},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        float keep = cases[k].p[cases[k].i];
        cases[k].p[cases[k].i] = cases[k].v;
        dc_shm_step_fill_outputs(&s, -5.0f);
        assert_int_equal(dpclip_run(c, s.step, &res), DPCLIP_ENONFINITE);
        assert_null(res.norms);
        assert_true(strlen(dpclip_errmsg(c)) > 0);
        /* nothing written */
        dc_shm_step_outputs(&s, out);
        assert_true(all_equal(out, n, -5.0f));
        assert_true(all_equal(s.ref.norms_out.data, B, -5.0f));
        assert_true(all_equal(s.ref.coefs_out.data, B, -5.0f));
        cases[k].p[cases[k].i] = keep;
    }
    /* repaired, the same session computes exact results again */
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    assert_true(dc_shm_step_check(&s, &res, dc_test_rtol(DC_F32), 1e-7) <= 1.0);
    dpclip_result_free(&res);
    free(out);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* A step too big for the daemon's max_frame is refused by the library
 * before anything is sent; the connection stays usable. */
static void test_client_frame_limit(void **state) {
    (void)state;
    dpclip_client *c = lib_connect();
    dpclip_clip_config cfg = k_sum;
    dpclip_step *s = dpclip_step_new(4, &cfg);
    dpclip_result res;
    uint64_t buf;
    void *mem;
    lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 4096, &buf, &mem), 0);
    x = lin_on(buf, 4, 2, 4, 4);
    for (int i = 0; i < 3000; i++) assert_int_equal(dpclip_step_add_linear(s, &x.l), 0);
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EARG);
    assert_string_equal(dpclip_errfield(c), "frame.length");
    assert_int_equal(dpclip_ping(c), 0);
    dpclip_step_free(s);
    dpclip_disconnect(c);
}

/* --- clients that vanish ---------------------------------------------------- */

static void test_disconnect_mid_step(void **state) {
    (void)state;
    const uint32_t B = 32;
    const int64_t T = 64, d = 256, p = 256;
    for (int round = 0; round < 3; round++) {
        dpclip_client *c = lib_connect();
        dpclip_clip_config cfg = {.max_grad_norm = 1.0f, .reduction = DPCLIP_MEAN,
                                  .noise_multiplier = 1.0f};
        dpclip_step *s = dpclip_step_new(B, &cfg);
        size_t act = (size_t)(B * T * d) * 4, grd = (size_t)(B * T * p) * 4;
        uint64_t buf, ticket;
        void *mem;
        assert_int_equal(dpclip_buffer_alloc(c, act + grd + (size_t)(p * d) * 4, &buf, &mem), 0);
        float *f = mem;
        for (size_t i = 0; i < (act + grd) / 4; i++) f[i] = (float)((i * 2654435761u) % 1000) * 1e-3f;
        dpclip_linear l = {.name = "big", .algo = round == 1 ? DPCLIP_ALGO_GHOST : DPCLIP_ALGO_DIRECT,
                           .activations = {buf, 0, DPCLIP_F32, 3, {B, T, d}},
                           .output_grad = {buf, act, DPCLIP_F32, 3, {B, T, p}},
                           .weight_grad_out = {buf, act + grd, DPCLIP_F32, 2, {p, d, 0}}};
        assert_int_equal(dpclip_step_add_linear(s, &l), 0);
        assert_int_equal(dpclip_submit(c, s, &ticket), 0);
        if (round == 2) assert_int_equal(dpclip_submit(c, s, &ticket), 0); /* one queued too */
        dpclip_disconnect(c); /* at once: the daemon finishes the step for nobody */
        dpclip_step_free(s);
    }
    /* a raw client that sends a step and closes before the reply */
    {
        int fd = raw_hello();
        Dpclip__Request req = DPCLIP__REQUEST__INIT;
        Dpclip__Ping ping = DPCLIP__PING__INIT;
        req.id = 2;
        req.body_case = DPCLIP__REQUEST__BODY_PING;
        req.ping = &ping;
        for (int i = 0; i < 1000; i++) dc_raw_send_request(fd, &req); /* replies never read */
        close(fd);
    }
}

/* --- after all that ------------------------------------------------------- */

static void test_survivors(void **state) {
    (void)state;
    int before = atomic_load(&g_good_ok);
    struct timespec ts = {0, 5 * 1000 * 1000};
    dpclip_client *c;
    dc_shm_step s;
    dc_test_rng r;
    dpclip_result res;
    dpclip_clip_config cfg = k_sum;
    dc_test_layer_spec lin = {DC_LAYER_LINEAR, 5, 4, 6, 7, DC_F32, 1, DC_ALGO_AUTO, 1, 0};

    /* the good client keeps making progress (bounded wait, not a timing check) */
    for (int i = 0; i < 12000 && atomic_load(&g_good_ok) < before + 20 &&
                    !atomic_load(&g_good_failed);
         i++)
        nanosleep(&ts, NULL);
    atomic_store(&g_stop, 1);
    pthread_join(g_good, NULL);
    if (g_good_failed || g_good_bad)
        fprintf(stderr, "good client: %d ok, %d wrong, %d failed (%s)\n", (int)g_good_ok,
                (int)g_good_bad, (int)g_good_failed, g_good_why);
    assert_int_equal(atomic_load(&g_good_failed), 0);
    assert_int_equal(atomic_load(&g_good_bad), 0);
    assert_true(atomic_load(&g_good_ok) >= before + 20);
    fprintf(stderr, "good client: %d exact steps during the attacks\n", (int)g_good_ok);

    /* the daemon is alive and serves a newcomer */
    assert_true(dc_harness_alive(&g_h));
    c = lib_connect();
    dc_test_rng_seed(&r, 6);
    assert_int_equal(dc_shm_step_init(&s, c, 1u << 20, 5, &cfg), 0);
    assert_int_equal(dc_shm_step_add(&s, &lin, &r, 1.0f), 0);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    assert_true(dc_shm_step_check(&s, &res, dc_test_rtol(DC_F32), 1e-7) <= 1.0);
    dpclip_result_free(&res);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* SIGTERM: the daemon finishes, exits 0 and removes its socket (cmocka
 * does not count a failing group teardown, so this is a test). */
static void test_clean_shutdown(void **state) {
    (void)state;
    assert_int_equal(dc_harness_stop(&g_h), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_truncated_frame),
        cmocka_unit_test(test_frame_too_long),
        cmocka_unit_test(test_undecodable),
        cmocka_unit_test(test_empty_body),
        cmocka_unit_test(test_before_handshake),
        cmocka_unit_test(test_garbage_stream),
        cmocka_unit_test(test_register_abuse),
        cmocka_unit_test(test_unregistered_buffer),
        cmocka_unit_test(test_foreign_buffer),
        cmocka_unit_test(test_past_the_end),
        cmocka_unit_test(test_shape_overflow),
        cmocka_unit_test(test_inconsistent_shapes),
        cmocka_unit_test(test_batch_bounds),
        cmocka_unit_test(test_embedding_out_of_range),
        cmocka_unit_test(test_nonfinite),
        cmocka_unit_test(test_client_frame_limit),
        cmocka_unit_test(test_disconnect_mid_step),
        cmocka_unit_test(test_survivors),
        cmocka_unit_test(test_clean_shutdown),
    };
    return cmocka_run_group_tests_name("hostile", tests, group_setup, group_teardown);
}
