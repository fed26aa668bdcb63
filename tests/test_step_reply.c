/* daemon/protocol/step_reply.c: the last stage of a step. Its ClipStepReply carries
 * the backend's per-sample norms and coefficients, layer norms only when
 * asked for or clipping per layer, layer coefficients only per layer, the
 * account's epsilon and delta and the daemon's stamps, and packs into a Reply
 * that decodes to the same; the early notice names the step's index and
 * spend; the metrics count a step that ran and one that failed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "dpclip.pb-c.h"
#include "log.h"
#include "step_reply.h"

enum { B = 3, L = 2 };

typedef struct fixture {
    dc_step_call sc;
    dc_layer layers[L];
    float act[L][B * 4], grad[L][B * 5];
} fixture;

/* A step of L linear layers (B x 4 -> B x 5, f32) that ran: its result
 * holds distinct values, so a field copied from the wrong array shows. */
static fixture *make(dc_clip_mode mode, bool want_layer_norms) {
    fixture *f = calloc(1, sizeof *f);
    dc_step_call *sc;
    assert_non_null(f);
    sc = &f->sc;
    for (int l = 0; l < L; l++) {
        dc_layer *ly = &f->layers[l];
        ly->kind = DC_LAYER_LINEAR;
        ly->T = 1;
        ly->d = 4;
        ly->p = 5;
        ly->input = (dc_tensor){f->act[l], DC_F32, 2, {B, 4, 0}};
        ly->grad = (dc_tensor){f->grad[l], DC_F32, 2, {B, 5, 0}};
    }
    sc->step.batch = B;
    sc->step.n_layers = L;
    sc->step.layers = f->layers;
    sc->step.mode = mode;
    sc->step.want_layer_norms = want_layer_norms;
    sc->step.device = -1;
    assert_int_equal(dc_step_result_init(&sc->res, B, L, mode == DC_CLIP_PER_LAYER), 0);
    for (int b = 0; b < B; b++) {
        sc->res.norms[b] = 1.0f + (float)b;
        sc->res.coefs[b] = 0.5f / (float)(b + 1);
    }
    for (int i = 0; i < L * B; i++) {
        sc->res.layer_norms[i] = 10.0f + (float)i;
        if (sc->res.layer_coefs) sc->res.layer_coefs[i] = 0.01f * (float)(i + 1);
    }
    sc->res.compute_ns = 12345;
    sc->res.phase_ns[DC_RUN_WAIT_INPUT] = 2345;
    sc->eps = 1.25;
    sc->delta = 1e-5;
    sc->req_id = 77;
    sc->t_frame = 1000;
    sc->t_recv = 1100;
    sc->t_checked = 1200;
    sc->t_submit = 1300;
    sc->t_start = 1400;
    sc->t_waited = 1500;
    sc->t_end = 1600;
    return f;
}

static void destroy(fixture *f) {
    dc_step_result_free(&f->sc.res);
    free(f);
}

/* Packs the reply into a Reply and decodes it back (the caller frees). */
static Dpclip__Reply *roundtrip(Dpclip__ClipStepReply *cr) {
    Dpclip__Reply reply = DPCLIP__REPLY__INIT;
    uint8_t *buf;
    size_t n;
    Dpclip__Reply *back;
    reply.id = 77;
    reply.body_case = DPCLIP__REPLY__BODY_CLIP_STEP;
    reply.clip_step = cr;
    n = dpclip__reply__get_packed_size(&reply);
    buf = malloc(n ? n : 1);
    assert_non_null(buf);
    assert_int_equal(dpclip__reply__pack(&reply, buf), n);
    back = dpclip__reply__unpack(NULL, n, buf);
    free(buf);
    assert_non_null(back);
    assert_int_equal(back->body_case, DPCLIP__REPLY__BODY_CLIP_STEP);
    return back;
}

static void test_flat(void **state) {
    (void)state;
    fixture *f = make(DC_CLIP_FLAT, false);
    Dpclip__ClipStepReply cr = DPCLIP__CLIP_STEP_REPLY__INIT;
    Dpclip__Reply *back;

    dc_step_reply_fill(&f->sc, 9, &cr);
    assert_int_equal(cr.n_norms, B);
    assert_int_equal(cr.n_coefficients, B);
    for (int b = 0; b < B; b++) {
        assert_true(cr.norms[b] == f->sc.res.norms[b]);
        assert_true(cr.coefficients[b] == f->sc.res.coefs[b]);
    }
    /* not asked for, not per layer: no layer arrays */
    assert_int_equal(cr.n_layer_norms, 0);
    assert_int_equal(cr.n_layer_coefficients, 0);
    assert_int_equal(cr.step_index, 9);
    assert_int_equal(cr.compute_ns, 12345);
    assert_int_equal(cr.input_wait_ns, 2345);
    assert_true(cr.epsilon == 1.25);
    assert_true(cr.delta == 1e-5);
    assert_int_equal(cr.t_received_ns, 1000);
    assert_true(cr.t_replied_ns >= cr.t_received_ns);

    back = roundtrip(&cr);
    assert_int_equal(back->clip_step->n_norms, B);
    for (int b = 0; b < B; b++) assert_true(back->clip_step->coefficients[b] == f->sc.res.coefs[b]);
    assert_int_equal(back->clip_step->n_layer_norms, 0);
    assert_int_equal(back->clip_step->step_index, 9);
    assert_true(back->clip_step->epsilon == 1.25);
    dpclip__reply__free_unpacked(back, NULL);
    destroy(f);
}

