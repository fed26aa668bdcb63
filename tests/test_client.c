/* libdpclip against a real dpclipd: local argument checks, errors,
 * handshake, buffers, ping, steps (submit/wait/submit_cb/poll: test_submit.c). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "dc_frame.h"
#include "client_test.h"

/* --- no daemon needed ---------------------------------------------------- */

static void test_local_args(void **state) {
    (void)state;
    dpclip_step *s;
    dpclip_linear l;
    dpclip_norm_layer n;
    dpclip_embedding e;
    dpclip_result res;
    dpclip_tensor t = {1, 0, DPCLIP_F32, 2, {4, 8, 0}};

    assert_null(dpclip_step_new(0, &k_cfg));
    assert_null(dpclip_step_new(4, NULL));
    s = dpclip_step_new(4, &k_cfg);
    assert_non_null(s);

    memset(&l, 0, sizeof l);
    assert_int_equal(dpclip_step_add_linear(NULL, &l), DPCLIP_EARG);
    assert_int_equal(dpclip_step_add_linear(s, NULL), DPCLIP_EARG);
    /* required tensors absent */
    assert_int_equal(dpclip_step_add_linear(s, &l), DPCLIP_EARG);
    l.activations = t;
    assert_int_equal(dpclip_step_add_linear(s, &l), DPCLIP_EARG);
    l.output_grad = t;
    l.output_grad.ndim = 4; /* more dims than a tensor reference holds */
    assert_int_equal(dpclip_step_add_linear(s, &l), DPCLIP_EARG);
    l.output_grad.ndim = 2;
    l.weight_grad_out.ndim = -1;
    assert_int_equal(dpclip_step_add_linear(s, &l), DPCLIP_EARG);
    l.weight_grad_out.ndim = 0; /* absent optional: fine */
    assert_int_equal(dpclip_step_add_linear(s, &l), DPCLIP_OK);

    memset(&n, 0, sizeof n);
    assert_int_equal(dpclip_step_add_layernorm(s, NULL), DPCLIP_EARG);
    assert_int_equal(dpclip_step_add_rmsnorm(s, &n), DPCLIP_EARG);
    memset(&e, 0, sizeof e);
    e.output_grad = t;
    assert_int_equal(dpclip_step_add_embedding(s, &e), DPCLIP_EARG);
    assert_int_equal(dpclip_step_add_embedding(NULL, &e), DPCLIP_EARG);

    assert_int_equal(dpclip_step_set_outputs(NULL, NULL, NULL), DPCLIP_EARG);
    t.ndim = 7;
    assert_int_equal(dpclip_step_set_outputs(s, &t, NULL), DPCLIP_EARG);

    memset(&res, 0xab, sizeof res);
    assert_int_equal(dpclip_run(NULL, s, &res), DPCLIP_EARG);
    assert_null(res.norms); /* zeroed, so freeing is safe */
    dpclip_result_free(&res);
    dpclip_result_free(NULL);
    assert_int_equal(dpclip_connect("/nonexistent", NULL, NULL), DPCLIP_EARG);
    assert_int_equal(dpclip_submit(NULL, s, NULL), DPCLIP_EARG);
    assert_int_equal(dpclip_submit_cb(NULL, s, NULL, NULL), DPCLIP_EARG);
    assert_int_equal(dpclip_ping(NULL), DPCLIP_EARG);
    assert_int_equal(dpclip_fd(NULL), -1);
    assert_true(dpclip_poll(NULL, 0) < 0);
    dpclip_step_want_layer_norms(NULL, 1);
    dpclip_step_reset(NULL, 3);
    dpclip_step_free(NULL);
    dpclip_disconnect(NULL);
    assert_non_null(dpclip_errmsg(NULL));
    dpclip_step_free(s);
}

