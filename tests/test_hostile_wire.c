/* Hostile input, the wire under the step cache: the daemon keeps the last
 * step that validated and runs the same bytes again without decoding them
 * (daemon/protocol/peek.h, session_step.c). Frames the decoder refuses, or
 * decodes to another id (fields out of order, a second id), must be answered
 * exactly as without a cached step, while a well-behaved client keeps running
 * exact steps (the fixture: support/hostile.c). tests/fuzz/fuzz_frame.c checks
 * the same on generated frames. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "hostile.h"

static int all_equal(const float *p, int64_t n, float v) {
    for (int64_t i = 0; i < n; i++)
        if (p[i] != v) return 0;
    return 1;
}

/* One f32 linear step with a weight output on a raw connection's buffer, its
 * Request packed with id `id`: the caller frees the bytes. */
typedef struct raw_step {
    Dpclip__TensorRef a, g, w;
    Dpclip__LinearLayer lin;
    Dpclip__Layer layer, *layers[1];
    Dpclip__ClipConfig cc;
    Dpclip__ClipStep cs;
    int64_t sa[3], sg[3], sw[2];
} raw_step;

static void raw_step_init(raw_step *x, uint64_t buf) {
    const int64_t B = 2, T = 2, d = 4, p = 3;
    memset(x, 0, sizeof *x);
    dpclip__tensor_ref__init(&x->a);
    dpclip__tensor_ref__init(&x->g);
    dpclip__tensor_ref__init(&x->w);
    dpclip__linear_layer__init(&x->lin);
    dpclip__layer__init(&x->layer);
    dpclip__clip_config__init(&x->cc);
    dpclip__clip_step__init(&x->cs);
    x->sa[0] = x->sg[0] = B;
    x->sa[1] = x->sg[1] = T;
    x->sa[2] = d;
    x->sg[2] = p;
    x->sw[0] = p;
    x->sw[1] = d;
    x->a.buffer_id = x->g.buffer_id = x->w.buffer_id = buf;
    x->a.dtype = x->g.dtype = x->w.dtype = DPCLIP__DTYPE__F32;
    x->a.n_shape = x->g.n_shape = 3;
    x->w.n_shape = 2;
    x->a.shape = x->sa;
    x->g.shape = x->sg;
    x->w.shape = x->sw;
    x->g.offset = 1024;
    x->w.offset = 2048;
    x->lin.activations = &x->a;
    x->lin.output_grad = &x->g;
    x->lin.weight_grad_out = &x->w;
    x->layer.kind_case = DPCLIP__LAYER__KIND_LINEAR;
    x->layer.linear = &x->lin;
    x->layers[0] = &x->layer;
    x->cc.max_grad_norm = 1.0f;
    x->cc.loss_reduction = DPCLIP__LOSS_REDUCTION__SUM;
    x->cs.batch_size = (uint32_t)B;
    x->cs.n_layers = 1;
    x->cs.layers = x->layers;
    x->cs.clip = &x->cc;
}

static uint8_t *raw_step_pack(raw_step *x, uint64_t id, size_t *n) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    uint8_t *b;
    req.id = id;
    req.body_case = DPCLIP__REQUEST__BODY_CLIP_STEP;
    req.clip_step = &x->cs;
    *n = dpclip__request__get_packed_size(&req);
    b = malloc(*n);
    assert_non_null(b);
    assert_int_equal(dpclip__request__pack(&req, b), *n);
    return b;
}

/* Bytes of a varint field header for id: tag 1, wire type 0. */
static size_t put_id(uint8_t *out, uint64_t id) {
    size_t k = 0;
    out[k++] = 0x08;
    do {
        out[k++] = (uint8_t)((id & 0x7f) | (id > 0x7f ? 0x80 : 0));
        id >>= 7;
    } while (id);
    return k;
}

/* The next reply: a ClipStepReply for `id` with this step index. */
static void expect_step(int fd, uint64_t id, uint64_t step_index) {
    Dpclip__Reply *r = dc_raw_read_reply(fd, 10000);
    assert_non_null(r);
    if (r->body_case != DPCLIP__REPLY__BODY_CLIP_STEP || r->id != id)
        fprintf(stderr, "expected step reply id %llu, got body %d id %llu\n",
                (unsigned long long)id, (int)r->body_case, (unsigned long long)r->id);
    assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_CLIP_STEP);
    assert_int_equal(r->id, id);
    assert_int_equal(r->clip_step->step_index, step_index);
    dpclip__reply__free_unpacked(r, NULL);
}

