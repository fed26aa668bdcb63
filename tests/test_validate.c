/* daemon/protocol/validate.c: every field of a ClipStep is checked before any work,
 * and each rejection names the field. */
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "validate.h"

#define BUFSZ (1u << 20)

typedef struct fx {
    dc_registry reg;
    uint64_t buf; /* the registered buffer's id */
    dc_limits lim;
    /* message storage */
    Dpclip__TensorRef act, grad, wout, bout, nout;
    int64_t act_shape[3], grad_shape[3], wout_shape[2], bout_shape[1], nout_shape[1];
    Dpclip__LinearLayer lin;
    Dpclip__Layer layer;
    Dpclip__Layer *layers[1];
    Dpclip__ClipConfig clip;
    Dpclip__ClipStep step;
} fx;

static void ref_init(Dpclip__TensorRef *r, int64_t *shape, uint64_t buf, uint64_t off,
                     Dpclip__DType dt, int nd, int64_t a, int64_t b, int64_t c) {
    dpclip__tensor_ref__init(r);
    r->buffer_id = buf;
    r->offset = off;
    r->dtype = dt;
    r->n_shape = (size_t)nd;
    r->shape = shape;
    shape[0] = a;
    if (nd > 1) shape[1] = b;
    if (nd > 2) shape[2] = c;
}

/* A valid step: one Linear, B=4, T=3, d=5, p=6, f32, bias, outputs. */
static int setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    dc_err e;
    int fd = memfd_create("v", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, BUFSZ), 0);
    assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    dc_registry_init(&f->reg);
    f->buf = 42;
    assert_int_equal(dc_registry_add_shm(&f->reg, f->buf, fd, 0, NULL, &e), 0);
    close(fd);
    f->lim.max_batch = 64;
    f->lim.max_layers = 8;
    f->lim.max_frame = 1 << 20;

    ref_init(&f->act, f->act_shape, f->buf, 0, DPCLIP__DTYPE__F32, 3, 4, 3, 5);
    ref_init(&f->grad, f->grad_shape, f->buf, 4096, DPCLIP__DTYPE__BF16, 3, 4, 3, 6);
    ref_init(&f->wout, f->wout_shape, f->buf, 8192, DPCLIP__DTYPE__F32, 2, 6, 5, 0);
    ref_init(&f->bout, f->bout_shape, f->buf, 16384, DPCLIP__DTYPE__F32, 1, 6, 0, 0);
    ref_init(&f->nout, f->nout_shape, f->buf, 20000, DPCLIP__DTYPE__F32, 1, 4, 0, 0);
    dpclip__linear_layer__init(&f->lin);
    f->lin.activations = &f->act;
    f->lin.output_grad = &f->grad;
    f->lin.has_bias = 1;
    f->lin.weight_grad_out = &f->wout;
    f->lin.bias_grad_out = &f->bout;
    dpclip__layer__init(&f->layer);
    f->layer.name = "fc1";
    f->layer.kind_case = DPCLIP__LAYER__KIND_LINEAR;
    f->layer.linear = &f->lin;
    f->layers[0] = &f->layer;
    dpclip__clip_config__init(&f->clip);
    f->clip.max_grad_norm = 1.0f;
    f->clip.loss_reduction = DPCLIP__LOSS_REDUCTION__MEAN;
    dpclip__clip_step__init(&f->step);
    f->step.batch_size = 4;
    f->step.n_layers = 1;
    f->step.layers = f->layers;
    f->step.clip = &f->clip;
    f->step.noise_multiplier = 1.0f;
    f->step.norms_out = &f->nout;
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fx *f = *state;
    dc_registry_destroy(&f->reg);
    free(f);
    return 0;
}

/* Validates and expects failure with `code` and a field containing `field`. */
static void expect_err(fx *f, int code, const char *field) {
    dc_step s;
    dc_err e;
    dc_err_clear(&e);
    int rc = dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e);
    if (rc != code || !strstr(e.field, field))
        fail_msg("expected code %d field ~'%s', got %d field '%s' (%s)", code, field, rc, e.field,
                 e.msg);
    assert_null(s.layers);
}