static void test_strerror(void **state) {
    (void)state;
    const int codes[] = {DPCLIP_OK,        DPCLIP_EINVAL,   DPCLIP_ENOTFOUND,  DPCLIP_EPERM,
                         DPCLIP_EPRECOND,  DPCLIP_ENOSPACE, DPCLIP_ENONFINITE, DPCLIP_EPROTO,
                         DPCLIP_EINTERNAL, DPCLIP_EUNAVAIL, DPCLIP_EUNIMPL,    DPCLIP_EIO,
                         DPCLIP_ENOMEM,    DPCLIP_EAGAIN,   DPCLIP_EARG};
    const size_t n = sizeof codes / sizeof codes[0];
    const char *unknown = dpclip_strerror(12345);
    assert_non_null(unknown);
    for (size_t i = 0; i < n; i++) {
        const char *s = dpclip_strerror(codes[i]);
        assert_non_null(s);
        assert_true(strlen(s) > 0);
        assert_string_not_equal(s, unknown);
        for (size_t j = 0; j < i; j++) assert_string_not_equal(s, dpclip_strerror(codes[j]));
    }
}

static void test_default_socket(void **state) {
    (void)state;
    const char *old = getenv("DPCLIP_SOCKET");
    char *saved = old ? strdup(old) : NULL;
    setenv("DPCLIP_SOCKET", "/tmp/x/y.sock", 1);
    assert_string_equal(dpclip_default_socket(), "/tmp/x/y.sock");
    unsetenv("DPCLIP_SOCKET");
    assert_string_equal(dpclip_default_socket(), "/run/dpclip/dpclipd.sock");
    if (saved) setenv("DPCLIP_SOCKET", saved, 1);
    free(saved);
}

/* --- against the daemon ------------------------------------------------------ */

static void test_connect_missing(void **state) {
    (void)state;
    char path[400], longpath[200];
    dpclip_client *c = NULL;
    snprintf(path, sizeof path, "%s/missing.sock", g_h.dir);
    assert_int_equal(dpclip_connect(path, NULL, &c), DPCLIP_EIO);
    assert_non_null(c);
    assert_non_null(strstr(dpclip_errmsg(c), strerror(ENOENT)));
    assert_non_null(strstr(dpclip_errmsg(c), path));
    /* a dead handle stays dead and says so */
    assert_int_equal(dpclip_ping(c), DPCLIP_EIO);
    dpclip_disconnect(c);

    memset(longpath, 'a', sizeof longpath - 1);
    longpath[0] = '/';
    longpath[sizeof longpath - 1] = '\0';
    c = NULL;
    assert_int_equal(dpclip_connect(longpath, NULL, &c), DPCLIP_EARG);
    assert_true(strlen(dpclip_errmsg(c)) > 0);
    dpclip_disconnect(c);
}

static void test_handshake_info(void **state) {
    (void)state;
    dpclip_client *c = connect_ok(), *c2 = connect_ok();
    dpclip_daemon_info info, info2;
    assert_int_equal(dpclip_daemon_info_get(c, &info), 0);
    assert_int_equal(dpclip_daemon_info_get(c2, &info2), 0);
    assert_int_equal(info.protocol_version, DC_PROTOCOL_VERSION);
    assert_int_equal(info.max_batch, MAX_BATCH);
    assert_int_equal(info.max_layers, DC_DEFAULT_MAX_LAYERS);
    assert_int_equal(info.max_frame, DC_DEFAULT_MAX_FRAME);
    assert_true(strlen(info.daemon_version) > 0);
    assert_int_equal(info.has_cuda, 0);
    assert_true(info.session_id != 0);
    assert_true(info.session_id != info2.session_id);
    assert_true(dpclip_fd(c) >= 0);
    assert_int_equal(dpclip_daemon_info_get(c, NULL), DPCLIP_EARG);
    dpclip_disconnect(c2);
    dpclip_disconnect(c);
}

static void test_ping(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    for (int i = 0; i < 20; i++) assert_int_equal(dpclip_ping(c), 0);
    dpclip_disconnect(c);
}

