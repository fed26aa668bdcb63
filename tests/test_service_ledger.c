/* The privacy ledger through a real dpclipd (test_service.c has the basics:
 * epsilon in replies, budgets, refunds, kill -9): a job's delta fixed by its
 * first step, job ids too long to keep refused at the Hello, data-parallel
 * ranks' noiseless shares, a bounded history with many sample rates, and
 * the cap on a uid's accounts. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "accountant.h"
#include "harness.h"
#include "service.h"

/* Whatever dpclip config is installed on this machine stays out. */
#ifdef DPCLIP_HAVE_INIH
#define NO_SYSTEM_CONFIG "--config /dev/null "
#else
#define NO_SYSTEM_CONFIG ""
#endif

#ifdef DPCLIP_HAVE_JANSSON
#include <jansson.h>

#include "ledger_test.h"

static dc_harness g_h;
static char g_status[400], g_ledger[300];

static int group_setup(void **state) {
    char args[600];
    (void)state;
    snprintf(g_ledger, sizeof g_ledger, "%s/dpclip-service-ledger.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_ledger)) return -1;
    snprintf(args, sizeof args, NO_SYSTEM_CONFIG "--workers 2 --ledger-dir %s", g_ledger);
    if (dc_harness_start(&g_h, args)) return -1;
    dc_harness_status_path(&g_h, g_status, sizeof g_status);
    return 0;
}

static int group_teardown(void **state) {
    char cmd[400];
    int rc = 0;
    (void)state;
    if (g_h.pid) rc = dc_harness_stop(&g_h);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_ledger);
    return system(cmd) == 0 && rc == 0 ? 0 : -1;
}

/* Raising target_delta once a budget was spent made the same spend look
 * smaller and let 2000 more steps run: a job's delta is fixed by its first
 * step. */
static void test_delta_fixed(void **state) {
    dpclip_client *c = connect_job(g_h.sock, "delta-fixed");
    dc_shm_step s;
    double budget = accountant_eps(0.1, 1.0, 3, 1e-5) * (1 + 1e-9), delta = 0;
    (void)state;
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 7), 0);
    set_privacy(&s, 1.0f, 0.1, 1e-5, budget);
    for (int i = 0; i < 3; i++) assert_int_equal(run(c, &s, NULL, &delta), 0);
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_ENOSPACE);
    /* at delta 0.1 three steps cost much less: refused all the same */
    set_privacy(&s, 1.0f, 0.1, 0.1, 0);
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_EPRECOND);
    assert_string_equal(dpclip_errfield(c), "clip_step.target_delta");
    assert_non_null(strstr(dpclip_errmsg(c), "fixed by its first step"));
    assert_int_equal(job_steps(g_status, "delta-fixed"), 3);
    /* a new session of the job cannot change it either */
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    c = connect_job(g_h.sock, "delta-fixed");
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 7), 0);
    set_privacy(&s, 1.0f, 0.1, 0.1, 0);
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_EPRECOND);
    set_privacy(&s, 1.0f, 0.1, 0, 0);                          /* the job's own delta */
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_ENOSPACE); /* still over budget */
    assert_true(delta == 1e-5);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* Two jobs that differed after byte 63 shared one account: a job id too long
 * to keep whole is refused at the Hello, naming the field and the limit. */
static void test_long_job_id(void **state) {
    char a[100], b[100];
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "service-test", .job_id = a};
    (void)state;
    memset(a, 'j', 80);
    a[80] = '\0';
    memcpy(b, a, sizeof a);
    b[70] = 'k';
    assert_int_equal(dpclip_connect(g_h.sock, &o, &c), DPCLIP_EINVAL);
    assert_string_equal(dpclip_errfield(c), "hello.job_id");
    assert_non_null(strstr(dpclip_errmsg(c), "at most 63 bytes"));
    dpclip_disconnect(c);
    o.job_id = b;
    c = NULL;
    assert_int_equal(dpclip_connect(g_h.sock, &o, &c), DPCLIP_EINVAL);
    dpclip_disconnect(c);
    /* 63 bytes: kept whole, its own account */
    a[63] = '\0';
    c = connect_job(g_h.sock, a);
    {
        dc_shm_step s;
        assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 8), 0);
        assert_int_equal(run(c, &s, NULL, NULL), 0);
        dc_shm_step_free(&s);
    }
    assert_int_equal(job_steps(g_status, a), 1);
    dpclip_disconnect(c);
}

/* Data parallelism: rank 0 adds the noise, rank 1 sends sigma 0, both
 * declaring the job's world and sigma. Each logical step is charged once,
 * at the job's sigma, by whichever member comes first (here rank 1); the
 * other is covered, and a budget refuses the logical step that would pass
 * it on both ranks. A lone sigma-0 session still has no privacy. */