static void test_valid_step(void **state) {
    fx *f = *state;
    dc_step s;
    dc_err e;
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    assert_int_equal(s.batch, 4);
    assert_int_equal(s.n_layers, 1);
    assert_int_equal(s.device, -1);
    assert_int_equal(s.reduction, DC_REDUCTION_MEAN);
    assert_int_equal(s.expected_batch, 4); /* 0 means the batch size */
    const dc_layer *l = &s.layers[0];
    assert_string_equal(l->name, "fc1");
    assert_int_equal(l->kind, DC_LAYER_LINEAR);
    assert_int_equal(l->T, 3);
    assert_int_equal(l->d, 5);
    assert_int_equal(l->p, 6);
    assert_true(l->has_bias);
    assert_int_equal(l->grad.dtype, DC_BF16);
    const dc_buffer *b = dc_registry_find(&f->reg, f->buf);
    assert_ptr_equal(l->input.data, b->base);
    assert_ptr_equal(l->grad.data, (char *)b->base + 4096);
    assert_ptr_equal(s.norms_out.data, (char *)b->base + 20000);
    assert_null(s.coefs_out.data);
    dc_validate_step_free(&s);

    /* 2D input: T = 1; unnamed layers are called by position. */
    f->act.n_shape = 2;
    f->act_shape[1] = 5;
    f->grad.n_shape = 2;
    f->grad_shape[1] = 6;
    f->layer.name = "";
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    assert_int_equal(s.layers[0].T, 1);
    assert_string_equal(s.layers[0].name, "layers[0]");
    dc_validate_step_free(&s);
}

static void test_batch_and_layers(void **state) {
    fx *f = *state;
    f->step.batch_size = 0;
    expect_err(f, DC_EINVAL, "clip_step.batch_size");
    f->step.batch_size = 65;
    expect_err(f, DC_EINVAL, "clip_step.batch_size");
    { /* the refusal names the setting that would let it through */
        dc_step s;
        dc_err e;
        dc_err_clear(&e);
        assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), DC_EINVAL);
        assert_non_null(strstr(e.msg, "limits.max_batch"));
    }
    f->step.batch_size = 4;
    f->step.n_layers = 0;
    expect_err(f, DC_EINVAL, "clip_step.layers");
}

static void test_clip_config(void **state) {
    fx *f = *state;
    f->clip.max_grad_norm = 0.0f;
    expect_err(f, DC_EINVAL, "clip_step.clip.max_grad_norm");
    f->clip.max_grad_norm = (float)NAN;
    expect_err(f, DC_EINVAL, "clip_step.clip.max_grad_norm");
    f->clip.max_grad_norm = 1.0f;
    f->clip.loss_reduction = 0;
    expect_err(f, DC_EINVAL, "clip_step.clip.loss_reduction");
    f->clip.loss_reduction = DPCLIP__LOSS_REDUCTION__SUM;
    f->step.noise_multiplier = -1.0f;
    expect_err(f, DC_EINVAL, "clip_step.noise_multiplier");
    f->step.noise_multiplier = 1.0f;
    f->clip.mode = DPCLIP__CLIPPING_MODE__PER_LAYER; /* layer has no threshold */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].max_grad_norm");
    f->clip.mode = DPCLIP__CLIPPING_MODE__FLAT;
    f->step.clip = NULL;
    expect_err(f, DC_EINVAL, "clip_step.clip");
}

