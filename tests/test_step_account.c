/* daemon/protocol/step_account.c: the accounting stage of a step, alone (a ledger and
 * a loop, no session). Terms out of range are refused naming the field; a
 * step without a sample rate counts as q = 1 or is refused under
 * ledger.require_sample_rate; the charge spends, and a refund takes it back;
 * a norm group's member past rank 0 is covered, and a noiseless step that
 * declares no data parallelism is charged (no privacy); a data-parallel
 * logical step is charged once, by its first member, at the account's sigma,
 * its other members are covered and wait for that charge to be durable,
 * and its charge is refunded only while no other member took it; the
 * account's and the node's budgets refuse naming themselves and
 * are counted; a new (q, sigma) pair waits for its curve; with a persistent
 * ledger the step waits for its spend to be on disk, and a write that fails
 * refuses it (field "ledger") with the spend refunded. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "step_account.h"

static char g_dir[256];

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "%s/dpclip-step-account.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    char cmd[600];
    (void)state;
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s.moved'", g_dir, g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* A step call as the session hands it to the stage: its terms and its sigma. */
static dc_step_call *call_of(double q, float sigma, double delta, double eps_budget) {
    dc_step_call *sc = calloc(1, sizeof *sc);
    assert_non_null(sc);
    sc->params.sample_rate = q;
    sc->params.target_delta = delta;
    sc->params.target_epsilon = eps_budget;
    sc->step.noise_multiplier = sigma;
    return sc;
}

static int g_resumed, g_resume_rc;
static dc_err g_resume_err;

static void resume(dc_step_call *sc, int rc, const dc_err *err) {
    (void)sc;
    g_resumed++;
    g_resume_rc = rc;
    if (err) g_resume_err = *err;
}

