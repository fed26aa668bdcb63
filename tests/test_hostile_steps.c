/* Hostile input, buffers and steps: registration abuse, references to
 * buffers that are not the session's or past their end, impossible shapes
 * and batches, indices out of range, non-finite data, frames over the
 * client's limit, and clients that vanish mid-step, while a well-behaved client keeps running exact steps (the
 * fixture: support/hostile.c). Each must get an Error naming the field and
 * write nothing; the daemon keeps serving. A failed step's privacy spend is
 * refunded only if nothing depended on its noise. */
#include <ctype.h>
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
#include "hostile.h"

/* --- buffers ------------------------------------------------------------------ */

static void test_register_abuse(void **state) {
    (void)state;
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
    dpclip_client *c = dc_hostile_connect();
    uint64_t id;
    int p[2], mfd, fd;

    /* no descriptor attached */
    fd = dc_hostile_raw_hello();
    rb.kind = DPCLIP__BUFFER_KIND__SHM_FD;
    rb.size = 4096;
    req.id = 2;
    req.body_case = DPCLIP__REQUEST__BODY_REGISTER_BUFFER;
    req.register_buffer = &rb;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "register_buffer");
    /* a pipe is not shared memory */
    assert_int_equal(pipe(p), 0);
    assert_int_equal(dc_raw_send_request_fd(fd, &req, p[0]), 0);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "register_buffer");
    close(p[0]);
    close(p[1]);
    dc_hostile_expect_pong(fd, 3);
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
    dpclip_client *c = dc_hostile_connect();
    dc_lin_desc x = dc_hostile_lin_on(987654321, 4, 2, 8, 8);
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_ENOTFOUND);
    assert_true(dc_hostile_ends_with(dpclip_errfield(c), "buffer_id"));
    assert_non_null(strstr(dpclip_errfield(c), "activations"));
    dpclip_disconnect(c);
}

static void test_foreign_buffer(void **state) {
    (void)state;
    dpclip_client *c = dc_hostile_connect();
    uint64_t theirs = dc_hostile_good_buffer(), mine;
    void *mem;
    dc_lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 1u << 16, &mine, &mem), 0);
    /* another session's id: exactly like an id that never existed */
    x = dc_hostile_lin_on(theirs, 2, 2, 4, 4);
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_ENOTFOUND);
    assert_true(dc_hostile_ends_with(dpclip_errfield(c), "buffer_id"));
    /* inputs ours, output theirs: still refused before anything is written */
    x = dc_hostile_lin_on(mine, 2, 2, 4, 4);
    x.l.weight_grad_out = (dpclip_tensor){theirs, 0, DPCLIP_F32, 2, {4, 4, 0}};
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_ENOTFOUND);
    assert_non_null(strstr(dpclip_errfield(c), "weight_grad_out.buffer_id"));
    /* nor can it be released */
    assert_int_equal(dpclip_buffer_release(c, theirs), DPCLIP_ENOTFOUND);
    assert_string_equal(dpclip_errfield(c), "release_buffer.buffer_id");
    dpclip_disconnect(c);
}

static void test_past_the_end(void **state) {
    (void)state;
    dpclip_client *c = dc_hostile_connect();
    uint64_t buf;
    void *mem;
    dc_lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 4096, &buf, &mem), 0);
    x = dc_hostile_lin_on(buf, 8, 2, 16, 8);
    x.l.activations.offset = 4000; /* 1 KiB of activations from byte 4000 */
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "activations"));

    x = dc_hostile_lin_on(buf, 8, 2, 16, 8);
    x.l.output_grad.offset = 4096 - 8; /* just past the end */
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "output_grad"));

    /* offset + size wrapping around 2^64 */
    x = dc_hostile_lin_on(buf, 8, 2, 16, 8);
    x.l.activations.offset = UINT64_MAX - 63;
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "activations"));

    /* an output past the end */
    x = dc_hostile_lin_on(buf, 8, 2, 16, 8);
    x.l.weight_grad_out = (dpclip_tensor){buf, 4096 - 64, DPCLIP_F32, 2, {8, 16, 0}};
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "weight_grad_out"));

    /* norms_out past the end */
    {
        dpclip_clip_config cfg = dc_hostile_sum;
        dpclip_step *s = dpclip_step_new(8, &cfg);
        dpclip_tensor no = {buf, 4096 - 16, DPCLIP_F32, 1, {8, 0, 0}};
        dpclip_result res;
        x = dc_hostile_lin_on(buf, 8, 1, 8, 8);
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
    dpclip_client *c = dc_hostile_connect();
    uint64_t buf;
    void *mem;
    dc_lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 4096, &buf, &mem), 0);
    x = dc_hostile_lin_on(buf, 4, 2, 4, 4);
    x.l.activations.shape[1] = (int64_t)1 << 32;
    x.l.activations.shape[2] = (int64_t)1 << 32; /* 4 * 2^64 elements */
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(dc_hostile_ends_with(dpclip_errfield(c), ".shape"));
    assert_non_null(strstr(dpclip_errfield(c), "activations"));

    /* numel fits, bytes do not */
    x = dc_hostile_lin_on(buf, 4, 2, 4, 4);
    x.l.output_grad.shape[1] = (int64_t)1 << 30;
    x.l.output_grad.shape[2] = (int64_t)1 << 31;
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "output_grad"));

    /* negative and zero dimensions */
    x = dc_hostile_lin_on(buf, 4, 2, 4, 4);
    x.l.activations.shape[2] = -4;
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(dc_hostile_ends_with(dpclip_errfield(c), "activations.shape"));
    x = dc_hostile_lin_on(buf, 4, 2, 4, 4);
    x.l.output_grad.shape[1] = 0;
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(dc_hostile_ends_with(dpclip_errfield(c), "output_grad.shape"));
    dpclip_disconnect(c);
}