static void test_data_parallel_budget(void **state) {
    dpclip_client *r0 = connect_job(g_h.sock, "dp"), *r1 = connect_job(g_h.sock, "dp"), *lone;
    dc_shm_step s0, s1, sl;
    double budget = accountant_eps(0.1, 1.0, 3, 1e-5) * (1 + 1e-9), eps0 = 0, eps1 = -1;
    (void)state;
    assert_int_equal(dc_service_step_init(&s0, r0, 8, 1.0f, 0.1, 9), 0);
    assert_int_equal(dc_service_step_init(&s1, r1, 8, 0.0f, 0.1, 10), 0);
    set_privacy(&s0, 1.0f, 0.1, 0, budget);
    set_privacy(&s1, 0.0f, 0.1, 0, budget);
    assert_int_equal(dpclip_step_set_data_parallel(s0.step, 2, 0, 1.0f, 0), 0);
    assert_int_equal(dpclip_step_set_data_parallel(s1.step, 2, 1, 1.0f, 0), 0);
    for (int i = 1; i <= 3; i++) {
        /* rank 1 first, as it may well be: it charges the logical step */
        assert_int_equal(run(r1, &s1, &eps1, NULL), 0);
        assert_rel(eps1, accountant_eps(0.1, 1.0, i, 1e-5), 1e-9);
        assert_int_equal(run(r0, &s0, &eps0, NULL), 0);
        assert_true(eps0 == eps1); /* covered */
    }
    assert_int_equal(job_steps(g_status, "dp"), 3);
    /* the budget stops the fourth logical step, whichever rank comes */
    assert_int_equal(run(r0, &s0, NULL, NULL), DPCLIP_ENOSPACE);
    assert_int_equal(run(r1, &s1, NULL, NULL), DPCLIP_ENOSPACE);
    assert_string_equal(dpclip_errfield(r1), "clip_step.target_epsilon");
    {
        json_t *root = get_status(g_status), *j = ledger_job(root, "dp");
        assert_non_null(j);
        assert_int_equal(json_integer_value(json_object_get(j, "shares")), 3);
        assert_int_equal(json_integer_value(json_object_get(j, "steps")), 3);
        json_decref(root);
    }
    /* one session, no noise, no declaration: no privacy, and a budget
     * refuses it */
    lone = connect_job(g_h.sock, "dp-lone");
    assert_int_equal(dc_service_step_init(&sl, lone, 8, 0.0f, 0.1, 11), 0);
    set_privacy(&sl, 0.0f, 0.1, 0, budget);
    assert_int_equal(run(lone, &sl, NULL, NULL), DPCLIP_ENOSPACE);
    dc_shm_step_free(&sl);
    dpclip_disconnect(lone);
    dc_shm_step_free(&s0);
    dc_shm_step_free(&s1);
    dpclip_disconnect(r0);
    dpclip_disconnect(r1);
}

/* 4000 distinct sample rates kept 4000 history entries and slowed steps:
 * the history /status shows is bounded, the rest folded, nothing lost. */
static void test_many_rates(void **state) {
    enum { N = 40 };
    dpclip_client *c = connect_job(g_h.sock, "many-rates");
    dc_shm_step s;
    double eps = 0, rdp[DC_RDP_N_ORDERS] = {0}, one[DC_RDP_N_ORDERS], want;
    const double *o = dc_rdp_default_orders();
    (void)state;
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 12), 0);
    for (int i = 0; i < N; i++) {
        double q = 0.01 + 0.001 * i;
        set_privacy(&s, 1.0f, q, 0, 0);
        assert_int_equal(run(c, &s, &eps, NULL), 0);
        dc_rdp_steps(q, 1.0, o, DC_RDP_N_ORDERS, one);
        for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] += one[k];
    }
    want = dc_rdp_epsilon(o, rdp, DC_RDP_N_ORDERS, 1e-5, NULL);
    assert_true(eps >= want && eps <= want * (1 + 1e-9));
    {
        json_t *root = get_status(g_status), *j = ledger_job(root, "many-rates");
        size_t n_hist;
        assert_non_null(j);
        n_hist = json_array_size(json_object_get(j, "history"));
        assert_true(n_hist > 0 && n_hist < N);
        assert_int_equal(json_integer_value(json_object_get(j, "steps")), N);
        assert_int_equal(json_integer_value(json_object_get(j, "folded_steps")), N - (long)n_hist);
        json_decref(root);
    }
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* ledger.max_jobs_per_uid: a uid's accounts in memory are capped; the
 * refusal names the setting, and the uid's existing jobs go on. */
static void test_jobs_per_uid(void **state) {
    dc_harness h;
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "service-test", .job_id = "cap-3"};
    dc_shm_step s;
    char job[16];
    (void)state;
    assert_int_equal(dc_harness_start(&h, NO_SYSTEM_CONFIG "--workers 1 "
                                                           "--set ledger.max_jobs_per_uid=3"),
                     0);
    for (int i = 0; i < 3; i++) {
        snprintf(job, sizeof job, "cap-%d", i);
        c = connect_job(h.sock, job);
        assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 13), 0);
        assert_int_equal(run(c, &s, NULL, NULL), 0); /* spent: the account stays */
        dc_shm_step_free(&s);
        dpclip_disconnect(c);
    }
    c = NULL;
    assert_int_equal(dpclip_connect(h.sock, &o, &c), DPCLIP_ENOSPACE);
    assert_string_equal(dpclip_errfield(c), "ledger.max_jobs_per_uid");
    dpclip_disconnect(c);
    c = connect_job(h.sock, "cap-1");
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 14), 0);
    assert_int_equal(run(c, &s, NULL, NULL), 0);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    assert_int_equal(dc_harness_stop(&h), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_delta_fixed),          cmocka_unit_test(test_long_job_id),
        cmocka_unit_test(test_data_parallel_budget), cmocka_unit_test(test_many_rates),
        cmocka_unit_test(test_jobs_per_uid),
    };
#if !defined(DPCLIP_HAVE_MHD)
    printf("test_service_ledger: SKIPPED: needs dpclipd built with libmicrohttpd\n");
    return DC_TEST_SKIP;
#endif
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

#else /* !DPCLIP_HAVE_JANSSON */
int main(void) {
    printf("test_service_ledger: SKIPPED: needs jansson (libjansson-dev) to read /status\n");
    return DC_TEST_SKIP;
}
#endif
