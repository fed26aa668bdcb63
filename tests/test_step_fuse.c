/* The fused group step (daemon/protocol/step_fuse.c) on its own: it copies
 * the fused step's per-sample tables into every member's, so it checks
 * each member's batch and terms itself, whatever the group believed when it
 * matched them (a group whose step counter had wrapped once fused members
 * of batches 8 and 4, and the split wrote 8 samples into a table of 4). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "step_fuse.h"

/* A member's step call of one layer-less step of batch B, rank `rank`. */
static dc_step_call *member(uint32_t B, uint32_t rank) {
    dc_step_call *sc = calloc(1, sizeof *sc);
    assert_non_null(sc);
    sc->step.batch = B;
    sc->step.max_grad_norm = 1.0f;
    sc->step.reduction = DC_REDUCTION_SUM;
    sc->step.mode = DC_CLIP_FLAT;
    sc->step.device = -1;
    sc->gw.rank = rank;
    assert_int_equal(dc_step_result_init(&sc->res, B, 0, false), 0);
    return sc;
}

static void free_member(dc_step_call *sc) {
    dc_step_result_free(&sc->res);
    free(sc);
}

static void test_members_of_other_batches_refused(void **state) {
    dc_step_call *a = member(8, 0), *b = member(4, 1);
    dc_step_fused f;
    dc_err e;
    (void)state;
    a->fuse_next = b;
    assert_int_equal(dc_step_fuse_build(&f, a, 2, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.batch_size");
    /* and any other term the fused step takes from the first member */
    b->step.batch = 8;
    b->step.max_grad_norm = 2.0f;
    assert_int_equal(dc_step_fuse_build(&f, a, 2, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.clip.max_grad_norm");
    b->step.max_grad_norm = 1.0f;
    b->step.noise_multiplier = 1.0f;
    assert_int_equal(dc_step_fuse_build(&f, a, 2, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.noise_multiplier");
    free_member(a);
    free_member(b);
}

/* Members that agree fuse, and the split hands each its [B] tables. */
static void test_agreeing_members_split(void **state) {
    dc_step_call *a = member(4, 0), *b = member(4, 1);
    dc_step_fused f;
    dc_err e;
    (void)state;
    a->fuse_next = b;
    assert_int_equal(dc_step_fuse_build(&f, a, 2, &e), 0);
    assert_int_equal(f.step.batch, 4);
    for (uint32_t i = 0; i < 4; i++) {
        f.res.norms[i] = (float)i + 0.5f;
        f.res.coefs[i] = 1.0f / ((float)i + 1.0f);
    }
    dc_step_fuse_split(&f);
    for (uint32_t i = 0; i < 4; i++) {
        assert_true(a->res.norms[i] == (float)i + 0.5f && b->res.norms[i] == (float)i + 0.5f);
        assert_true(b->res.coefs[i] == 1.0f / ((float)i + 1.0f));
    }
    dc_step_fuse_free(&f);
    free_member(a);
    free_member(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_members_of_other_batches_refused),
        cmocka_unit_test(test_agreeing_members_split),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