static void test_inconsistent_shapes(void **state) {
    (void)state;
    dpclip_client *c = dc_hostile_connect();
    uint64_t buf;
    void *mem;
    dc_lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 1u << 16, &buf, &mem), 0);
    /* sequence lengths differ */
    x = dc_hostile_lin_on(buf, 4, 3, 4, 4);
    x.l.output_grad.shape[1] = 2;
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "output_grad"));
    /* batch dimension differs from batch_size */
    x = dc_hostile_lin_on(buf, 4, 3, 4, 4);
    x.B = 3;
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "activations"));
    /* 2D activations, 3D grads */
    x = dc_hostile_lin_on(buf, 4, 3, 4, 4);
    x.l.activations.ndim = 2;
    x.l.activations.shape[1] = 4;
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "output_grad"));
    /* weight output [p, d] given as [d, p] */
    x = dc_hostile_lin_on(buf, 4, 3, 4, 6);
    x.l.weight_grad_out = (dpclip_tensor){buf, 8192, DPCLIP_F32, 2, {4, 6, 0}};
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(dc_hostile_ends_with(dpclip_errfield(c), "weight_grad_out.shape"));
    /* bias output without a bias */
    x = dc_hostile_lin_on(buf, 4, 3, 4, 6);
    x.l.bias_grad_out = (dpclip_tensor){buf, 8192, DPCLIP_F32, 1, {6, 0, 0}};
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "bias_grad_out"));
    /* integer activations */
    x = dc_hostile_lin_on(buf, 4, 3, 4, 4);
    x.l.activations.dtype = DPCLIP_I32;
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_true(dc_hostile_ends_with(dpclip_errfield(c), "activations.dtype"));
    /* a layer norm whose grad has another width */
    {
        dpclip_clip_config cfg = dc_hostile_sum;
        dpclip_step *s = dpclip_step_new(4, &cfg);
        dpclip_norm_layer n = {.name = "ln",
                               .eps = 1e-5f,
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
    dpclip_client *c = dc_hostile_connect();
    uint64_t buf;
    void *mem;
    dc_lin_desc x;
    int fd = dc_hostile_raw_hello();

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
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "clip_step.batch_size");
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
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "clip_step.layers");
    cs.n_layers = 1;
    cs.clip = NULL;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__INVALID_ARGUMENT, "clip_step.clip");
    close(fd);

    /* above max_batch */
    assert_int_equal(dpclip_buffer_alloc(c, 1u << 16, &buf, &mem), 0);
    x = dc_hostile_lin_on(buf, DC_HOSTILE_MAX_BATCH + 1, 1, 4, 4);
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
    assert_string_equal(dpclip_errfield(c), "clip_step.batch_size");
    x = dc_hostile_lin_on(buf, UINT32_MAX, 1, 4, 4);
    assert_int_equal(dc_hostile_run_linear(c, &x), DPCLIP_EINVAL);
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
    dpclip_client *c = dc_hostile_connect();
    dpclip_clip_config cfg = dc_hostile_sum;
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
        dpclip_embedding e = {.name = "emb",
                              .num_embeddings = (uint64_t)V,
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

/* Tied pairs a client gets wrong: each refused naming the field, nothing
 * written, and a sane pair on the same buffers works after. */
static void test_tied_abuse(void **state) {
    (void)state;
    const uint32_t B = 4;
    const int T = 3, d = 4, V = 10;
    dpclip_client *c = dc_hostile_connect();
    dpclip_clip_config cfg = dc_hostile_sum;
    uint64_t buf;
    void *mem;
    dpclip_result res;

    assert_int_equal(dpclip_buffer_alloc(c, 1u << 16, &buf, &mem), 0);
    int32_t *idx = mem;
    float *eg = (float *)((char *)mem + 1024), *a = (float *)((char *)mem + 2048);
    float *g = (float *)((char *)mem + 4096), *w = (float *)((char *)mem + 8192);
    for (int i = 0; i < (int)B * T; i++) idx[i] = (i * 7) % V;
    for (int i = 0; i < (int)B * T * d; i++) eg[i] = 0.01f * (float)(i % 7) - 0.02f;
    for (int i = 0; i < (int)B * T * d; i++) a[i] = 0.03f * (float)(i % 5) - 0.05f;
    for (int i = 0; i < (int)B * T * V; i++) g[i] = 0.02f * (float)(i % 9) - 0.07f;
    for (int i = 0; i < V * d; i++) w[i] = 123.0f;
    dpclip_embedding e = {.name = "wte",
                          .num_embeddings = (uint64_t)V,
                          .indices = {buf, 0, DPCLIP_I32, 2, {B, T, 0}},
                          .output_grad = {buf, 1024, DPCLIP_F32, 3, {B, T, d}},
                          .weight_grad_out = {buf, 8192, DPCLIP_F32, 2, {V, d, 0}}};
    dpclip_linear l = {.name = "lm_head",
                       .activations = {buf, 2048, DPCLIP_F32, 3, {B, T, d}},
                       .output_grad = {buf, 4096, DPCLIP_F32, 3, {B, T, V}}};
    dpclip_step *s = dpclip_step_new(B, &cfg);
    assert_int_equal(dpclip_step_add_embedding(s, &e), 0);
    assert_int_equal(dpclip_step_set_tied(s, 0, 0), DPCLIP_EARG); /* no earlier layer */
    assert_int_equal(dpclip_step_add_linear(s, &l), 0);
    assert_int_equal(dpclip_step_set_tied(s, 1, 1), DPCLIP_EARG);
    assert_int_equal(dpclip_step_set_tied(s, 2, 0), DPCLIP_EARG);
    assert_int_equal(dpclip_step_set_tied(s, 1, 0), 0);

    idx[5] = V; /* an index past the vocabulary in the tied embedding */
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "wte.indices"));
    assert_true(all_equal(w, V * d, 123.0f));
    idx[5] = 1;
    g[7] = NAN; /* a non-finite gradient of the tied linear layer */
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_ENONFINITE);
    assert_non_null(strstr(dpclip_errfield(c), "lm_head"));
    assert_true(all_equal(w, V * d, 123.0f));
    g[7] = 0.0f;
    assert_int_equal(dpclip_run(c, s, &res), 0); /* sane */
    assert_true(res.norms[0] > 0.0f && !all_equal(w, V * d, 123.0f));
    dpclip_result_free(&res);

    /* the later layer writing the shared weight too */
    dpclip_step_reset(s, B);
    l.weight_grad_out = (dpclip_tensor){buf, 12288, DPCLIP_F32, 2, {V, d, 0}};
    assert_int_equal(dpclip_step_add_embedding(s, &e), 0);
    assert_int_equal(dpclip_step_add_linear(s, &l), 0);
    assert_int_equal(dpclip_step_set_tied(s, 1, 0), 0);
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "layers[1].weight_grad_out"));
    /* two embeddings, and weights of different shapes */
    memset(&l.weight_grad_out, 0, sizeof l.weight_grad_out);
    dpclip_step_reset(s, B);
    assert_int_equal(dpclip_step_add_embedding(s, &e), 0);
    assert_int_equal(dpclip_step_add_embedding(s, &e), 0);
    assert_int_equal(dpclip_step_set_tied(s, 1, 0), 0);
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "layers[1].tied_to"));
    dpclip_step_reset(s, B);
    l.activations.shape[2] = 2;
    assert_int_equal(dpclip_step_add_embedding(s, &e), 0);
    assert_int_equal(dpclip_step_add_linear(s, &l), 0);
    assert_int_equal(dpclip_step_set_tied(s, 1, 0), 0);
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EINVAL);
    assert_non_null(strstr(dpclip_errfield(c), "layers[1].tied_to"));
    assert_non_null(strstr(dpclip_errmsg(c), "shape"));
    dpclip_step_free(s);
    dpclip_disconnect(c);
}