static void test_buffers(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    uint64_t a, b, d;
    void *pa, *pb;
    int fd;

    assert_int_equal(dpclip_buffer_alloc(c, 0, &a, &pa), DPCLIP_EARG);
    assert_int_equal(dpclip_buffer_alloc(c, 4096, NULL, &pa), DPCLIP_EARG);
    assert_int_equal(dpclip_buffer_alloc(c, 4096, &a, &pa), 0);
    assert_int_equal(dpclip_buffer_alloc(c, 100000, &b, &pb), 0);
    assert_true(a != 0 && b != 0 && a != b);
    memset(pa, 0x5a, 4096);
    memset(pb, 0xa5, 100000);
    assert_int_equal(((uint8_t *)pa)[4095], 0x5a);
    assert_int_equal(((uint8_t *)pb)[99999], 0xa5);

    /* the library's memfds are sealed: growing or shrinking is refused */
    assert_int_equal(dpclip_buffer_release(c, a), 0);
    assert_int_equal(dpclip_buffer_release(c, a), DPCLIP_ENOTFOUND);
    assert_string_equal(dpclip_errfield(c), "release_buffer.buffer_id");
    assert_int_equal(dpclip_buffer_release(c, 987654321), DPCLIP_ENOTFOUND);
    assert_string_equal(dpclip_errfield(c), "release_buffer.buffer_id");
    assert_true(strlen(dpclip_errmsg(c)) > 0);

    /* register_fd: a caller's sealed memfd works... */
    fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, 8192), 0);
    assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    assert_int_equal(dpclip_buffer_register_fd(c, fd, 8192, &d), 0);
    assert_true(d != b);
    assert_int_equal(dpclip_buffer_release(c, d), 0);
    close(fd);
    /* ...one without F_SEAL_SHRINK is refused by the daemon, naming the field */
    fd = memfd_create("test", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, 8192), 0);
    assert_int_equal(dpclip_buffer_register_fd(c, fd, 8192, &d), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "register_buffer"));
    close(fd);
    assert_int_equal(dpclip_buffer_register_fd(c, -1, 8192, &d), DPCLIP_EARG);
    /* the session is fine after the errors */
    assert_int_equal(dpclip_ping(c), 0);
    dpclip_disconnect(c); /* unmaps b */
}

