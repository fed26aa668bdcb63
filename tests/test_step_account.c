/* daemon/protocol/step_account.c: the accounting stage of a step, alone (a ledger and
 * a loop, no session). Terms out of range are refused naming the field; a
 * step without a sample rate counts as q = 1 or is refused under
 * ledger.require_sample_rate; the charge spends, and a refund takes it back;
 * a norm group's member past rank 0 is covered, and a noiseless step that
 * declares no data parallelism is charged (no privacy); a data-parallel
 * logical step is charged once, by its first member, at the job's sigma,
 * its other members are covered and wait for that charge to be durable,
 * and its charge is refunded only while no other member took it; the
 * job's and the node's budgets refuse naming themselves and
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

/* A job as the session hands it to the stage: its terms and its sigma. */
static dc_step_job *job_of(double q, float sigma, double delta, double eps_budget) {
    dc_step_job *j = calloc(1, sizeof *j);
    assert_non_null(j);
    j->params.sample_rate = q;
    j->params.target_delta = delta;
    j->params.target_epsilon = eps_budget;
    j->step.noise_multiplier = sigma;
    return j;
}

static int g_resumed, g_resume_rc;
static dc_err g_resume_err;

static void resume(dc_step_job *j, int rc, const dc_err *err) {
    (void)j;
    g_resumed++;
    g_resume_rc = rc;
    if (err) g_resume_err = *err;
}

