/* daemon/protocol/step_run.c: a step in two worker tasks (a norm group
 * member's norm phase, then its clip phase) against a backend that keeps
 * some layers' per-sample gradients between them (backend.h dc_kept, as
 * the CUDA backend's kept stores do):
 *   - a group member's norm phase keeps for its own clip phase; a norm
 *     pass keeps for its sums steps, which borrow the store (with each
 *     layer's index in the pass) and leave it to the pass;
 *   - a member's seal leaves its kept layers out (their data is never read
 *     again: rewriting it between the phases changes nothing), and checks
 *     every other layer: a rewritten one fails the clip phase, naming it;
 *     a pass's seal leaves out its kept layers without a bias or a tie,
 *     whose sums steps must then name their weight's output and no other
 *     (the backend sums those from the store), and keeps every other;
 *   - the clip phase hands the backend the store, which goes back to it
 *     exactly once, after the clip phase, whether it succeeded or not;
 *   - a failed step with a done flag: its outputs zeroed, then the flag
 *     stored; where they cannot be zeroed (a broken CUDA context) the flag
 *     is never stored, its abandon word is, and the step is abandoned
 *     (its session closes after the error). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "dc_hash.h"
#include "session.h"
#include "step_run.h"

enum { B = 2, L = 3, KEPT_LAYER = 1 };

/* The fake backend: keeps layer KEPT_LAYER when asked; counts calls. */
typedef struct fake {
    dc_backend base;
    dc_kept kept;
    uint8_t layer[L];
    int asked_keep, norms, clips, freed, hashed[L];
    int zeroed, zero_rc; /* zero_outputs' calls, and what it returns */
    const dc_kept *clip_kept;
    const size_t *clip_at;
    const dc_step *step;
    double e_min; /* run_clip's */
} fake;

static int fake_run(dc_backend *be, const dc_step *s, dc_step_result *r, dc_err *e) {
    (void)be;
    (void)s;
    (void)r;
    return dc_err_set(e, DC_EINTERNAL, "", "not called");
}

static void fake_destroy(dc_backend *be) { (void)be; }

static int fake_norms(dc_backend *be, const dc_step *s, double *n2, dc_kept **kept, dc_err *e) {
    fake *f = (fake *)be;
    (void)e;
    f->norms++;
    for (size_t i = 0; i < s->n_layers * s->batch; i++) n2[i] = 1.0 + (double)i;
    if (kept) {
        f->asked_keep++;
        memset(f->layer, 0, sizeof f->layer);
        f->layer[KEPT_LAYER] = 1;
        f->kept.n_layers = L;
        f->kept.layer = f->layer;
        *kept = &f->kept;
    }
    return 0;
}

static int fake_clip(dc_backend *be, const dc_step *s, const double *n2, const double *tot,
                     double e_min, const dc_kept *kept, const size_t *kept_at, dc_step_result *res,
                     dc_err *e) {
    fake *f = (fake *)be;
    f->e_min = e_min;
    (void)s;
    (void)n2;
    (void)tot;
    (void)res;
    (void)e;
    f->clips++;
    f->clip_kept = kept;
    f->clip_at = kept_at;
    return 0;
}

static void fake_kept_free(dc_backend *be, dc_kept *k) {
    fake *f = (fake *)be;
    assert_ptr_equal(k, &f->kept);
    f->freed++;
}

/* A hash that says which layer's tensors it read. */
static int fake_hash(dc_backend *be, const dc_tensor *const *ts, size_t n, uint64_t key,
                     uint64_t *out, dc_err *e) {
    fake *f = (fake *)be;
    (void)e;
    for (size_t i = 0; i < n; i++) {
        for (size_t l = 0; l < f->step->n_layers; l++)
            if (ts[i] == &f->step->layers[l].input || ts[i] == &f->step->layers[l].grad)
                f->hashed[l]++;
        out[i] = dc_hash_bytes(ts[i]->data, (size_t)ts[i]->shape[0] * ts[i]->shape[1] * 4, key);
    }
    return 0;
}

/* What a backend that times its norm phase says of it (the CUDA
 * backend's events): the norms, and the wait for the input. */
enum { FAKE_NORMS_NS = 4321, FAKE_WAIT_NS = 765 };

static void fake_norm_times(dc_backend *be, uint64_t phase_ns[DC_RUN_N]) {
    (void)be;
    phase_ns[DC_RUN_NORMS] = FAKE_NORMS_NS;
    phase_ns[DC_RUN_WAIT_INPUT] = FAKE_WAIT_NS;
}

static const dc_backend_ops fake_ops = {.name = "fake",
                                        .run_step = fake_run,
                                        .destroy = fake_destroy,
                                        .run_norms = fake_norms,
                                        .run_clip = fake_clip,
                                        .kept_free = fake_kept_free,
                                        .tensors_hash = fake_hash,
                                        .norm_times = fake_norm_times};