static void test_nonfinite(void **state) {
    (void)state;
    const uint32_t B = 6;
    dpclip_client *c = dc_hostile_connect();
    dpclip_clip_config cfg = dc_hostile_sum;
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
    dpclip_client *c = dc_hostile_connect();
    dpclip_clip_config cfg = dc_hostile_sum;
    dpclip_step *s = dpclip_step_new(4, &cfg);
    dpclip_result res;
    uint64_t buf;
    void *mem;
    dc_lin_desc x;

    assert_int_equal(dpclip_buffer_alloc(c, 4096, &buf, &mem), 0);
    x = dc_hostile_lin_on(buf, 4, 2, 4, 4);
    for (int i = 0; i < 3000; i++) assert_int_equal(dpclip_step_add_linear(s, &x.l), 0);
    assert_int_equal(dpclip_run(c, s, &res), DPCLIP_EARG);
    assert_string_equal(dpclip_errfield(c), "frame.length");
    assert_int_equal(dpclip_ping(c), 0);
    dpclip_step_free(s);
    dpclip_disconnect(c);
}

/* --- refunds: a failed step is refunded only if it released nothing --------- */

/* Noise std sigma * C = 1e5 leaves f16's range (65504) in one of the 32
 * weight elements but with probability about 0.49^32; before noise the
 * clipped sum is small (C is far above every norm). sigma = 1 and q = 0.1
 * make each step's spend visible in epsilon. */