static void test_tensor_refs(void **state) {
    fx *f = *state;
    f->act.buffer_id = 43; /* never registered here */
    expect_err(f, DC_ENOTFOUND, "clip_step.layers[0].linear.activations.buffer_id");
    f->act.buffer_id = f->buf;

    f->act.offset = BUFSZ - 4 * 3 * 5 * 4 + 4; /* 4 bytes past the end */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.offset");
    f->act.offset = UINT64_MAX - 3; /* offset + size wraps around */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.offset");
    f->act.offset = 2; /* misaligned f32 */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.offset");
    f->act.offset = 0;

    /* A shape whose product overflows 64 bits while each dim is positive. */
    f->act_shape[1] = INT64_C(1) << 40;
    f->act_shape[2] = INT64_C(1) << 40;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.shape");
    /* Product fits, byte size does not. */
    f->act_shape[1] = INT64_C(1) << 30;
    f->act_shape[2] = INT64_C(1) << 30;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.shape");
    f->act_shape[1] = 3;
    f->act_shape[2] = -5;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.shape");
    f->act_shape[2] = 5;

    f->act.dtype = DPCLIP__DTYPE__I32;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.dtype");
    f->act.dtype = 99;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.dtype");
    {
        dc_step s;
        dc_err e;
        assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), DC_EINVAL);
        assert_string_equal(e.msg, "unknown dtype 99"); /* not "dtype unspecified" */
    }
    f->act.dtype = DPCLIP__DTYPE__F32;
    f->act.n_shape = 4;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.shape");
    f->act.n_shape = 3;
    f->lin.activations = NULL;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations");
}

static void test_inconsistent_shapes(void **state) {
    fx *f = *state;
    f->act_shape[0] = 5; /* batch mismatch */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.activations.shape");
    f->act_shape[0] = 4;
    f->grad_shape[1] = 2; /* T mismatch */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.output_grad.shape");
    f->grad_shape[1] = 3;
    f->grad.n_shape = 2; /* rank mismatch */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.output_grad.shape");
    f->grad.n_shape = 3;
    f->wout_shape[0] = 5; /* [p, d] expected */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.weight_grad_out.shape");
    f->wout_shape[0] = 6;
    f->lin.has_bias = 0; /* bias output without a bias */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].linear.bias_grad_out");
    f->lin.has_bias = 1;
    f->nout_shape[0] = 3;
    expect_err(f, DC_EINVAL, "clip_step.norms_out.shape");
    f->nout_shape[0] = 4;
    f->nout.dtype = DPCLIP__DTYPE__BF16;
    expect_err(f, DC_EINVAL, "clip_step.norms_out.dtype");
    f->nout.dtype = DPCLIP__DTYPE__F32;
    f->layer.kind_case = DPCLIP__LAYER__KIND__NOT_SET;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].kind");
}

static void test_embedding_and_norm_layers(void **state) {
    fx *f = *state;
    Dpclip__EmbeddingLayer emb = DPCLIP__EMBEDDING_LAYER__INIT;
    Dpclip__TensorRef idx;
    int64_t idx_shape[2];
    dc_step s;
    dc_err e;

    ref_init(&idx, idx_shape, f->buf, 32768, DPCLIP__DTYPE__I64, 2, 4, 3, 0);
    f->grad_shape[2] = 5; /* [B,T,d] with d=5 */
    emb.indices = &idx;
    emb.output_grad = &f->grad;
    emb.num_embeddings = 100;
    f->layer.kind_case = DPCLIP__LAYER__KIND_EMBEDDING;
    f->layer.embedding = &emb;
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    assert_int_equal(s.layers[0].kind, DC_LAYER_EMBEDDING);
    assert_int_equal(s.layers[0].T, 3);
    assert_int_equal(s.layers[0].d, 5);
    assert_int_equal(s.layers[0].vocab, 100);
    dc_validate_step_free(&s);

    emb.has_padding_idx = 1;
    emb.padding_idx = 100;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].embedding.padding_idx");
    emb.has_padding_idx = 0;
    emb.num_embeddings = 0;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].embedding.num_embeddings");
    emb.num_embeddings = 100;
    idx.dtype = DPCLIP__DTYPE__F32;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].embedding.indices.dtype");
    idx.dtype = DPCLIP__DTYPE__I32;
    f->grad.n_shape = 2; /* indices [B,T] need grads [B,T,d] */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].embedding.output_grad.shape");
    f->grad.n_shape = 3;

    Dpclip__LayerNormLayer ln = DPCLIP__LAYER_NORM_LAYER__INIT;
    f->act_shape[2] = 5;
    ln.input = &f->act;
    ln.output_grad = &f->grad;
    ln.eps = 1e-5f;
    f->layer.kind_case = DPCLIP__LAYER__KIND_LAYER_NORM;
    f->layer.layer_norm = &ln;
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    assert_int_equal(s.layers[0].kind, DC_LAYER_LAYERNORM);
    assert_true(s.layers[0].eps > 0.0f);
    dc_validate_step_free(&s);
    ln.eps = 0.0f;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].layer_norm.eps");
    ln.eps = 1e-5f;
    f->grad_shape[2] = 6;
    expect_err(f, DC_EINVAL, "clip_step.layers[0].layer_norm.output_grad.shape");
}