/* A request id that protobuf-c refuses (an 11-byte varint) in front of the
 * very bytes of the step that just ran: the cached step must not run again
 * (no output written, no step counted); the frame is a PROTOCOL error, as it
 * is without a cached step. */
static void test_cache_malformed_id(void **state) {
    (void)state;
    int fd = dc_hostile_raw_hello();
    float *mem, *w;
    uint64_t buf = dc_raw_register_memfd(fd, 2, 4096, (void **)&mem);
    raw_step x;
    size_t n, k, body;
    uint8_t *ok, bad[512];

    assert_true(buf != 0);
    assert_non_null(mem);
    for (int i = 0; i < 512; i++) mem[i] = 0.01f * (float)(i % 13);
    w = mem + 512;
    raw_step_init(&x, buf);
    ok = raw_step_pack(&x, 3, &n);
    body = n - put_id(bad, 3);
    assert_true(body + 12 <= sizeof bad);
    dc_hostile_send_frame(fd, (uint32_t)n, ok, n);
    expect_step(fd, 3, 1);

    /* 0x08, ten continuation bytes and a last one: 11 bytes of varint */
    k = 0;
    bad[k++] = 0x08;
    for (int i = 0; i < 10; i++) bad[k++] = 0xff;
    bad[k++] = 0x01;
    memcpy(bad + k, ok + (n - body), body);
    k += body;
    assert_null(dpclip__request__unpack(NULL, k, bad)); /* the decoder's verdict */
    for (int i = 0; i < 12; i++) w[i] = -7.0f;
    dc_hostile_send_frame(fd, (uint32_t)k, bad, k);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    assert_true(all_equal(w, 12, -7.0f));
    /* the same step with a proper id is still served, as the second step */
    free(ok);
    ok = raw_step_pack(&x, 4, &n);
    dc_hostile_send_frame(fd, (uint32_t)n, ok, n);
    expect_step(fd, 4, 2);
    free(ok);
    munmap(mem, 4096);
    close(fd);
}

/* Fields may come in any order and the last id wins: a request whose id
 * follows the body is answered with that id, also when the same bytes come
 * again (where the cache would have answered 0), and when another id
 * precedes them. */
static void test_cache_id_after_body(void **state) {
    (void)state;
    int fd = dc_hostile_raw_hello();
    void *mem;
    uint64_t buf = dc_raw_register_memfd(fd, 2, 4096, &mem);
    raw_step x;
    size_t n, k, body, lead;
    uint8_t *ok, frame[512];
    uint64_t steps = 0;

    assert_true(buf != 0);
    memset(mem, 0, 4096);
    raw_step_init(&x, buf);
    ok = raw_step_pack(&x, 5, &n);
    body = n - put_id(frame, 5);
    assert_true(body + 24 <= sizeof frame);
    dc_hostile_send_frame(fd, (uint32_t)n, ok, n);
    expect_step(fd, 5, ++steps);

    /* [body][id 300], twice */
    memcpy(frame, ok + (n - body), body);
    k = body + put_id(frame + body, 300);
    for (int i = 0; i < 2; i++) {
        dc_hostile_send_frame(fd, (uint32_t)k, frame, k);
        expect_step(fd, 300, ++steps);
    }
    /* [id 7][body][id 301]: the decoder takes 301 */
    lead = put_id(frame, 7);
    memcpy(frame + lead, ok + (n - body), body);
    k = lead + body + put_id(frame + lead + body, 301);
    {
        Dpclip__Request *r = dpclip__request__unpack(NULL, k, frame);
        assert_non_null(r);
        assert_int_equal(r->id, 301);
        dpclip__request__free_unpacked(r, NULL);
    }
    for (int i = 0; i < 2; i++) {
        dc_hostile_send_frame(fd, (uint32_t)k, frame, k);
        expect_step(fd, 301, ++steps);
    }
    /* and the plain form keeps working */
    dc_hostile_send_frame(fd, (uint32_t)n, ok, n);
    expect_step(fd, 5, ++steps);
    free(ok);
    munmap(mem, 4096);
    close(fd);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cache_malformed_id),
        cmocka_unit_test(test_cache_id_after_body),
        cmocka_unit_test(dc_hostile_survivors),
        cmocka_unit_test(dc_hostile_clean_shutdown),
    };
    return cmocka_run_group_tests_name("hostile_wire", tests, dc_hostile_setup,
                                       dc_hostile_teardown);
}