#define REFUND_C 1e5f

typedef struct refund_rig {
    dpclip_client *c;
    float *mem; /* activations [4,2,8] at 0, grads [4,2,4] at 1 KiB */
    uint64_t buf;
} refund_rig;

static void refund_open(refund_rig *r, const char *job) {
    dpclip_connect_opts o = {.client_name = "hostile", .job_id = job};
    void *mem;
    assert_int_equal(dpclip_connect(dc_hostile_h.sock, &o, &r->c), 0);
    assert_int_equal(dpclip_buffer_alloc(r->c, 1u << 14, &r->buf, &mem), 0);
    r->mem = mem;
    for (int i = 0; i < 64; i++) r->mem[i] = 0.01f * (float)(i % 11) - 0.05f;
    for (int i = 0; i < 32; i++) r->mem[256 + i] = 0.02f * (float)(i % 5) - 0.04f;
}

/* One noised step, its weight output (at 4 KiB) in f32 or f16; *eps gets
 * the job's epsilon on success. */
static int refund_step(refund_rig *r, dpclip_dtype out, double *eps) {
    dpclip_clip_config cfg = {.max_grad_norm = REFUND_C,
                              .reduction = DPCLIP_SUM,
                              .noise_multiplier = 1.0f,
                              .sample_rate = 0.1};
    dpclip_linear l = {.name = "victim",
                       .activations = {r->buf, 0, DPCLIP_F32, 3, {4, 2, 8}},
                       .output_grad = {r->buf, 1024, DPCLIP_F32, 3, {4, 2, 4}},
                       .weight_grad_out = {r->buf, 4096, out, 2, {4, 8, 0}}};
    dpclip_step *s = dpclip_step_new(4, &cfg);
    dpclip_result res;
    int rc;
    assert_non_null(s);
    assert_int_equal(dpclip_step_add_linear(s, &l), 0);
    rc = dpclip_run(r->c, s, &res);
    if (rc == 0) *eps = res.epsilon;
    dpclip_result_free(&res);
    dpclip_step_free(s);
    return rc;
}

static void assert_same_eps(double got, double want) {
    if (!(fabs(got - want) <= 1e-12 * want))
        fprintf(stderr, "epsilon %.17g, expected %.17g\n", got, want);
    assert_true(isfinite(want) && want > 0);
    assert_true(fabs(got - want) <= 1e-12 * want);
}

/* No number in msg is beyond f16's range: an output that left it once
 * noised is not quoted. */
static void assert_quotes_no_overflow(const char *msg) {
    for (const char *p = msg; *p; p++) {
        if (!isdigit((unsigned char)*p) ||
            (p > msg && (isalnum((unsigned char)p[-1]) || p[-1] == '.')))
            continue;
        double v = strtod(p, NULL);
        if (!(v <= 65504.0)) fprintf(stderr, "message quotes %g: %s\n", v, msg);
        assert_true(v <= 65504.0);
    }
    assert_null(strstr(msg, "inf"));
    assert_null(strstr(msg, "nan"));
}

/* A step whose f16 output overflows once noised fails with nothing written,
 * but where it failed depends on the noise: its spend stands, and its
 * message quotes no noised value. A step refused by a check of its inputs
 * (before any noise) is refunded. Epsilons are compared with a job that
 * only ran good steps of the same (q, sigma). */