/* Tied parameters: layer 1 (the fixture's Linear, [p, d] = [6, 5]) names
 * layer 0, an embedding [6, 5], as the holder of its weight. */
static void test_tied_layers(void **state) {
    fx *f = *state;
    Dpclip__EmbeddingLayer emb = DPCLIP__EMBEDDING_LAYER__INIT;
    Dpclip__Layer el = DPCLIP__LAYER__INIT;
    Dpclip__TensorRef idx, eg, ewo;
    int64_t idx_shape[2], eg_shape[3], ewo_shape[2];
    Dpclip__Layer *two[2] = {&el, &f->layer};
    dc_step s;
    dc_err e;

    ref_init(&idx, idx_shape, f->buf, 32768, DPCLIP__DTYPE__I64, 2, 4, 7, 0);
    ref_init(&eg, eg_shape, f->buf, 40960, DPCLIP__DTYPE__F32, 3, 4, 7, 5);
    ref_init(&ewo, ewo_shape, f->buf, 49152, DPCLIP__DTYPE__F32, 2, 6, 5, 0);
    emb.indices = &idx;
    emb.output_grad = &eg;
    emb.num_embeddings = 6;
    emb.weight_grad_out = &ewo;
    el.kind_case = DPCLIP__LAYER__KIND_EMBEDDING;
    el.embedding = &emb;
    el.name = "wte";
    f->step.layers = two;
    f->step.n_layers = 2;
    f->layer.tied_to = 1;
    f->lin.weight_grad_out = NULL;
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    assert_int_equal(s.layers[0].tie, 2);
    assert_true(s.layers[0].tie_owner);
    assert_int_equal(s.layers[1].tie, 1);
    assert_false(s.layers[1].tie_owner);
    assert_true(dc_layer_tied_later(&s.layers[1]) && !dc_layer_norm_bias(&s.layers[1]));
    assert_true(dc_layer_norm_bias(&(dc_layer){.has_bias = true}));
    dc_validate_step_free(&s);

    f->lin.weight_grad_out = &f->wout; /* only the owner writes the weight */
    expect_err(f, DC_EINVAL, "clip_step.layers[1].weight_grad_out");
    f->lin.weight_grad_out = NULL;
    f->layer.tied_to = 2; /* itself */
    expect_err(f, DC_EINVAL, "clip_step.layers[1].tied_to");
    f->layer.tied_to = 1;
    el.tied_to = 1; /* the first layer cannot name an earlier one */
    expect_err(f, DC_EINVAL, "clip_step.layers[0].tied_to");
    el.tied_to = 0;
    emb.num_embeddings = 7; /* [7, 5] against [6, 5] */
    ewo_shape[0] = 7;
    expect_err(f, DC_EINVAL, "clip_step.layers[1].tied_to");
    emb.num_embeddings = 6;
    ewo_shape[0] = 6;
    f->clip.mode = DPCLIP__CLIPPING_MODE__PER_LAYER;
    f->layer.max_grad_norm = el.max_grad_norm = 1.0f;
    expect_err(f, DC_EINVAL, "clip_step.layers[1].tied_to");
    f->clip.mode = DPCLIP__CLIPPING_MODE__FLAT;
    f->layer.replicated = 1;
    expect_err(f, DC_EINVAL, "clip_step.layers[1].tied_to");
    el.replicated = 1;
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    dc_validate_step_free(&s);
    el.replicated = f->layer.replicated = 0;

    /* two linear layers, and a third layer tied to an owner already tied */
    Dpclip__Layer *three[3] = {&el, &f->layer, &f->layer};
    f->step.layers = three;
    f->step.n_layers = 3;
    expect_err(f, DC_EINVAL, "clip_step.layers[2].tied_to");
    f->layer.tied_to = 0;
    Dpclip__Layer tl = f->layer;
    tl.tied_to = 2;
    three[2] = &tl;
    expect_err(f, DC_EINVAL, "clip_step.layers[2].tied_to"); /* linear with linear */
    f->step.layers = f->layers;
    f->step.n_layers = 1;
}