static void test_layer_norms_asked(void **state) {
    (void)state;
    fixture *f = make(DC_CLIP_FLAT, true);
    Dpclip__ClipStepReply cr = DPCLIP__CLIP_STEP_REPLY__INIT;

    dc_step_reply_fill(&f->sc, 1, &cr);
    assert_int_equal(cr.n_layer_norms, L * B);
    for (int i = 0; i < L * B; i++) assert_true(cr.layer_norms[i] == f->sc.res.layer_norms[i]);
    assert_int_equal(cr.n_layer_coefficients, 0);
    destroy(f);
}

static void test_per_layer(void **state) {
    (void)state;
    fixture *f = make(DC_CLIP_PER_LAYER, false);
    Dpclip__ClipStepReply cr = DPCLIP__CLIP_STEP_REPLY__INIT;
    Dpclip__Reply *back;

    dc_step_reply_fill(&f->sc, 2, &cr);
    /* per layer: both layer arrays, whether asked for or not */
    assert_int_equal(cr.n_layer_norms, L * B);
    assert_int_equal(cr.n_layer_coefficients, L * B);
    back = roundtrip(&cr);
    assert_int_equal(back->clip_step->n_layer_coefficients, L * B);
    for (int i = 0; i < L * B; i++)
        assert_true(back->clip_step->layer_coefficients[i] == f->sc.res.layer_coefs[i]);
    dpclip__reply__free_unpacked(back, NULL);
    destroy(f);
}

static void test_notice(void **state) {
    (void)state;
    fixture *f = make(DC_CLIP_FLAT, false);
    Dpclip__ClipStepEnqueued n = DPCLIP__CLIP_STEP_ENQUEUED__INIT;

    dc_step_reply_notice(&f->sc, 4, &n);
    assert_int_equal(n.step_index, 4);
    assert_true(n.epsilon == 1.25);
    assert_true(n.delta == 1e-5);
    destroy(f);
}

/* The debug line of f's step, as dc_step_reply_log writes it to stderr. */
static void log_line(const fixture *f, char *out, size_t cap) {
    FILE *tmp = tmpfile();
    int saved = dup(2);
    assert_non_null(tmp);
    assert_true(saved >= 0);
    fflush(stderr);
    assert_true(dup2(fileno(tmp), 2) >= 0);
    dc_log_set_level(DC_LOG_DEBUG);
    dc_step_reply_log(&f->sc, 5, 1, 1800, 1900, 50);
    dc_log_set_level(DC_LOG_INFO);
    fflush(stderr);
    assert_true(dup2(saved, 2) >= 0);
    close(saved);
    rewind(tmp);
    size_t n = fread(out, 1, cap - 1, tmp);
    out[n] = 0;
    fclose(tmp);
}

/* Each part of the debug line is the time between its two stages; a
 * stage the step never reached (it failed waiting for its group: ended
 * 0) gives 0, not the wrapped-around difference. */
static void test_log_spans(void **state) {
    (void)state;
    fixture *f = make(DC_CLIP_FLAT, false);
    char line[2048];

    log_line(f, line, sizeof line);
    assert_non_null(strstr(line, "decode 0.1 us, validate 0.1 us, ledger 0.1 us, queue 0.1 us"));
    assert_non_null(strstr(line, "run 0.1 us"));
    assert_non_null(strstr(line, "reply 0.3 us (hand-off 0.2, send 0.1)"));
    f->sc.t_end = 0;
    log_line(f, line, sizeof line);
    assert_non_null(strstr(line, "run 0.0 us"));
    assert_non_null(strstr(line, "reply 0.0 us (hand-off 0.0, send 0.1)"));
    destroy(f);
}

static void test_count(void **state) {
    (void)state;
    fixture *f = make(DC_CLIP_FLAT, false);
    dc_metrics *m = calloc(1, sizeof *m);
    assert_non_null(m);

    dc_step_reply_count(&f->sc, 1700, m);
    assert_int_equal(m->steps_ok, 1);
    assert_int_equal(m->steps_failed, 0);
    assert_int_equal(m->samples, B);
    assert_int_equal(m->layers, L);
    assert_int_equal(m->compute_ns, 12345);
    /* inputs and output grads of every layer, f32 */
    assert_int_equal(m->bytes_referenced, (uint64_t)L * B * (4 + 5) * sizeof(float));
    assert_int_equal(m->step.count, 1);
    assert_int_equal(m->phase[DC_PH_VALIDATE].count, 1);
    assert_int_equal(m->phase[DC_PH_QUEUE].count, 1);
    assert_int_equal(m->phase[DC_PH_RUN].count, 1);
    assert_int_equal(m->phase[DC_PH_REPLY].count, 1);
    assert_int_equal(m->phase[DC_PH_WAIT_INPUT].count, 0); /* a host step */

    /* a failed step: counted by its code, not as samples */
    f->sc.rc = DC_ENONFINITE;
    f->sc.err.code = DC_ENONFINITE;
    dc_step_reply_count(&f->sc, 1700, m);
    assert_int_equal(m->steps_ok, 1);
    assert_int_equal(m->steps_failed, 1);
    assert_int_equal(m->errors[DC_ENONFINITE], 1);
    assert_int_equal(m->samples, B);
    assert_int_equal(m->step.count, 2);
    free(m);
    destroy(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flat),      cmocka_unit_test(test_layer_norms_asked),
        cmocka_unit_test(test_per_layer), cmocka_unit_test(test_notice),
        cmocka_unit_test(test_count),     cmocka_unit_test(test_log_spans),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