static int fake_zero(dc_backend *be, const dc_step *s) {
    fake *f = (fake *)be;
    (void)s;
    f->zeroed++;
    return f->zero_rc;
}

/* fake_ops with zero_outputs (a whole step's run_step fails: fake_run) */
static const dc_backend_ops fake_zero_ops = {
    .name = "fake", .run_step = fake_run, .destroy = fake_destroy, .zero_outputs = fake_zero};

typedef struct fixture {
    fake be;
    dc_session s;
    dc_step_call sc;
    dc_layer layers[L];
    float act[L][B * 4], grad[L][B * 5], wout[L][20], bout[L][5];
} fixture;

static fixture *make(void) {
    fixture *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->be.base.ops = &fake_ops;
    f->be.step = &f->sc.step;
    for (int l = 0; l < L; l++) {
        dc_layer *ly = &f->layers[l];
        snprintf(ly->name, sizeof ly->name, "layer%d", l);
        ly->kind = DC_LAYER_LINEAR;
        ly->T = 1;
        ly->d = 4;
        ly->p = 5;
        ly->input = (dc_tensor){f->act[l], DC_F32, 2, {B, 4, 0}};
        ly->grad = (dc_tensor){f->grad[l], DC_F32, 2, {B, 5, 0}};
        ly->weight_grad_out = (dc_tensor){f->wout[l], DC_F32, 2, {5, 4, 0}};
        for (int i = 0; i < B * 4; i++) f->act[l][i] = (float)(l + i);
        for (int i = 0; i < B * 5; i++) f->grad[l][i] = (float)(l - i);
    }
    dc_step_call *sc = &f->sc;
    sc->s = &f->s;
    sc->step.batch = B;
    sc->step.n_layers = L;
    sc->step.layers = f->layers;
    sc->step.mode = DC_CLIP_FLAT;
    sc->step.device = -1;
    sc->n2 = calloc(L * B, sizeof *sc->n2);
    sc->tot = calloc(B, sizeof *sc->tot);
    sc->seal = calloc(L, sizeof *sc->seal);
    assert_non_null(sc->n2);
    assert_non_null(sc->tot);
    assert_non_null(sc->seal);
    for (int b = 0; b < B; b++) sc->tot[b] = 4.0;
    assert_int_equal(dc_step_result_init(&sc->res, B, L, false), 0);
    return f;
}

static void release(fixture *f) {
    dc_step_result_free(&f->sc.res);
    free(f->sc.n2);
    free(f->sc.tot);
    free(f->sc.seal);
    free(f->sc.unsealed);
    free(f);
}

/* The kept layer's data rewritten between the phases: unchecked, and the
 * clip phase gets the store, which goes back once. */
static void test_kept_layer_unsealed(void **state) {
    (void)state;
    fixture *f = make();
    dc_step_run_norms_work(&f->sc.task, &f->be.base);
    assert_int_equal(f->sc.rc, 0);
    assert_int_equal(f->be.asked_keep, 1);
    assert_ptr_equal(f->sc.kept, &f->be.kept);
    assert_int_equal(f->be.hashed[KEPT_LAYER], 0);
    assert_int_equal(f->be.hashed[0], 2); /* its input and its grad */
    assert_int_equal(f->sc.seal[KEPT_LAYER], 0);
    f->act[KEPT_LAYER][0] = 1e30f;
    f->grad[KEPT_LAYER][3] = -7.0f;
    dc_step_run_clip_work(&f->sc.task, &f->be.base);
    if (f->sc.rc) fprintf(stderr, "%s: %s\n", f->sc.err.field, f->sc.err.msg);
    assert_int_equal(f->sc.rc, 0);
    assert_int_equal(f->be.clips, 1);
    assert_ptr_equal(f->be.clip_kept, &f->be.kept);
    assert_int_equal(f->be.hashed[KEPT_LAYER], 0);
    assert_int_equal(f->be.freed, 1);
    assert_null(f->sc.kept);
    release(f);
}

/* A group member's norm phase on a GPU sends its clip phase's bound with
 * its norms: its kept layer's (summed from bf16) raises it above the
 * unkept layers'. Its clip phase clips by the bound the group answered. */