/* What a step costs is bounded before it is accepted: each limit refuses
 * with DC_ENOSPACE naming its setting, and a step within all of them passes.
 * The fixture's step: B = 4, one Linear T = 3, d = 5, p = 6, host memory. */
static void expect_limit(fx *f, const char *setting) {
    dc_step s;
    dc_err e;
    int rc = dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e);
    if (rc != DC_ENOSPACE || !strstr(e.msg, setting))
        fail_msg("expected %s, got %d %s: %s", setting, rc, e.field, e.msg);
    assert_null(s.layers);
}

static void test_step_cost_limits(void **state) {
    fx *f = *state;
    dc_step s;
    dc_err e;
    dc_step_cost c;
    /* the estimate itself: 4 samples x 1 layer; flops of the direct norms
     * (d p = 30 <= T (d + p) = 33) and the clipped-sum GEMM */
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    dc_step_cost_estimate(&s, &c);
    assert_int_equal(c.samples, 4);
    assert_true(fabs(c.gflop * 1e9 - (4 * 2.0 * 3 * 5 * 6 + 2.0 * 12 * 5 * 6)) < 1e-3);
    assert_true(c.host_bytes > 4 * 6 * 5 * 4); /* at least the staged weight sum */
    uint64_t bytes = c.host_bytes;
    /* the same step on a GPU holds no CPU scratch */
    s.device = 0;
    dc_step_cost_estimate(&s, &c);
    assert_true(c.host_bytes < bytes);
    dc_validate_step_free(&s);

    f->lim.max_step_samples = 3;
    expect_limit(f, "limits.max_step_samples");
    f->lim.max_step_samples = 4;
    f->lim.max_step_memory = bytes - 1;
    expect_limit(f, "limits.max_step_memory");
    f->lim.max_step_memory = bytes;
    f->lim.max_step_gflop = 1e-9;
    expect_limit(f, "limits.max_step_gflop");
    f->lim.max_step_gflop = 1.0;
    f->lim.max_gpu_step_gflop = 1e-9; /* a host step is not held to the GPU's */
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    dc_validate_step_free(&s);
}

/* With a mean loss, expected_batch_size 0 divides by the actual batch size,
 * which under Poisson sampling (q < 1) is released without noise: refused,
 * naming the field. q = 1 (and a step stating no rate, which the ledger
 * counts as 1) keeps the batch size as the divisor; SUM has none. */
static void test_mean_needs_expected_batch(void **state) {
    fx *f = *state;
    dc_step s;
    dc_err e;
    f->step.sample_rate = 0.01;
    expect_err(f, DC_EINVAL, "clip_step.clip.expected_batch_size");
    f->clip.expected_batch_size = 256;
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    assert_int_equal(s.expected_batch, 256);
    dc_validate_step_free(&s);
    f->clip.expected_batch_size = 0;
    f->clip.loss_reduction = DPCLIP__LOSS_REDUCTION__SUM;
    assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
    dc_validate_step_free(&s);
    f->clip.loss_reduction = DPCLIP__LOSS_REDUCTION__MEAN;
    for (int i = 0; i < 2; i++) {
        f->step.sample_rate = i ? 1.0 : 0.0;
        assert_int_equal(dc_validate_step(&f->step, &f->reg, &f->lim, &s, &e), 0);
        assert_int_equal(s.expected_batch, 4);
        dc_validate_step_free(&s);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_valid_step, setup, teardown),
        cmocka_unit_test_setup_teardown(test_batch_and_layers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_clip_config, setup, teardown),
        cmocka_unit_test_setup_teardown(test_mean_needs_expected_batch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tensor_refs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_inconsistent_shapes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_embedding_and_norm_layers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_step_cost_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tied_layers, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
