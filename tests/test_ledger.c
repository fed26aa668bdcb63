/* The privacy ledger (daemon/ledger.c): composition matches the accountant,
 * refunds are exact, files round-trip, writes are atomic, a corrupt or
 * foreign file stops the start with a message naming it, and two daemons
 * cannot share a directory. (The daemon-level kill -9 test is in
 * test_service.c.) */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "accountant.h"
#include "ledger.h"

static char g_dir[256];

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "%s/dpclip-ledger.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    char cmd[300];
    (void)state;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* eps of `steps` steps of (q, sigma), straight from the accountant. */
static double accountant_eps(double q, double sigma, double steps, double delta) {
    double rdp[DC_RDP_N_ORDERS];
    dc_rdp_steps(q, sigma, dc_rdp_default_orders(), DC_RDP_N_ORDERS, rdp);
    for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] *= steps;
    return dc_rdp_epsilon(dc_rdp_default_orders(), rdp, DC_RDP_N_ORDERS, delta, NULL);
}

static void test_compose_and_refund(void **state) {
    dc_ledger l;
    dc_ledger_job *j;
    dc_err e;
    double before, predicted;
    (void)state;

    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    assert_false(dc_ledger_persistent(&l));
    j = dc_ledger_job_get(&l, 1000, "run-1");
    assert_non_null(j);
    assert_ptr_equal(dc_ledger_job_get(&l, 1000, "run-1"), j);
    assert_true(dc_ledger_job_get(&l, 1001, "run-1") != j);   /* the uid is part of the key */
    assert_true(j->eps == 0.0 && j->steps == 0);

    for (int i = 0; i < 100; i++) {
        predicted = dc_ledger_eps_after(&l, j, 0.01, 1.1, 1e-5);
        assert_int_equal(dc_ledger_spend(&l, j, 0.01, 1.1, &e), 0);
        /* what the budget check predicted is what the spend costs */
        assert_true(fabs(j->eps - predicted) <= 1e-12 * predicted);
    }
    assert_int_equal(j->steps, 100);
    assert_true(fabs(j->eps - accountant_eps(0.01, 1.1, 100, 1e-5)) <= 1e-12 * j->eps);

    /* A second kind of step composes by adding RDP curves. */
    before = j->eps;
    for (int i = 0; i < 10; i++) assert_int_equal(dc_ledger_spend(&l, j, 0.05, 2.0, &e), 0);
    assert_int_equal(j->n_hist, 2);
    {
        double r1[DC_RDP_N_ORDERS], r2[DC_RDP_N_ORDERS], sum[DC_RDP_N_ORDERS];
        const double *o = dc_rdp_default_orders();
        dc_rdp_steps(0.01, 1.1, o, DC_RDP_N_ORDERS, r1);
        dc_rdp_steps(0.05, 2.0, o, DC_RDP_N_ORDERS, r2);
        for (int k = 0; k < DC_RDP_N_ORDERS; k++) sum[k] = 100 * r1[k] + 10 * r2[k];
        double want = dc_rdp_epsilon(o, sum, DC_RDP_N_ORDERS, 1e-5, NULL);
        assert_true(fabs(j->eps - want) <= 1e-12 * want);
        assert_true(j->eps > before);
        /* eps at another delta */
        assert_true(dc_ledger_eps_at(j, 1e-8, NULL) > j->eps);
    }

    /* Refunds take back exactly what was spent. */
    for (int i = 0; i < 10; i++) dc_ledger_refund(j, 0.05, 2.0);
    assert_int_equal(j->n_hist, 1);
    assert_true(fabs(j->eps - before) <= 1e-12 * before);
    dc_ledger_refund(j, 0.05, 2.0);  /* nothing left of that kind: no-op */
    assert_int_equal(j->steps, 100);

    /* No noise: infinite. */
    assert_int_equal(dc_ledger_spend(&l, j, 0.01, 0.0, &e), 0);
    assert_true(isinf(j->eps));
    dc_ledger_refund(j, 0.01, 0.0);
    assert_true(isfinite(j->eps));
    dc_ledger_close(&l);
}

static void test_terms(void **state) {
    dc_ledger l;
    dc_ledger_job *j;
    dc_err e;
    uint64_t gen;
    double eps5;
    (void)state;
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    j = dc_ledger_job_get(&l, 7, "terms");
    assert_int_equal(dc_ledger_spend(&l, j, 0.02, 1.0, &e), 0);
    eps5 = j->eps;
    /* a job's delta changes where its eps is reported */
    dc_ledger_job_terms(j, 1e-7, 0);
    assert_true(j->delta == 1e-7 && j->eps > eps5);
    /* the budget only goes down */
    dc_ledger_job_terms(j, 0, 8.0);
    assert_true(j->budget_eps == 8.0);
    dc_ledger_job_terms(j, 0, 9.0);
    assert_true(j->budget_eps == 8.0);
    gen = j->gen;
    dc_ledger_job_terms(j, 0, 8.0);
    assert_true(j->gen == gen);  /* no change, no new generation to write */
    dc_ledger_job_terms(j, 0, 3.0);
    assert_true(j->budget_eps == 3.0 && j->gen == gen + 1);
    dc_ledger_close(&l);
}