static void test_member_bound(void **state) {
    (void)state;
    fixture *f = make();
    const unsigned how = DC_E_GPU | DC_E_TF32;
    uint8_t kept[L] = {0};
    kept[KEPT_LAYER] = 1;
    f->sc.grouped = true;
    f->sc.step.device = 0; /* the fake reads host memory all the same */
    dc_step_run_norms_work(&f->sc.task, &f->be.base);
    assert_int_equal(f->sc.rc, 0);
    assert_true(f->sc.gw.e == dc_clip_e_phase(&f->sc.step, how, kept));
    assert_true(f->sc.gw.e > dc_clip_e_step(&f->sc.step, how));
    f->sc.e_min = 0.125;
    dc_step_run_clip_work(&f->sc.task, &f->be.base);
    assert_int_equal(f->sc.rc, 0);
    assert_true(f->be.e_min == 0.125);
    release(f);
}

/* Any other layer rewritten: refused naming it, nothing clipped, and the
 * store goes back all the same. */
static void test_unkept_layer_checked(void **state) {
    (void)state;
    fixture *f = make();
    dc_step_run_norms_work(&f->sc.task, &f->be.base);
    assert_int_equal(f->sc.rc, 0);
    f->grad[2][1] += 1.0f;
    dc_step_run_clip_work(&f->sc.task, &f->be.base);
    assert_int_equal(f->sc.rc, DC_EINVAL);
    assert_string_equal(f->sc.err.field, "clip_step.layers");
    assert_non_null(strstr(f->sc.err.msg, "layer2"));
    assert_int_equal(f->be.clips, 0);
    assert_int_equal(f->be.freed, 1);
    assert_null(f->sc.kept);
    release(f);
}

/* A norm pass keeps what its sums steps may sum from, and leaves its kept
 * layer unsealed (no bias, no tie); the others are sealed. */
static void test_pass_keeps_unsealed(void **state) {
    (void)state;
    fixture *f = make();
    dc_step_run_pass_work(&f->sc.task, &f->be.base);
    assert_int_equal(f->sc.rc, 0);
    assert_int_equal(f->be.norms, 1);
    assert_int_equal(f->be.asked_keep, 1);
    assert_ptr_equal(f->sc.kept, &f->be.kept);
    for (int l = 0; l < L; l++) {
        assert_int_equal(f->be.hashed[l], l == KEPT_LAYER ? 0 : 2);
        assert_int_equal(f->sc.unsealed[l], l == KEPT_LAYER);
    }
    /* its timed parts are the step's, for the metrics (a norm phase has
     * no result of its own) */
    assert_int_equal(f->sc.res.phase_ns[DC_RUN_NORMS], FAKE_NORMS_NS);
    assert_int_equal(f->sc.res.phase_ns[DC_RUN_WAIT_INPUT], FAKE_WAIT_NS);
    assert_int_equal(f->sc.res.phase_ns[DC_RUN_CLIPPING], 0);
    f->sc.kept = NULL; /* (the pass would take it: nothing to give back here) */
    release(f);
}

/* A kept layer with a bias (whose sum reads the client's output grads) or
 * a tie (whose use reads the client's data) stays sealed in the pass. */
static void test_pass_seals_kept_bias_and_tie(void **state) {
    (void)state;
    for (int which = 0; which < 2; which++) {
        fixture *f = make();
        if (which == 0) f->layers[KEPT_LAYER].has_bias = true;
        else f->layers[KEPT_LAYER].tie = 1; /* tied to layer 0 */
        dc_step_run_pass_work(&f->sc.task, &f->be.base);
        assert_int_equal(f->sc.rc, 0);
        assert_int_equal(f->be.hashed[KEPT_LAYER], 2);
        assert_int_equal(f->sc.unsealed[KEPT_LAYER], 0);
        f->sc.kept = NULL;
        release(f);
    }
}

/* A sums step with its pass's store, lent: the clip phase gets it with
 * each layer's index in the pass; the layers the pass sealed are checked
 * (one rewritten is refused, naming it), the unsealed kept one is neither
 * read nor checked (its data rewritten changes nothing: its sum comes from
 * the store); the store stays with the pass either way. */
static void test_sums_step_borrows(void **state) {
    (void)state;
    fixture *f = make();
    size_t at[L] = {2, 0, 1};
    dc_step_run_pass_work(&f->sc.task, &f->be.base); /* the seals, as the pass's */
    assert_int_equal(f->sc.rc, 0);
    f->sc.kept_borrowed = true;
    f->sc.pass_at = at;
    f->act[KEPT_LAYER][2] += 1.0f;
    f->grad[KEPT_LAYER][0] = 1e30f;
    dc_step_run_sums_work(&f->sc.task, &f->be.base);
    if (f->sc.rc) fprintf(stderr, "%s: %s\n", f->sc.err.field, f->sc.err.msg);
    assert_int_equal(f->sc.rc, 0);
    assert_ptr_equal(f->be.clip_kept, &f->be.kept);
    assert_ptr_equal(f->be.clip_at, at);
    assert_int_equal(f->be.hashed[KEPT_LAYER], 0);
    assert_int_equal(f->be.hashed[0], 4);
    assert_int_equal(f->be.freed, 0);

    f->sc.kept = &f->be.kept; /* the next sums step's loan */
    f->grad[2][1] += 1.0f;
    dc_step_run_sums_work(&f->sc.task, &f->be.base);
    assert_int_equal(f->sc.rc, DC_EINVAL);
    assert_non_null(strstr(f->sc.err.msg, "layer2"));
    assert_int_equal(f->be.clips, 1);
    assert_int_equal(f->be.freed, 0);
    f->sc.pass_at = NULL;
    release(f);
}