static void test_run(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    dc_shm_step s;
    dpclip_result res;
    make_step(&s, c, 16, 1);
    dpclip_timing tm;
    assert_int_equal(dpclip_last_timing(c, &tm), DPCLIP_EPRECOND);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    assert_int_equal(res.batch, 16);
    assert_int_equal(res.n_layers, 2);
    /* one clock on one machine: the stamps are in order */
    assert_int_equal(dpclip_last_timing(c, &tm), 0);
    assert_true(tm.start_ns <= tm.sent_ns && tm.start_ns <= tm.daemon_received_ns);
    assert_true(tm.daemon_received_ns + tm.compute_ns <= tm.daemon_replied_ns);
    assert_true(tm.daemon_replied_ns <= tm.received_ns);
    assert_true(tm.compute_ns == res.compute_ns);
    assert_true(tm.input_wait_ns == res.input_wait_ns && res.input_wait_ns <= res.compute_ns);
    assert_null(res.layer_norms);
    check(&s, &res);
    dpclip_result_free(&res);
    assert_null(res.norms);

    /* The same request again is served from the daemon's plan cache (no
     * decoding, no validation): new data in the same tensors is read. */
    for (int i = 0; i < 3; i++) {
        dc_test_rng r;
        dc_test_rng_seed(&r, 100 + (uint64_t)i);
        dc_shm_step_refill(&s, &r);
        assert_int_equal(dpclip_run(c, s.step, &res), 0);
        check(&s, &res);
        dpclip_result_free(&res);
    }
    /* ... until the registry changes: a released buffer is refused by field
     * for the very same bytes, and the session goes on. */
    assert_int_equal(dpclip_buffer_release(c, s.buf_id), 0);
    s.buf_id = 0;
    assert_int_equal(dpclip_run(c, s.step, &res), DPCLIP_ENOTFOUND);
    assert_non_null(strstr(dpclip_errfield(c), "buffer_id"));
    assert_int_equal(dpclip_ping(c), 0);
    dc_shm_step_free(&s);
    make_step(&s, c, 16, 2);

    /* batch 0 after a reset is a local error */
    dpclip_step_reset(s.step, 0);
    assert_int_equal(dpclip_run(c, s.step, &res), DPCLIP_EARG);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* A copy of tensor t at the end of the step's buffer: t now points at the
 * copy (so the reference reads it), the old bytes are set to NaN, and
 * (buffer, offset) of the copy go to ref[0..1]. */
static void move_tensor(dc_shm_step *s, dc_tensor *t, uint64_t *ref) {
    size_t n = (size_t)dc_test_tensor_numel(t) * dc_dtype_size(t->dtype);
    size_t off = (s->used + 63) & ~(size_t)63;
    assert_true(off + n <= s->size);
    memcpy(s->base + off, t->data, n);
    if (dc_dtype_is_float(t->dtype)) memset(t->data, 0xff, n); /* NaN in any float dtype */
    t->data = s->base + off;
    s->used = off + n;
    ref[0] = s->buf_id;
    ref[1] = off;
}

/* dpclip_step_rebind: the same layers read their inputs from new memory,
 * as a trainer's next step does; refused calls change nothing. */
static void test_step_rebind(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    dc_shm_step s;
    dpclip_result res;
    uint64_t refs[8], bad[8];
    int x = 0;

    make_step(&s, c, 8, 41);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    check(&s, &res);
    dpclip_result_free(&res);
    for (size_t i = 0; i < 2; i++) {
        move_tensor(&s, &s.ref.layers[i].input, &refs[4 * i]);
        move_tensor(&s, &s.ref.layers[i].grad, &refs[4 * i + 2]);
    }
    /* the old tensors hold NaN now: a step that read them is refused */
    assert_int_equal(dpclip_run(c, s.step, &res), DPCLIP_ENONFINITE);

    assert_int_equal(dpclip_step_rebind(s.step, 1, refs), DPCLIP_EARG); /* 2 layers */
    assert_int_equal(dpclip_step_rebind(s.step, 3, refs), DPCLIP_EARG);
    assert_int_equal(dpclip_step_rebind(NULL, 2, refs), DPCLIP_EARG);
    assert_int_equal(dpclip_step_rebind(s.step, 2, NULL), DPCLIP_EARG);
    memcpy(bad, refs, sizeof bad);
    bad[6] = 0; /* layer 1's output_grad: buffer 0 */
    assert_int_equal(dpclip_step_rebind(s.step, 2, bad), DPCLIP_EARG);
    /* without a GPU a host pointer is refused, naming the layer's tensor */
    uint64_t ptrs[4] = {(uint64_t)(uintptr_t)&x, (uint64_t)(uintptr_t)&x, 0, 0};
    int rc = dpclip_step_rebind_cuda(c, s.step, 2, ptrs);
    assert_true(rc == DPCLIP_EARG || rc == DPCLIP_EUNAVAIL);
    if (rc == DPCLIP_EARG) assert_non_null(strstr(dpclip_errmsg(c), "layer 0's input"));
    assert_int_equal(dpclip_step_rebind_cuda(c, s.step, 1, ptrs), DPCLIP_EARG);
    {
        /* the lookup and its cached form: the same checks; a host pointer is
         * not a device pointer (EARG) and none of the registrations the
         * cached one may name (EAGAIN, nothing sent); EUNAVAIL without a
         * driver */
        int (*const lookup[2])(dpclip_client *, size_t, const uint64_t *, uint64_t *) = {
            dpclip_buffer_refs_cuda, dpclip_buffer_refs_cuda_cached};
        uint64_t refs4[4];
        for (int k = 0; k < 2; k++) {
            rc = lookup[k](c, 2, ptrs, refs4);
            assert_true(rc == (k ? DPCLIP_EAGAIN : DPCLIP_EARG) || rc == DPCLIP_EUNAVAIL);
            if (rc != DPCLIP_EUNAVAIL) assert_non_null(strstr(dpclip_errmsg(c), "pointer 0"));
            assert_int_equal(lookup[k](NULL, 2, ptrs, refs4), DPCLIP_EARG);
            assert_int_equal(lookup[k](c, 2, NULL, refs4), DPCLIP_EARG);
            assert_int_equal(lookup[k](c, 0, NULL, NULL), 0);
        }
    }
    assert_int_equal(dpclip_run(c, s.step, &res), DPCLIP_ENONFINITE); /* unchanged */

    assert_int_equal(dpclip_step_rebind(s.step, 2, refs), 0);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    check(&s, &res);
    dpclip_result_free(&res);
    /* and again, with new data in the new tensors */
    dc_test_rng r;
    dc_test_rng_seed(&r, 42);
    dc_shm_step_refill(&s, &r);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    check(&s, &res);
    dpclip_result_free(&res);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

static void test_step_errors(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    dc_shm_step s;
    dpclip_step *bad;
    dpclip_linear l;
    dpclip_result res;
    uint64_t t;
    cb_log lg;
    cb_arg arg;

    make_step(&s, c, 8, 30);
    bad = dpclip_step_new(8, &k_cfg);
    memset(&l, 0, sizeof l);
    l.activations = (dpclip_tensor){424242, 0, DPCLIP_F32, 2, {8, 4, 0}};
    l.output_grad = (dpclip_tensor){424242, 128, DPCLIP_F32, 2, {8, 4, 0}};
    assert_int_equal(dpclip_step_add_linear(bad, &l), 0);

    /* a failing step via every path; the session goes on */
    assert_int_equal(dpclip_run(c, bad, &res), DPCLIP_ENOTFOUND);
    assert_non_null(strstr(dpclip_errfield(c), "buffer_id"));
    assert_null(res.norms);
    assert_int_equal(dpclip_submit(c, bad, &t), 0);
    memset(&lg, 0, sizeof lg);
    lg.c = c;
    arg = (cb_arg){&lg, 0, 0};
    assert_int_equal(dpclip_submit_cb(c, bad, on_step, &arg), 0);
    assert_int_equal(dpclip_wait(c, t, -1, &res), DPCLIP_ENOTFOUND);
    assert_string_equal(dpclip_errfield(c), "clip_step.layers[0].linear.activations.buffer_id");
    while (lg.n < 1) assert_true(dpclip_poll(c, -1) >= 0);
    assert_int_equal(lg.status[0], DPCLIP_ENOTFOUND);

    /* over the daemon's max_batch */
    dpclip_step_reset(bad, MAX_BATCH + 1);
    l.activations.shape[0] = l.output_grad.shape[0] = MAX_BATCH + 1;
    assert_int_equal(dpclip_step_add_linear(bad, &l), 0);
    assert_int_equal(dpclip_run(c, bad, &res), DPCLIP_EINVAL);
    assert_string_equal(dpclip_errfield(c), "clip_step.batch_size");

    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    check(&s, &res);
    dpclip_result_free(&res);
    dpclip_step_free(bad);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* One handle shared by several threads: calls are serialized by the
 * handle's lock and every thread gets its own, exact results. */
typedef struct shared_arg {
    dpclip_client *c;
    dc_shm_step *s;
    int ok, bad, failed;
} shared_arg;

static void *shared_thread(void *arg) {
    shared_arg *a = arg;
    for (int i = 0; i < 50; i++) {
        dpclip_result res;
        uint64_t t;
        /* alternate blocking and ticketed calls */
        int rc = i % 2
                     ? dpclip_run(a->c, a->s->step, &res)
                     : (dpclip_submit(a->c, a->s->step, &t) ? -1 : dpclip_wait(a->c, t, -1, &res));
        if (rc) {
            a->failed++;
            continue;
        }
        if (dc_shm_step_check(a->s, &res, dc_test_rtol(DC_F32), 1e-6) <= 1.0) a->ok++;
        else a->bad++;
        dpclip_result_free(&res);
    }
    return NULL;
}

/* A daemon without GPUs refuses CUDA buffers and events by field, and a step
 * naming an unknown event fails by field; the session goes on. */
static void test_cuda_refused_without_gpu(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    dpclip_daemon_info info;
    dc_shm_step s;
    dpclip_result res;
    uint8_t handle[64];
    uint64_t id = 0, off = 0;
    int x = 0;

    assert_int_equal(dpclip_daemon_info_get(c, &info), 0);
    assert_int_equal(info.has_cuda, 0); /* started with --no-gpu */
    memset(handle, 0x5a, sizeof handle);
    assert_int_equal(dpclip_buffer_register_cuda_handle(c, handle, 4096, 0, &id), DPCLIP_EPRECOND);
    assert_string_equal(dpclip_errfield(c), "register_buffer.kind");
    assert_int_equal(dpclip_event_register_cuda(c, handle, 0, &id), DPCLIP_EPRECOND);
    assert_string_equal(dpclip_errfield(c), "register_event");
    /* A host pointer is not device memory (or there is no driver at all). */
    int rc = dpclip_buffer_register_cuda(c, &x, &id, &off);
    assert_true(rc == DPCLIP_EARG || rc == DPCLIP_EUNAVAIL);
    assert_true(strlen(dpclip_errmsg(c)) > 0);

    make_step(&s, c, 8, 31);
    dpclip_step_set_events(s.step, 77, 0);
    assert_int_equal(dpclip_run(c, s.step, &res), DPCLIP_ENOTFOUND);
    assert_string_equal(dpclip_errfield(c), "clip_step.wait_event");
    dpclip_step_set_events(s.step, 0, 0);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    check(&s, &res);
    dpclip_result_free(&res);

    /* An early notice needs a signal event: refused by field, and
     * dpclip_wait_enqueued collects the failed ticket. */
    uint64_t t1, t2;
    dpclip_enqueued enq;
    dpclip_step_notify_enqueued(s.step, 1);
    assert_int_equal(dpclip_submit(c, s.step, &t1), 0);
    dpclip_step_notify_enqueued(s.step, 0);
    assert_int_equal(dpclip_submit(c, s.step, &t2), 0);
    assert_int_equal(dpclip_wait_enqueued(c, t1, -1, &enq), DPCLIP_EINVAL);
    assert_string_equal(dpclip_errfield(c), "clip_step.notify_enqueued");
    assert_int_equal(dpclip_wait(c, t1, 0, &res), DPCLIP_EARG);
    /* A step that finished counts as enqueued, and stays to be collected. */
    assert_int_equal(dpclip_wait_enqueued(c, t2, -1, &enq), 0);
    assert_int_equal(dpclip_wait(c, t2, -1, &res), 0);
    assert_int_equal(enq.step_index, res.step_index);
    assert_true(enq.epsilon == res.epsilon);
    check(&s, &res);
    dpclip_result_free(&res);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

static void test_shared_handle(void **state) {
    (void)state;
    enum { N = 4 };
    dpclip_client *c = connect_ok();
    dc_shm_step s[N];
    shared_arg a[N];
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        make_step(&s[i], c, (uint32_t)(5 + i), 60 + (uint64_t)i);
        a[i] = (shared_arg){c, &s[i], 0, 0, 0};
    }
    for (int i = 0; i < N; i++)
        assert_int_equal(pthread_create(&th[i], NULL, shared_thread, &a[i]), 0);
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++) {
        assert_int_equal(a[i].failed, 0);
        assert_int_equal(a[i].bad, 0);
        assert_int_equal(a[i].ok, 50);
        dc_shm_step_free(&s[i]);
    }
    dpclip_disconnect(c);
}

/* A daemon that goes away: calls fail with DPCLIP_EIO, pending tickets too. */
static void test_daemon_gone(void **state) {
    (void)state;
    dc_harness h2;
    dpclip_client *c = NULL;
    dc_shm_step s;
    dpclip_result res;
    uint64_t t;

    assert_int_equal(dc_harness_start(&h2, "--workers 1"), 0);
    assert_int_equal(dpclip_connect(h2.sock, NULL, &c), 0);
    make_step(&s, c, 8, 50);
    assert_int_equal(dpclip_submit(c, s.step, &t), 0);
    assert_int_equal(dpclip_wait(c, t, -1, &res), 0); /* in flight steps finish */
    dpclip_result_free(&res);
    assert_int_equal(dpclip_submit(c, s.step, &t), 0);
    /* the daemon drains and exits 0 even with this client still connected */
    assert_int_equal(dc_harness_stop(&h2), 0);
    int rc = dpclip_wait(c, t, -1, &res);
    /* the request may have been answered before the shutdown or dropped */
    assert_true(rc == 0 || rc == DPCLIP_EIO);
    dpclip_result_free(&res);
    assert_int_equal(dpclip_ping(c), DPCLIP_EIO);
    assert_true(strlen(dpclip_errmsg(c)) > 0);
    assert_int_equal(dpclip_run(c, s.step, &res), DPCLIP_EIO);
    assert_int_equal(dpclip_fd(c), -1);
    s.c = NULL;
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* A daemon stopped with SIGTERM: its notice is the reason calls then give,
 * not "Broken pipe" or "closed the connection". */
static void test_shutdown_reason(void **state) {
    (void)state;
    dc_harness h2;
    dpclip_client *c = NULL;
    assert_int_equal(dc_harness_start(&h2, "--workers 1"), 0);
    assert_int_equal(dpclip_connect(h2.sock, NULL, &c), 0);
    assert_int_equal(dc_harness_stop(&h2), 0);
    assert_int_equal(dpclip_ping(c), DPCLIP_EIO);
    assert_string_equal(dpclip_errmsg(c), "dpclipd is shutting down");
    assert_string_equal(dpclip_errfield(c), "daemon");
    assert_int_equal(dpclip_ping(c), DPCLIP_EIO); /* and on the dead handle */
    assert_string_equal(dpclip_errmsg(c), "dpclipd is shutting down");
    dpclip_disconnect(c);
}

/* One frame of a scripted daemon (fake_daemon). */
static void fake_send(int fd, Dpclip__Reply *r) {
    uint8_t buf[1024];
    size_t n = dpclip__reply__get_packed_size(r);
    assert_true(n + DC_FRAME_HEADER <= sizeof buf);
    dc_frame_put_len(buf, (uint32_t)n);
    dpclip__reply__pack(r, buf + DC_FRAME_HEADER);
    assert_int_equal(dc_raw_send(fd, buf, DC_FRAME_HEADER + n), 0);
}

/* Plays a daemon that shuts down while a request is in flight: answers the
 * Hello, then sends the notice before the Ping's reply, then closes. */
static void *fake_daemon(void *arg) {
    int lfd = *(int *)arg, fd = accept(lfd, NULL, NULL);
    for (int i = 0; i < 2 && fd >= 0; i++) {
        uint8_t hdr[DC_FRAME_HEADER], buf[1024];
        Dpclip__Request *req;
        Dpclip__Reply r = DPCLIP__REPLY__INIT;
        uint32_t len;
        if (recv(fd, hdr, sizeof hdr, MSG_WAITALL) != (ssize_t)sizeof hdr) break;
        len = dc_frame_get_len(hdr);
        if (len > sizeof buf || recv(fd, buf, len, MSG_WAITALL) != (ssize_t)len) break;
        if (!(req = dpclip__request__unpack(NULL, len, buf))) break;
        r.id = req->id;
        if (req->body_case == DPCLIP__REQUEST__BODY_HELLO) {
            Dpclip__HelloReply h = DPCLIP__HELLO_REPLY__INIT;
            h.protocol_version = DC_PROTOCOL_VERSION;
            h.max_frame = 1u << 20;
            r.body_case = DPCLIP__REPLY__BODY_HELLO;
            r.hello = &h;
            fake_send(fd, &r);
        } else {
            Dpclip__Reply n = DPCLIP__REPLY__INIT;
            Dpclip__Error e = DPCLIP__ERROR__INIT;
            Dpclip__Pong pong = DPCLIP__PONG__INIT;
            e.code = DPCLIP__ERROR_CODE__UNAVAILABLE;
            e.field = "daemon";
            e.message = "dpclipd is shutting down";
            n.body_case = DPCLIP__REPLY__BODY_ERROR;
            n.error = &e;
            fake_send(fd, &n);
            pong.nonce = req->ping ? req->ping->nonce : 0;
            r.body_case = DPCLIP__REPLY__BODY_PONG;
            r.pong = &pong;
            fake_send(fd, &r);
        }
        dpclip__request__free_unpacked(req, NULL);
    }
    if (fd >= 0) close(fd);
    return NULL;
}

/* The notice answers no request: the request in flight still gets its own
 * reply, and the calls after it give the notice's words. */
static void test_notice_before_reply(void **state) {
    (void)state;
    struct sockaddr_un a;
    char dir[] = "/tmp/dpclip-notice.XXXXXX";
    dpclip_client *c = NULL;
    pthread_t th;
    int lfd;
    assert_non_null(mkdtemp(dir));
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    snprintf(a.sun_path, sizeof a.sun_path, "%s/fake.sock", dir);
    lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(lfd >= 0);
    assert_int_equal(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(lfd, 1), 0);
    assert_int_equal(pthread_create(&th, NULL, fake_daemon, &lfd), 0);
    assert_int_equal(dpclip_connect(a.sun_path, NULL, &c), 0);
    assert_int_equal(dpclip_ping(c), 0);
    assert_int_equal(dpclip_ping(c), DPCLIP_EIO);
    assert_string_equal(dpclip_errmsg(c), "dpclipd is shutting down");
    assert_int_equal(pthread_join(th, NULL), 0);
    dpclip_disconnect(c);
    close(lfd);
    unlink(a.sun_path);
    rmdir(dir);
}

/* dpclip_step_rebind_outputs: the same layers write their outputs into new
 * memory (set to NaN first, so that only the daemon's writes pass the
 * check); refused calls change nothing. */
static void test_step_rebind_outputs(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    dc_shm_step s;
    dpclip_result res;
    uint64_t refs[8], bad[8];

    make_step(&s, c, 8, 43);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    check(&s, &res);
    dpclip_result_free(&res);
    for (size_t i = 0; i < 2; i++) { /* a linear layer and a LayerNorm, both with a bias */
        dc_tensor *o[2] = {&s.ref.layers[i].weight_grad_out, &s.ref.layers[i].bias_grad_out};
        for (int k = 0; k < 2; k++) {
            move_tensor(&s, o[k], &refs[4 * i + 2 * k]);
            memset(o[k]->data, 0xff, (size_t)dc_test_tensor_numel(o[k]) * sizeof(float));
        }
    }
    assert_int_equal(dpclip_step_rebind_outputs(s.step, 1, refs), DPCLIP_EARG); /* 2 layers */
    assert_int_equal(dpclip_step_rebind_outputs(NULL, 2, refs), DPCLIP_EARG);
    assert_int_equal(dpclip_step_rebind_outputs(s.step, 2, NULL), DPCLIP_EARG);
    memcpy(bad, refs, sizeof bad);
    bad[6] = 0; /* layer 1's bias_grad_out, which the step names: buffer 0 */
    assert_int_equal(dpclip_step_rebind_outputs(s.step, 2, bad), DPCLIP_EARG);
    /* unchanged: the old outputs written, the new ones still NaN */
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    dpclip_result_free(&res);
    assert_true(isnan(((float *)s.ref.layers[0].weight_grad_out.data)[0]));

    assert_int_equal(dpclip_step_rebind_outputs(s.step, 2, refs), 0);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    check(&s, &res);
    dpclip_result_free(&res);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

int main(void) {
    const struct CMUnitTest local[] = {
        cmocka_unit_test(test_local_args),
        cmocka_unit_test(test_strerror),
        cmocka_unit_test(test_default_socket),
        cmocka_unit_test(test_notice_before_reply),
    };
    const struct CMUnitTest daemon[] = {
        cmocka_unit_test(test_connect_missing),
        cmocka_unit_test(test_handshake_info),
        cmocka_unit_test(test_ping),
        cmocka_unit_test(test_buffers),
        cmocka_unit_test(test_run),
        cmocka_unit_test(test_step_rebind),
        cmocka_unit_test(test_step_rebind_outputs),
        cmocka_unit_test(test_step_errors),
        cmocka_unit_test(test_shared_handle),
        cmocka_unit_test(test_cuda_refused_without_gpu),
        cmocka_unit_test(test_daemon_gone),
        cmocka_unit_test(test_shutdown_reason),
        cmocka_unit_test(test_clean_shutdown),
    };
    int fails = cmocka_run_group_tests_name("client_local", local, NULL, NULL);
    fails += cmocka_run_group_tests_name("client_daemon", daemon, group_setup, group_teardown);
    return fails;
}