static void test_persist_roundtrip(void **state) {
    dc_ledger l;
    dc_ledger_job *a, *b;
    dc_err e;
    char path[600];
    double eps_a, eps_b;
    struct stat st;
    (void)state;

    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    assert_true(dc_ledger_persistent(&l));
    a = dc_ledger_job_get(&l, 1000, "run/../weird name\n");  /* any bytes: hex in the file name */
    b = dc_ledger_job_get(&l, 0, "");
    for (int i = 0; i < 37; i++) assert_int_equal(dc_ledger_spend(&l, a, 0.004, 0.9, &e), 0);
    for (int i = 0; i < 3; i++) assert_int_equal(dc_ledger_spend(&l, a, 1.0, 5.0, &e), 0);
    assert_int_equal(dc_ledger_spend(&l, b, 0.5, 3.0, &e), 0);
    dc_ledger_job_terms(a, 1e-6, 12.5);
    assert_int_equal(dc_ledger_save(&l, a, &e), 0);
    assert_int_equal(dc_ledger_save(&l, b, &e), 0);
    assert_true(a->saved_gen == a->gen);
    dc_ledger_job_path(&l, a, path, sizeof path);
    assert_non_null(strstr(path, "/1000-72756e2f2e2e2f7765697264206e616d650a.ledger"));
    assert_int_equal(stat(path, &st), 0);
    eps_a = a->eps;
    eps_b = b->eps;
    dc_ledger_close(&l);

    /* A temp file left by a crash is not the ledger and goes away. */
    {
        char tmp[700];
        FILE *f;
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        f = fopen(tmp, "w");
        assert_non_null(f);
        fputs("dpclip-ledger 1\nuid 1000\n", f); /* torn */
        fclose(f);
        assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
        assert_int_equal(stat(tmp, &st), -1);
    }
    assert_int_equal(l.n_jobs, 2);
    a = dc_ledger_job_find(&l, 1000, "run/../weird name\n");
    b = dc_ledger_job_find(&l, 0, "");
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(a->steps, 40);
    assert_int_equal(a->n_hist, 2);
    assert_true(a->delta == 1e-6 && a->budget_eps == 12.5);
    assert_true(a->eps == eps_a);  /* %.17g round-trips doubles exactly */
    assert_true(b->eps == eps_b && b->steps == 1);
    dc_ledger_close(&l);
}

static void write_file(const char *name, const char *text) {
    char path[600];
    FILE *f;
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void remove_file(const char *name) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    unlink(path);
}

static void test_corrupt_files_refuse(void **state) {
    static const struct { const char *text, *expect; } bad[] = {
        {"not a ledger\n", "bad first line"},
        {"dpclip-ledger 1\nuid 5\njob 6a\ndelta 1e-5\nbudget_epsilon 0\nsteps 2\n"
         "entry 0.1 1 2\n", "truncated"},
        {"dpclip-ledger 1\nuid 5\njob 6a\ndelta 1e-5\nbudget_epsilon 0\nsteps 3\n"
         "entry 0.1 1 2\nend\n", "add up"},
        {"dpclip-ledger 1\nuid 5\njob 6a\ndelta 1e-5\nsteps 1\nentry 0.1 1 1\nbogus 1\nend\n",
         ":7:"},
        {"dpclip-ledger 1\nuid 5\njob 6a\ndelta 1e-5\nsteps 1\nentry 7 1 1\nend\n", "bad entry"},
    };
    dc_ledger l;
    dc_err e;
    (void)state;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_file("5-6a.ledger", bad[i].text);
        assert_int_not_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
        if (!strstr(e.msg, bad[i].expect) || !strstr(e.msg, "5-6a.ledger")) {
            fprintf(stderr, "case %zu: message '%s' lacks '%s' or the file name\n", i, e.msg,
                    bad[i].expect);
            fail();
        }
    }
    remove_file("5-6a.ledger");
    /* and with the bad file gone the directory opens again */
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    dc_ledger_close(&l);
}

static void test_lock(void **state) {
    dc_ledger a, b;
    dc_err e;
    (void)state;
    assert_int_equal(dc_ledger_open(&a, g_dir, 1e-5, &e), 0);
    assert_int_not_equal(dc_ledger_open(&b, g_dir, 1e-5, &e), 0);
    assert_non_null(strstr(e.msg, "in use by another dpclipd"));
    dc_ledger_close(&a);
    assert_int_equal(dc_ledger_open(&b, g_dir, 1e-5, &e), 0);
    dc_ledger_close(&b);
}

static void test_write_file_errors(void **state) {
    dc_err e;
    char path[600];
    (void)state;
    /* A directory that does not exist: a clear error, nothing half-written. */
    snprintf(path, sizeof path, "%s/missing/1-.ledger", g_dir);
    assert_int_equal(dc_ledger_write_file(path, "x", 1, &e), DC_EUNAVAIL);
    assert_non_null(strstr(e.msg, "cannot create"));
    /* Replacing keeps exactly the new contents. */
    snprintf(path, sizeof path, "%s/replace.txt", g_dir);
    assert_int_equal(dc_ledger_write_file(path, "first version\n", 14, &e), 0);
    assert_int_equal(dc_ledger_write_file(path, "2nd\n", 4, &e), 0);
    {
        char buf[64] = "";
        FILE *f = fopen(path, "r");
        assert_non_null(f);
        assert_non_null(fgets(buf, sizeof buf, f));
        fclose(f);
        assert_string_equal(buf, "2nd\n");
    }
    unlink(path);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_compose_and_refund),
        cmocka_unit_test(test_terms),
        cmocka_unit_test(test_persist_roundtrip),
        cmocka_unit_test(test_corrupt_files_refuse),
        cmocka_unit_test(test_lock),
        cmocka_unit_test(test_write_file_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