/* A sums step naming an unsealed kept layer but not its weight's output,
 * or with its bias's too (which would read the client's unsealed output
 * grads), is refused naming the layer, before anything is read or summed. */
static void test_sums_step_unsealed_needs_weight_out(void **state) {
    (void)state;
    for (int which = 0; which < 2; which++) {
        fixture *f = make();
        size_t at[L] = {0, 1, 2};
        dc_step_run_pass_work(&f->sc.task, &f->be.base);
        assert_int_equal(f->sc.rc, 0);
        f->sc.kept_borrowed = true;
        f->sc.pass_at = at;
        dc_layer *ly = &f->layers[KEPT_LAYER];
        if (which == 0) {
            ly->weight_grad_out.data = NULL;
        } else { /* (the pass's layer had no bias: a sums step's must match it) */
            ly->has_bias = true;
            ly->bias_grad_out = (dc_tensor){f->bout[KEPT_LAYER], DC_F32, 1, {5, 0, 0}};
        }
        int hashed = f->be.hashed[0];
        dc_step_run_sums_work(&f->sc.task, &f->be.base);
        assert_int_equal(f->sc.rc, DC_EINVAL);
        assert_string_equal(f->sc.err.field, "clip_step.layers");
        assert_non_null(strstr(f->sc.err.msg, "layer1"));
        assert_int_equal(f->be.clips, 0);
        assert_int_equal(f->be.hashed[0], hashed);
        assert_int_equal(f->be.freed, 0);
        f->sc.pass_at = NULL;
        f->sc.kept = NULL;
        release(f);
    }
}

/* A whole step with a done flag of `words` words that fails on the device:
 * zero_outputs returns zero_rc. */
static fixture *failed_flagged(int zero_rc, int words, uint32_t flag[2]) {
    fixture *f = make();
    f->be.base.ops = &fake_zero_ops;
    f->be.zero_rc = zero_rc;
    flag[0] = flag[1] = 0;
    f->sc.step.done_flag = &flag[0];
    f->sc.step.done_abandon = words == 2 ? &flag[1] : NULL;
    f->sc.done_value = 17;
    dc_step_run_work(&f->sc.task, &f->be.base);
    assert_int_equal(f->sc.rc, DC_EINTERNAL); /* (fake_run's failure) */
    assert_int_equal(f->be.zeroed, 1);
    return f;
}

/* The outputs zeroed: the flag stored, the abandon word left alone. */
static void test_failed_step_zeroed_then_flagged(void **state) {
    (void)state;
    uint32_t flag[2];
    fixture *f = failed_flagged(0, 2, flag);
    assert_int_equal(flag[0], 17);
    assert_int_equal(flag[1], 0);
    assert_false(f->sc.abandoned);
    assert_null(strstr(f->sc.err.msg, "could not be zeroed"));
    release(f);
}

/* The outputs not zeroed: the flag never stored (the stream behind it
 * would apply them), the abandon word stored where the flag has one, the
 * step abandoned, and its error says so. */
static void test_failed_step_unzeroed_is_abandoned(void **state) {
    (void)state;
    for (int words = 1; words <= 2; words++) {
        uint32_t flag[2];
        fixture *f = failed_flagged(DC_EUNAVAIL, words, flag);
        assert_int_equal(flag[0], 0);
        assert_int_equal(flag[1], words == 2 ? 17 : 0);
        assert_true(f->sc.abandoned);
        assert_non_null(strstr(f->sc.err.msg, "not called")); /* the failure's own message */
        assert_non_null(strstr(f->sc.err.msg, "could not be zeroed"));
        release(f);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_member_bound),
        cmocka_unit_test(test_failed_step_zeroed_then_flagged),
        cmocka_unit_test(test_failed_step_unzeroed_is_abandoned),
        cmocka_unit_test(test_kept_layer_unsealed),
        cmocka_unit_test(test_unkept_layer_checked),
        cmocka_unit_test(test_pass_keeps_unsealed),
        cmocka_unit_test(test_pass_seals_kept_bias_and_tie),
        cmocka_unit_test(test_sums_step_borrows),
        cmocka_unit_test(test_sums_step_unsealed_needs_weight_out),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