static void test_check(void **state) {
    dc_host_cfg c;
    dc_step_call *sc;
    dc_err e;
    (void)state;

    memset(&c, 0, sizeof c);
    sc = call_of(1.5, 1.0f, 0, 0);
    assert_int_equal(dc_step_account_check(sc, &c, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.sample_rate");
    sc->params.sample_rate = 0.01;
    sc->params.target_delta = 1.0;
    assert_int_equal(dc_step_account_check(sc, &c, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.target_delta");
    sc->params.target_delta = 1e-5;
    sc->params.target_epsilon = INFINITY;
    assert_int_equal(dc_step_account_check(sc, &c, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.target_epsilon");
    sc->params.target_epsilon = 0;
    assert_int_equal(dc_step_account_check(sc, &c, &e), 0);
    assert_true(sc->q == 0.01);
    assert_true(sc->sigma == 1.0);

    /* no sample rate: no amplification is assumed, or it is refused */
    sc->params.sample_rate = 0;
    assert_int_equal(dc_step_account_check(sc, &c, &e), 0);
    assert_true(sc->q == 1.0);
    c.require_sample_rate = true;
    assert_int_equal(dc_step_account_check(sc, &c, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.sample_rate");
    assert_non_null(strstr(e.msg, "ledger.require_sample_rate"));
    free(sc);
}

static void test_charge_and_refund(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_host_cfg c;
    dc_metrics *m = calloc(1, sizeof *m);
    dc_step_call *sc;
    dc_step_charge kind;
    dc_err e;
    (void)state;

    memset(&c, 0, sizeof c);
    assert_non_null(m);
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    acct = dc_ledger_account_get(&l, 1000, "charge");
    acct->sessions = 1;
    sc = call_of(0.01, 1.0f, 0, 0);
    assert_int_equal(dc_step_account_check(sc, &c, &e), 0);
    assert_int_equal(dc_step_account_terms(sc, acct, &e), 0);
    assert_int_equal(dc_step_account_charge(sc, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_CHARGED);
    assert_ptr_equal(sc->account, acct);
    assert_int_equal(acct->steps, 1);
    assert_true(acct->eps > 0);
    assert_true(sc->eps == acct->eps);
    assert_true(sc->delta == 1e-5);

    /* it released nothing: the spend goes back, once */
    dc_step_account_refund(sc);
    assert_null(sc->account);
    assert_int_equal(acct->steps, 0);
    assert_true(acct->eps == 0);
    dc_step_account_refund(sc);
    assert_int_equal(acct->steps, 0);

    /* a norm group's member past rank 0: rank 0 pays for the group step */
    assert_int_equal(dc_step_account_charge(sc, acct, true, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_COVERED);
    assert_null(sc->account);
    assert_int_equal(acct->steps, 0);

    /* a noiseless step of one of an account's several sessions that declares no
     * data parallelism is no share: charged, as no privacy */
    acct->sessions = 21;
    sc->sigma = 0;
    assert_int_equal(dc_step_account_charge(sc, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_CHARGED);
    assert_ptr_equal(sc->account, acct);
    assert_int_equal(acct->shares, 0);
    assert_int_equal(acct->steps, 1);
    assert_true(isinf(acct->eps));
    assert_true(isinf(sc->eps));
    assert_int_equal(m->budget_refusals, 0);
    free(sc);
    free(m);
    dc_ledger_close(&l);
}

static void test_budgets(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_host_cfg c;
    dc_metrics *m = calloc(1, sizeof *m);
    dc_step_call *sc;
    dc_step_charge kind;
    dc_err e;
    (void)state;

    memset(&c, 0, sizeof c);
    assert_non_null(m);
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    /* the account's own budget, set by the step's terms */
    acct = dc_ledger_account_get(&l, 1000, "budget");
    acct->sessions = 1;
    sc = call_of(0.5, 0.5f, 0, 0.01);
    assert_int_equal(dc_step_account_check(sc, &c, &e), 0);
    assert_int_equal(dc_step_account_terms(sc, acct, &e), 0);
    assert_int_equal(dc_step_account_charge(sc, acct, false, &c, m, &kind, &e), DC_ENOSPACE);
    assert_string_equal(e.field, "clip_step.target_epsilon");
    assert_null(sc->account);
    assert_int_equal(acct->steps, 0);
    assert_int_equal(m->budget_refusals, 1);
    free(sc);

    /* the node's budget per job */
    acct = dc_ledger_account_get(&l, 1000, "node");
    acct->sessions = 1;
    c.budget_epsilon = 0.01;
    c.budget_delta = 1e-5;
    sc = call_of(0.5, 0.5f, 0, 0);
    assert_int_equal(dc_step_account_check(sc, &c, &e), 0);
    assert_int_equal(dc_step_account_terms(sc, acct, &e), 0);
    assert_int_equal(dc_step_account_charge(sc, acct, false, &c, m, &kind, &e), DC_ENOSPACE);
    assert_string_equal(e.field, "ledger.budget_epsilon");
    assert_int_equal(m->budget_refusals, 2);
    assert_int_equal(acct->steps, 0);
    free(sc);
    free(m);
    dc_ledger_close(&l);
}

static void test_curve_waits(void **state) {
    uv_loop_t loop;
    dc_ledger l;
    dc_ledger_account *acct;
    dc_host_cfg c;
    dc_step_call *sc;
    dc_err e;
    (void)state;

    memset(&c, 0, sizeof c);
    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    acct = dc_ledger_account_get(&l, 1000, "curve");
    sc = call_of(0.0123, 1.37f, 0, 0);
    assert_int_equal(dc_step_account_check(sc, &c, &e), 0);
    g_resumed = 0;
    assert_true(dc_step_account_curve(sc, acct, &loop, resume));
    assert_int_equal(g_resumed, 0); /* computed on the pool: the loop resumes */
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(g_resumed, 1);
    assert_int_equal(g_resume_rc, 0);
    /* now at hand: no wait */
    assert_false(dc_step_account_curve(sc, acct, &loop, resume));
    /* a noiseless step needs no curve */
    sc->sigma = 0;
    sc->q = 0.777;
    assert_false(dc_step_account_curve(sc, acct, &loop, resume));
    free(sc);
    dc_ledger_close(&l);
    assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_durable(void **state) {
    uv_loop_t loop;
    dc_ledger l, mem;
    dc_ledger_account *acct;
    dc_host_cfg c;
    dc_metrics *m = calloc(1, sizeof *m);
    dc_step_call *sc;
    dc_step_charge kind;
    dc_err e;
    bool wait = true;
    char moved[300];
    (void)state;

    memset(&c, 0, sizeof c);
    assert_non_null(m);
    assert_int_equal(uv_loop_init(&loop), 0);

    /* in memory: nothing to wait for */
    assert_int_equal(dc_ledger_open(&mem, "", 1e-5, &e), 0);
    acct = dc_ledger_account_get(&mem, 1000, "mem");
    acct->sessions = 1;
    sc = call_of(0.01, 1.0f, 0, 0);
    assert_int_equal(dc_step_account_check(sc, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(sc, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(dc_step_account_durable(sc, resume, &wait, &e), 0);
    assert_false(wait);
    free(sc);
    dc_ledger_close(&mem);

    /* on disk: the step waits for the write */
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    dc_ledger_store_init(&l, &loop, m);
    acct = dc_ledger_account_get(&l, 1000, "disk");
    acct->sessions = 1;
    sc = call_of(0.01, 1.0f, 0, 0);
    assert_int_equal(dc_step_account_check(sc, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(sc, acct, false, &c, m, &kind, &e), 0);
    g_resumed = 0;
    assert_int_equal(dc_step_account_durable(sc, resume, &wait, &e), 0);
    assert_true(wait);
    assert_int_equal(g_resumed, 0);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(g_resumed, 1);
    assert_int_equal(g_resume_rc, 0);
    assert_true(acct->saved_gen >= acct->gen);
    assert_ptr_equal(sc->account, acct);
    assert_int_equal(acct->steps, 1);

    /* a write that fails: refused, the spend refunded */
    snprintf(moved, sizeof moved, "%s.moved", g_dir);
    assert_int_equal(rename(g_dir, moved), 0);
    memset(&sc->wait, 0, sizeof sc->wait);
    assert_int_equal(dc_step_account_charge(sc, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(acct->steps, 2);
    g_resumed = 0;
    assert_int_equal(dc_step_account_durable(sc, resume, &wait, &e), 0);
    assert_true(wait);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(g_resumed, 1);
    assert_int_equal(g_resume_rc, DC_EUNAVAIL);
    assert_string_equal(g_resume_err.field, "ledger");
    assert_null(sc->account);
    assert_int_equal(acct->steps, 1);
    assert_int_equal(rename(moved, g_dir), 0);
    free(sc);
    dc_ledger_close(&l);
    free(m);
    assert_int_equal(uv_loop_close(&loop), 0);
}

/* A member of a data-parallel logical step of `world` ranks, charged at sigma `js`. */
static dc_step_call *member_of(uint32_t world, uint32_t rank, float js, float own) {
    dc_step_call *sc = call_of(0.01, own, 0, 0);
    sc->params.dp = (dc_dp_member){.declared = true, .world = world, .rank = rank, .sigma = js};
    sc->step.max_grad_norm = 1.0f;
    sc->step.reduction = DC_REDUCTION_SUM;
    return sc;
}

static void test_data_parallel(void **state) {
    uv_loop_t loop;
    dc_ledger l;
    dc_ledger_account *acct;
    dc_host_cfg c;
    dc_metrics *m = calloc(1, sizeof *m);
    dc_step_call *sc0, *sc1, *sc2;
    dc_step_charge kind;
    dc_err e;
    bool wait;
    (void)state;

    memset(&c, 0, sizeof c);
    assert_non_null(m);
    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    dc_ledger_store_init(&l, &loop, m);
    acct = dc_ledger_account_get(&l, 1000, "dp");
    acct->sessions = 2;

    /* less noise than the account's is refused; the account's sigma is
     * charged */
    sc0 = member_of(2, 0, 1.0f, 0.5f);
    assert_int_equal(dc_step_account_check(sc0, &c, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.noise_multiplier");
    sc0->step.noise_multiplier = 4.0f;
    assert_int_equal(dc_step_account_check(sc0, &c, &e), 0);
    assert_true(sc0->sigma == 1.0);

    /* rank 1 first: its noiseless step charges the logical step */
    sc1 = member_of(2, 1, 1.0f, 0.0f);
    assert_int_equal(dc_step_account_check(sc1, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(sc1, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_CHARGED);
    assert_int_equal(acct->steps, 1);
    assert_true(isfinite(acct->eps) && acct->eps > 0);
    /* rank 0, in a norm group that would cover it: a member all the same */
    assert_int_equal(dc_step_account_charge(sc0, acct, true, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_COVERED);
    assert_int_equal(sc0->params.dp.step, 1);
    assert_int_equal(acct->steps, 1);
    /* the charge is not on disk yet: both wait for it */
    g_resumed = 0;
    assert_int_equal(dc_step_account_durable(sc1, resume, &wait, &e), 0);
    assert_true(wait);
    memset(&sc0->wait, 0, sizeof sc0->wait);
    assert_int_equal(dc_step_account_durable(sc0, resume, &wait, &e), 0);
    assert_true(wait);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(g_resumed, 2);
    assert_int_equal(g_resume_rc, 0);
    /* on disk now: a later member does not wait */
    assert_int_equal(dc_step_account_durable(sc0, resume, &wait, &e), 0);
    assert_false(wait);

    /* the charger failed without releasing: its charge stays, rank 0 took it */
    dc_step_account_refund(sc1);
    assert_int_equal(acct->steps, 1);
    assert_null(sc1->account);
    dc_step_account_refund(sc0);
    assert_int_equal(acct->steps, 1);

    /* a logical step no other member took is refunded */
    free(sc1);
    sc2 = member_of(2, 0, 1.0f, 1.0f);
    assert_int_equal(dc_step_account_check(sc2, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(sc2, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_CHARGED);
    assert_int_equal(sc2->params.dp.step, 2);
    assert_int_equal(acct->steps, 2);
    dc_step_account_refund(sc2);
    assert_int_equal(acct->steps, 1);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);

    /* a share of a logical step: no charge, its role told */
    free(sc2);
    free(sc0);
    sc2 = member_of(2, 1, 1.0f, 0.0f);
    sc2->params.dp.step = 7;
    sc0 = member_of(2, 0, 1.0f, 1.0f);
    sc0->params.dp.step = 7;
    assert_int_equal(dc_step_account_check(sc0, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(sc0, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(dc_step_account_check(sc2, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(sc2, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_SHARE);
    assert_int_equal(acct->steps, 2);
    assert_int_equal(acct->shares, 2);
    assert_int_equal(m->budget_refusals, 0);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    free(sc0);
    free(sc2);
    dc_ledger_close(&l);
    free(m);
    assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check),
        cmocka_unit_test(test_charge_and_refund),
        cmocka_unit_test(test_budgets),
        cmocka_unit_test(test_curve_waits),
        cmocka_unit_test_setup_teardown(test_durable, setup, teardown),
        cmocka_unit_test_setup_teardown(test_data_parallel, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