static void test_check(void **state) {
    dc_config c;
    dc_step_job *j;
    dc_err e;
    (void)state;

    memset(&c, 0, sizeof c);
    j = job_of(1.5, 1.0f, 0, 0);
    assert_int_equal(dc_step_account_check(j, &c, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.sample_rate");
    j->params.sample_rate = 0.01;
    j->params.target_delta = 1.0;
    assert_int_equal(dc_step_account_check(j, &c, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.target_delta");
    j->params.target_delta = 1e-5;
    j->params.target_epsilon = INFINITY;
    assert_int_equal(dc_step_account_check(j, &c, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.target_epsilon");
    j->params.target_epsilon = 0;
    assert_int_equal(dc_step_account_check(j, &c, &e), 0);
    assert_true(j->q == 0.01);
    assert_true(j->sigma == 1.0);

    /* no sample rate: no amplification is assumed, or it is refused */
    j->params.sample_rate = 0;
    assert_int_equal(dc_step_account_check(j, &c, &e), 0);
    assert_true(j->q == 1.0);
    c.require_sample_rate = true;
    assert_int_equal(dc_step_account_check(j, &c, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.sample_rate");
    assert_non_null(strstr(e.msg, "ledger.require_sample_rate"));
    free(j);
}

static void test_charge_and_refund(void **state) {
    dc_ledger l;
    dc_ledger_job *acct;
    dc_config c;
    dc_metrics *m = calloc(1, sizeof *m);
    dc_step_job *j;
    dc_step_charge kind;
    dc_err e;
    (void)state;

    memset(&c, 0, sizeof c);
    assert_non_null(m);
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    acct = dc_ledger_job_get(&l, 1000, "charge");
    acct->sessions = 1;
    j = job_of(0.01, 1.0f, 0, 0);
    assert_int_equal(dc_step_account_check(j, &c, &e), 0);
    assert_int_equal(dc_step_account_terms(j, acct, &e), 0);
    assert_int_equal(dc_step_account_charge(j, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_CHARGED);
    assert_ptr_equal(j->ljob, acct);
    assert_int_equal(acct->steps, 1);
    assert_true(acct->eps > 0);
    assert_true(j->eps == acct->eps);
    assert_true(j->delta == 1e-5);

    /* it released nothing: the spend goes back, once */
    dc_step_account_refund(j);
    assert_null(j->ljob);
    assert_int_equal(acct->steps, 0);
    assert_true(acct->eps == 0);
    dc_step_account_refund(j);
    assert_int_equal(acct->steps, 0);

    /* a norm group's member past rank 0: rank 0 pays for the group step */
    assert_int_equal(dc_step_account_charge(j, acct, true, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_COVERED);
    assert_null(j->ljob);
    assert_int_equal(acct->steps, 0);

    /* a noiseless step of one of a job's several sessions that declares no
     * data parallelism is no share: charged, as no privacy */
    acct->sessions = 21;
    j->sigma = 0;
    assert_int_equal(dc_step_account_charge(j, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_CHARGED);
    assert_ptr_equal(j->ljob, acct);
    assert_int_equal(acct->shares, 0);
    assert_int_equal(acct->steps, 1);
    assert_true(isinf(acct->eps));
    assert_true(isinf(j->eps));
    assert_int_equal(m->budget_refusals, 0);
    free(j);
    free(m);
    dc_ledger_close(&l);
}

static void test_budgets(void **state) {
    dc_ledger l;
    dc_ledger_job *acct;
    dc_config c;
    dc_metrics *m = calloc(1, sizeof *m);
    dc_step_job *j;
    dc_step_charge kind;
    dc_err e;
    (void)state;

    memset(&c, 0, sizeof c);
    assert_non_null(m);
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    /* the job's own budget, set by the step's terms */
    acct = dc_ledger_job_get(&l, 1000, "budget");
    acct->sessions = 1;
    j = job_of(0.5, 0.5f, 0, 0.01);
    assert_int_equal(dc_step_account_check(j, &c, &e), 0);
    assert_int_equal(dc_step_account_terms(j, acct, &e), 0);
    assert_int_equal(dc_step_account_charge(j, acct, false, &c, m, &kind, &e), DC_ENOSPACE);
    assert_string_equal(e.field, "clip_step.target_epsilon");
    assert_null(j->ljob);
    assert_int_equal(acct->steps, 0);
    assert_int_equal(m->budget_refusals, 1);
    free(j);

    /* the node's budget per job */
    acct = dc_ledger_job_get(&l, 1000, "node");
    acct->sessions = 1;
    c.budget_epsilon = 0.01;
    c.budget_delta = 1e-5;
    j = job_of(0.5, 0.5f, 0, 0);
    assert_int_equal(dc_step_account_check(j, &c, &e), 0);
    assert_int_equal(dc_step_account_terms(j, acct, &e), 0);
    assert_int_equal(dc_step_account_charge(j, acct, false, &c, m, &kind, &e), DC_ENOSPACE);
    assert_string_equal(e.field, "ledger.budget_epsilon");
    assert_int_equal(m->budget_refusals, 2);
    assert_int_equal(acct->steps, 0);
    free(j);
    free(m);
    dc_ledger_close(&l);
}

static void test_curve_waits(void **state) {
    uv_loop_t loop;
    dc_ledger l;
    dc_ledger_job *acct;
    dc_config c;
    dc_step_job *j;
    dc_err e;
    (void)state;

    memset(&c, 0, sizeof c);
    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    acct = dc_ledger_job_get(&l, 1000, "curve");
    j = job_of(0.0123, 1.37f, 0, 0);
    assert_int_equal(dc_step_account_check(j, &c, &e), 0);
    g_resumed = 0;
    assert_true(dc_step_account_curve(j, acct, &loop, resume));
    assert_int_equal(g_resumed, 0); /* computed on the pool: the loop resumes */
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(g_resumed, 1);
    assert_int_equal(g_resume_rc, 0);
    /* now at hand: no wait */
    assert_false(dc_step_account_curve(j, acct, &loop, resume));
    /* a noiseless step needs no curve */
    j->sigma = 0;
    j->q = 0.777;
    assert_false(dc_step_account_curve(j, acct, &loop, resume));
    free(j);
    dc_ledger_close(&l);
    assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_durable(void **state) {
    uv_loop_t loop;
    dc_ledger l, mem;
    dc_ledger_job *acct;
    dc_config c;
    dc_metrics *m = calloc(1, sizeof *m);
    dc_step_job *j;
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
    acct = dc_ledger_job_get(&mem, 1000, "mem");
    acct->sessions = 1;
    j = job_of(0.01, 1.0f, 0, 0);
    assert_int_equal(dc_step_account_check(j, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(j, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(dc_step_account_durable(j, resume, &wait, &e), 0);
    assert_false(wait);
    free(j);
    dc_ledger_close(&mem);

    /* on disk: the step waits for the write */
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    dc_ledger_store_init(&l, &loop, m);
    acct = dc_ledger_job_get(&l, 1000, "disk");
    acct->sessions = 1;
    j = job_of(0.01, 1.0f, 0, 0);
    assert_int_equal(dc_step_account_check(j, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(j, acct, false, &c, m, &kind, &e), 0);
    g_resumed = 0;
    assert_int_equal(dc_step_account_durable(j, resume, &wait, &e), 0);
    assert_true(wait);
    assert_int_equal(g_resumed, 0);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(g_resumed, 1);
    assert_int_equal(g_resume_rc, 0);
    assert_true(acct->saved_gen >= acct->gen);
    assert_ptr_equal(j->ljob, acct);
    assert_int_equal(acct->steps, 1);

    /* a write that fails: refused, the spend refunded */
    snprintf(moved, sizeof moved, "%s.moved", g_dir);
    assert_int_equal(rename(g_dir, moved), 0);
    memset(&j->wait, 0, sizeof j->wait);
    assert_int_equal(dc_step_account_charge(j, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(acct->steps, 2);
    g_resumed = 0;
    assert_int_equal(dc_step_account_durable(j, resume, &wait, &e), 0);
    assert_true(wait);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(g_resumed, 1);
    assert_int_equal(g_resume_rc, DC_EUNAVAIL);
    assert_string_equal(g_resume_err.field, "ledger");
    assert_null(j->ljob);
    assert_int_equal(acct->steps, 1);
    assert_int_equal(rename(moved, g_dir), 0);
    free(j);
    dc_ledger_close(&l);
    free(m);
    assert_int_equal(uv_loop_close(&loop), 0);
}

/* A member of a data-parallel logical step of `world` ranks, charged at sigma `js`. */
static dc_step_job *member_of(uint32_t world, uint32_t rank, float js, float own) {
    dc_step_job *j = job_of(0.01, own, 0, 0);
    j->params.dp = (dc_dp_member){.declared = true, .world = world, .rank = rank, .sigma = js};
    j->step.max_grad_norm = 1.0f;
    j->step.reduction = DC_REDUCTION_SUM;
    return j;
}

static void test_data_parallel(void **state) {
    uv_loop_t loop;
    dc_ledger l;
    dc_ledger_job *acct;
    dc_config c;
    dc_metrics *m = calloc(1, sizeof *m);
    dc_step_job *j0, *j1, *j2;
    dc_step_charge kind;
    dc_err e;
    bool wait;
    (void)state;

    memset(&c, 0, sizeof c);
    assert_non_null(m);
    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    dc_ledger_store_init(&l, &loop, m);
    acct = dc_ledger_job_get(&l, 1000, "dp");
    acct->sessions = 2;

    /* less noise than the job's is refused; the job's sigma is charged */
    j0 = member_of(2, 0, 1.0f, 0.5f);
    assert_int_equal(dc_step_account_check(j0, &c, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.noise_multiplier");
    j0->step.noise_multiplier = 4.0f;
    assert_int_equal(dc_step_account_check(j0, &c, &e), 0);
    assert_true(j0->sigma == 1.0);

    /* rank 1 first: its noiseless step charges the logical step */
    j1 = member_of(2, 1, 1.0f, 0.0f);
    assert_int_equal(dc_step_account_check(j1, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(j1, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_CHARGED);
    assert_int_equal(acct->steps, 1);
    assert_true(isfinite(acct->eps) && acct->eps > 0);
    /* rank 0, in a norm group that would cover it: a member all the same */
    assert_int_equal(dc_step_account_charge(j0, acct, true, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_COVERED);
    assert_int_equal(j0->params.dp.step, 1);
    assert_int_equal(acct->steps, 1);
    /* the charge is not on disk yet: both wait for it */
    g_resumed = 0;
    assert_int_equal(dc_step_account_durable(j1, resume, &wait, &e), 0);
    assert_true(wait);
    memset(&j0->wait, 0, sizeof j0->wait);
    assert_int_equal(dc_step_account_durable(j0, resume, &wait, &e), 0);
    assert_true(wait);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(g_resumed, 2);
    assert_int_equal(g_resume_rc, 0);
    /* on disk now: a later member does not wait */
    assert_int_equal(dc_step_account_durable(j0, resume, &wait, &e), 0);
    assert_false(wait);

    /* the charger failed without releasing: its charge stays, rank 0 took it */
    dc_step_account_refund(j1);
    assert_int_equal(acct->steps, 1);
    assert_null(j1->ljob);
    dc_step_account_refund(j0);
    assert_int_equal(acct->steps, 1);

    /* a logical step no other member took is refunded */
    free(j1);
    j2 = member_of(2, 0, 1.0f, 1.0f);
    assert_int_equal(dc_step_account_check(j2, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(j2, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_CHARGED);
    assert_int_equal(j2->params.dp.step, 2);
    assert_int_equal(acct->steps, 2);
    dc_step_account_refund(j2);
    assert_int_equal(acct->steps, 1);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);

    /* a share of a logical step: no charge, its role told */
    free(j2);
    free(j0);
    j2 = member_of(2, 1, 1.0f, 0.0f);
    j2->params.dp.step = 7;
    j0 = member_of(2, 0, 1.0f, 1.0f);
    j0->params.dp.step = 7;
    assert_int_equal(dc_step_account_check(j0, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(j0, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(dc_step_account_check(j2, &c, &e), 0);
    assert_int_equal(dc_step_account_charge(j2, acct, false, &c, m, &kind, &e), 0);
    assert_int_equal(kind, DC_STEP_SHARE);
    assert_int_equal(acct->steps, 2);
    assert_int_equal(acct->shares, 2);
    assert_int_equal(m->budget_refusals, 0);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    free(j0);
    free(j2);
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