static void test_refund_only_before_noise(void **state) {
    (void)state;
    refund_rig ref, noised, input;
    double want[4] = {0}, eps = 0;
    uint16_t *w16;

    refund_open(&ref, "refund-reference");
    for (int i = 1; i <= 3; i++) assert_int_equal(refund_step(&ref, DPCLIP_F32, &want[i]), 0);
    assert_true(want[1] < want[2] && want[2] < want[3]);

    refund_open(&noised, "refund-after-noise");
    assert_int_equal(refund_step(&noised, DPCLIP_F32, &eps), 0);
    assert_same_eps(eps, want[1]);
    w16 = (uint16_t *)((char *)noised.mem + 4096);
    for (int i = 0; i < 32; i++) w16[i] = 0x1234;
    assert_int_equal(refund_step(&noised, DPCLIP_F16, &eps), DPCLIP_ENONFINITE);
    assert_string_equal(dpclip_errfield(noised.c), "victim.weight_grad_out");
    assert_quotes_no_overflow(dpclip_errmsg(noised.c));
    for (int i = 0; i < 32; i++) assert_int_equal(w16[i], 0x1234);
    assert_int_equal(refund_step(&noised, DPCLIP_F32, &eps), 0);
    assert_same_eps(eps, want[3]); /* charged */

    refund_open(&input, "refund-before-noise");
    assert_int_equal(refund_step(&input, DPCLIP_F32, &eps), 0);
    input.mem[5] = NAN;
    assert_int_equal(refund_step(&input, DPCLIP_F16, &eps), DPCLIP_ENONFINITE);
    assert_non_null(strstr(dpclip_errfield(input.c), "activations"));
    input.mem[5] = 0.0f;
    assert_int_equal(refund_step(&input, DPCLIP_F32, &eps), 0);
    assert_same_eps(eps, want[2]); /* refunded */

    dpclip_disconnect(ref.c);
    dpclip_disconnect(noised.c);
    dpclip_disconnect(input.c);
}

/* --- clients that vanish ---------------------------------------------------- */

static void test_disconnect_mid_step(void **state) {
    (void)state;
    const uint32_t B = 32;
    const int64_t T = 64, d = 256, p = 256;
    for (int round = 0; round < 3; round++) {
        dpclip_client *c = dc_hostile_connect();
        dpclip_clip_config cfg = {.max_grad_norm = 1.0f,
                                  .reduction = DPCLIP_MEAN,
                                  .noise_multiplier = 1.0f};
        dpclip_step *s = dpclip_step_new(B, &cfg);
        size_t act = (size_t)(B * T * d) * 4, grd = (size_t)(B * T * p) * 4;
        uint64_t buf, ticket;
        void *mem;
        assert_int_equal(dpclip_buffer_alloc(c, act + grd + (size_t)(p * d) * 4, &buf, &mem), 0);
        float *f = mem;
        for (size_t i = 0; i < (act + grd) / 4; i++)
            f[i] = (float)((i * 2654435761u) % 1000) * 1e-3f;
        dpclip_linear l = {.name = "big",
                           .algo = round == 1 ? DPCLIP_ALGO_GHOST : DPCLIP_ALGO_DIRECT,
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
        int fd = dc_hostile_raw_hello();
        Dpclip__Request req = DPCLIP__REQUEST__INIT;
        Dpclip__Ping ping = DPCLIP__PING__INIT;
        req.id = 2;
        req.body_case = DPCLIP__REQUEST__BODY_PING;
        req.ping = &ping;
        for (int i = 0; i < 1000; i++) dc_raw_send_request(fd, &req); /* replies never read */
        close(fd);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_register_abuse),
        cmocka_unit_test(test_unregistered_buffer),
        cmocka_unit_test(test_foreign_buffer),
        cmocka_unit_test(test_past_the_end),
        cmocka_unit_test(test_shape_overflow),
        cmocka_unit_test(test_inconsistent_shapes),
        cmocka_unit_test(test_batch_bounds),
        cmocka_unit_test(test_embedding_out_of_range),
        cmocka_unit_test(test_nonfinite),
        cmocka_unit_test(test_tied_abuse),
        cmocka_unit_test(test_client_frame_limit),
        cmocka_unit_test(test_refund_only_before_noise),
        cmocka_unit_test(test_disconnect_mid_step),
        cmocka_unit_test(dc_hostile_survivors),
        cmocka_unit_test(dc_hostile_clean_shutdown),
    };
    return cmocka_run_group_tests_name("hostile_steps", tests, dc_hostile_setup,
                                       dc_hostile_teardown);
}
