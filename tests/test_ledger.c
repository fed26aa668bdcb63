/* The privacy ledger (daemon/privacy/ledger.c, ledger_file.c): composition matches
 * the accountant, refunds are exact, an account's delta is fixed by its first
 * step, job ids are never truncated, the history is bounded (and never
 * understates), accounts are capped per uid and expire, curves are computed
 * off the calling thread, files round-trip (with the insecure mark), writes
 * are atomic, a corrupt or foreign file stops the start with a message
 * naming it, and two daemons cannot share a directory; data-parallel
 * logical steps take each rank once, at most world - 1 noiseless members
 * each, and their world, sigma and highest step survive a restart. Each
 * test gets its own directory. (The daemon-level kill -9 test is in test_service.c.) */
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
    dc_ledger_account *acct;
    dc_err e;
    double before, predicted;
    (void)state;

    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    assert_false(dc_ledger_persistent(&l));
    acct = dc_ledger_account_get(&l, 1000, "run-1");
    assert_non_null(acct);
    assert_ptr_equal(dc_ledger_account_get(&l, 1000, "run-1"), acct);
    assert_true(dc_ledger_account_get(&l, 1001, "run-1") != acct); /* the uid is part of the key */
    assert_true(acct->eps == 0.0 && acct->steps == 0);

    for (int i = 0; i < 100; i++) {
        predicted = dc_ledger_eps_after(&l, acct, 0.01, 1.1, 1e-5);
        assert_int_equal(dc_ledger_spend(&l, acct, 0.01, 1.1, &e), 0);
        /* what the budget check predicted is what the spend costs */
        assert_true(fabs(acct->eps - predicted) <= 1e-12 * predicted);
    }
    assert_int_equal(acct->steps, 100);
    assert_true(fabs(acct->eps - accountant_eps(0.01, 1.1, 100, 1e-5)) <= 1e-12 * acct->eps);

    /* A second kind of step composes by adding RDP curves. */
    before = acct->eps;
    for (int i = 0; i < 10; i++) assert_int_equal(dc_ledger_spend(&l, acct, 0.05, 2.0, &e), 0);
    assert_int_equal(acct->n_hist, 2);
    {
        double r1[DC_RDP_N_ORDERS], r2[DC_RDP_N_ORDERS], sum[DC_RDP_N_ORDERS];
        const double *o = dc_rdp_default_orders();
        dc_rdp_steps(0.01, 1.1, o, DC_RDP_N_ORDERS, r1);
        dc_rdp_steps(0.05, 2.0, o, DC_RDP_N_ORDERS, r2);
        for (int k = 0; k < DC_RDP_N_ORDERS; k++) sum[k] = 100 * r1[k] + 10 * r2[k];
        double want = dc_rdp_epsilon(o, sum, DC_RDP_N_ORDERS, 1e-5, NULL);
        assert_true(fabs(acct->eps - want) <= 1e-12 * want);
        assert_true(acct->eps > before);
        /* eps at another delta */
        assert_true(dc_ledger_eps_at(acct, 1e-8, NULL) > acct->eps);
    }

    /* Refunds take back exactly what was spent. */
    for (int i = 0; i < 10; i++) dc_ledger_refund(acct, 0.05, 2.0);
    assert_int_equal(acct->n_hist, 1);
    assert_true(fabs(acct->eps - before) <= 1e-12 * before);
    dc_ledger_refund(acct, 0.05, 2.0); /* nothing left of that kind: no-op */
    assert_int_equal(acct->steps, 100);

    /* No noise: infinite. */
    assert_int_equal(dc_ledger_spend(&l, acct, 0.01, 0.0, &e), 0);
    assert_true(isinf(acct->eps));
    dc_ledger_refund(acct, 0.01, 0.0);
    assert_true(isfinite(acct->eps));
    dc_ledger_close(&l);
}

static void test_terms(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_err e;
    uint64_t gen;
    double eps5;
    (void)state;
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    acct = dc_ledger_account_get(&l, 7, "terms");
    /* before its first step an account may say at which delta it reports */
    assert_int_equal(dc_ledger_account_terms(acct, 1e-7, 0, &e), 0);
    assert_true(acct->delta == 1e-7);
    assert_int_equal(dc_ledger_spend(&l, acct, 0.02, 1.0, &e), 0);
    eps5 = dc_ledger_eps_at(acct, 1e-5, NULL);
    assert_true(acct->eps > eps5);
    /* the budget only goes down */
    assert_int_equal(dc_ledger_account_terms(acct, 0, 8.0, &e), 0);
    assert_true(acct->budget_eps == 8.0);
    assert_int_equal(dc_ledger_account_terms(acct, 0, 9.0, &e), 0);
    assert_true(acct->budget_eps == 8.0);
    gen = acct->gen;
    assert_int_equal(dc_ledger_account_terms(acct, 1e-7, 8.0, &e), 0); /* its own delta: fine */
    assert_true(acct->gen == gen); /* no change, no new generation to write */
    assert_int_equal(dc_ledger_account_terms(acct, 0, 3.0, &e), 0);
    assert_true(acct->budget_eps == 3.0 && acct->gen == gen + 1);
    dc_ledger_close(&l);
}

/* Raising delta after spending made the same spend look smaller: 2000 more
 * steps ran past a budget. An account's delta is fixed by its first step. */
static void test_delta_fixed_by_first_step(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_err e;
    double eps;
    uint64_t gen;
    (void)state;
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    acct = dc_ledger_account_get(&l, 7, "fixed");
    /* a budget at the default delta */
    assert_int_equal(dc_ledger_account_terms(acct, 0, 2.0, &e), 0);
    for (int i = 0; i < 50; i++) assert_int_equal(dc_ledger_spend(&l, acct, 0.05, 1.0, &e), 0);
    eps = acct->eps;
    gen = acct->gen;
    dc_err_clear(&e);
    assert_int_equal(dc_ledger_account_terms(acct, 0.1, 0, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.target_delta");
    assert_non_null(strstr(e.msg, "fixed by its first step"));
    assert_true(acct->delta == 1e-5 && acct->eps == eps && acct->gen == gen);
    /* a smaller delta is refused as well: one delta per account */
    assert_int_equal(dc_ledger_account_terms(acct, 1e-9, 0, &e), DC_EPRECOND);
    assert_true(acct->delta == 1e-5);
    dc_ledger_close(&l);
}

/* A job id is kept whole or refused: ids that differ after byte 63 once
 * shared one account. */
static void test_job_id_length(void **state) {
    dc_ledger l;
    dc_ledger_account *a = NULL, *b = NULL;
    dc_err e;
    char id1[100], id2[100];
    (void)state;
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    memset(id1, 'x', 80);
    id1[80] = '\0';
    memcpy(id2, id1, sizeof id1);
    id2[70] = 'y';
    assert_int_equal(dc_ledger_account_open(&l, 1, id1, &a, &e), DC_EINVAL);
    assert_string_equal(e.field, "hello.job_id");
    assert_non_null(strstr(e.msg, "at most 63 bytes"));
    assert_null(a);
    assert_null(dc_ledger_account_get(&l, 1, id2));
    assert_int_equal(l.n_accounts, 0);
    /* the longest id kept whole */
    id1[DC_LEDGER_JOB_ID_MAX - 1] = '\0';
    assert_int_equal(dc_ledger_account_open(&l, 1, id1, &a, &e), 0);
    assert_int_equal(strlen(a->job_id), DC_LEDGER_JOB_ID_MAX - 1);
    id2[DC_LEDGER_JOB_ID_MAX - 1] = '\0';
    id2[DC_LEDGER_JOB_ID_MAX - 2] = 'y';
    assert_int_equal(dc_ledger_account_open(&l, 1, id2, &b, &e), 0);
    assert_true(a != b);
    dc_ledger_close(&l);
}

/* eps of steps[i] steps of (q[i], sigma[i]) for i < n, composed exactly. */
static double exact_eps(const double *q, const double *sigma, const double *steps, size_t n,
                        double delta) {
    double rdp[DC_RDP_N_ORDERS] = {0}, one[DC_RDP_N_ORDERS];
    for (size_t i = 0; i < n; i++) {
        dc_rdp_steps(q[i], sigma[i], dc_rdp_default_orders(), DC_RDP_N_ORDERS, one);
        for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] += steps[i] * one[k];
    }
    return dc_rdp_epsilon(dc_rdp_default_orders(), rdp, DC_RDP_N_ORDERS, delta, NULL);
}

/* 4000 distinct sample rates kept 4000 entries and slowed every step: the
 * history is bounded, what leaves it is folded into a sum that never
 * understates the spend, and refunds of folded pairs still work. */
static void test_history_bounded(void **state) {
    enum { N = 400 };
    static double q[N], sigma[N], steps[N];
    dc_ledger l;
    dc_ledger_account *acct;
    dc_err e;
    double want, before;
    (void)state;
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    acct = dc_ledger_account_get(&l, 3, "many-rates");
    for (int i = 0; i < N; i++) {
        q[i] = 0.001 + 0.0001 * i;
        sigma[i] = 1.0;
        steps[i] = 1 + i % 3;
        for (int k = 0; k < (int)steps[i]; k++)
            assert_int_equal(dc_ledger_spend(&l, acct, q[i], sigma[i], &e), 0);
        assert_true(acct->n_hist <= DC_LEDGER_HIST_MAX);
    }
    assert_int_equal(acct->n_hist, DC_LEDGER_HIST_MAX);
    want = exact_eps(q, sigma, steps, N, 1e-5);
    assert_true(acct->folded_steps > 0);
    assert_true(acct->eps >= want);              /* never understated */
    assert_true(acct->eps <= want * (1 + 1e-9)); /* and as good as exact */
    /* the most recent pairs are the ones kept apart */
    for (int i = N - DC_LEDGER_HIST_MAX; i < N; i++) {
        bool found = false;
        for (size_t k = 0; k < acct->n_hist; k++) found |= acct->hist[k].q == q[i];
        assert_true(found);
    }
    /* a refund of an early (folded) pair takes its step back */
    before = acct->eps;
    dc_ledger_refund(acct, q[0], sigma[0]);
    steps[0] -= 1;
    assert_true(acct->eps < before);
    assert_true(acct->eps >= exact_eps(q, sigma, steps, N, 1e-5));
    /* the bounded history round-trips through the file */
    assert_int_equal(dc_ledger_save(&l, acct, &e), 0);
    before = acct->eps;
    dc_ledger_close(&l);
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    acct = dc_ledger_account_find(&l, 3, "many-rates");
    assert_non_null(acct);
    assert_true(acct->eps == before);
    assert_true(acct->n_hist == DC_LEDGER_HIST_MAX && acct->folded_steps > 0);
    dc_ledger_close(&l);
}

/* 20k Hellos with fresh job ids kept 20k accounts: at most
 * max_jobs_per_uid per uid, and accounts nothing uses go. */
static void test_jobs_per_uid(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_err e;
    char name[32];
    (void)state;
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    dc_ledger_set_limits(&l, 3, 3600);
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "job-%d", i);
        assert_int_equal(dc_ledger_account_open(&l, 42, name, &acct, &e), 0);
        acct->sessions++; /* attached to a session */
    }
    assert_int_equal(dc_ledger_account_open(&l, 42, "one-more", &acct, &e), DC_ENOSPACE);
    assert_string_equal(e.field, "ledger.max_jobs_per_uid");
    assert_non_null(strstr(e.msg, "ledger.max_jobs_per_uid"));
    assert_null(acct);
    /* its existing accounts and other uids are not affected */
    assert_int_equal(dc_ledger_account_open(&l, 42, "job-1", &acct, &e), 0);
    assert_int_equal(dc_ledger_account_open(&l, 43, "one-more", &acct, &e), 0);
    /* a session ends; its account never spent anything: its place is free */
    dc_ledger_account_find(&l, 42, "job-0")->sessions--;
    assert_int_equal(dc_ledger_expire(&l, uv_hrtime()), 2); /* and uid 43's unused one */
    assert_null(dc_ledger_account_find(&l, 42, "job-0"));
    assert_int_equal(dc_ledger_account_open(&l, 42, "one-more", &acct, &e), 0);
    /* at the cap, accounts that never spent and have no session make room
     * at once (a burst of Hellos between two sweeps) */
    for (int i = 0; i < 2; i++) {
        snprintf(name, sizeof name, "burst-%d", i);
        assert_int_equal(dc_ledger_account_open(&l, 42, name, &acct, &e), 0);
    }
    assert_null(dc_ledger_account_find(&l, 42, "one-more")); /* made room for burst-0 */
    assert_null(dc_ledger_account_find(&l, 42, "burst-0"));  /* and it for burst-1 */
    assert_non_null(dc_ledger_account_find(&l, 42, "burst-1"));
    assert_non_null(dc_ledger_account_find(&l, 42, "job-1")); /* in use: stays */
    /* many Hellos with fresh ids, each closed at once, hold nothing */
    dc_ledger_set_limits(&l, 0, 3600);
    for (int i = 0; i < 2000; i++) {
        snprintf(name, sizeof name, "hello-%d", i);
        assert_non_null(dc_ledger_account_get(&l, 44, name));
    }
    dc_ledger_expire(&l, uv_hrtime());
    for (dc_ledger_account *k = l.accounts; k; k = k->next) assert_int_not_equal(k->uid, 44);
    dc_ledger_close(&l);
}

/* An account that spent stays for job_idle_s after its last step and with
 * a session attached; then it goes, from memory only when it is on disk. */
static void test_idle_expiry(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_err e;
    uint64_t now, idle = 60 * 1000000000ull;
    double eps;
    (void)state;
    /* in memory: forgotten after the idle time */
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    dc_ledger_set_limits(&l, 0, 60);
    acct = dc_ledger_account_get(&l, 5, "idle");
    assert_int_equal(dc_ledger_spend(&l, acct, 0.01, 1.0, &e), 0);
    now = acct->used_ns;
    assert_int_equal(dc_ledger_expire(&l, now + idle - 1), 0);
    acct->sessions++;
    assert_int_equal(dc_ledger_expire(&l, now + 10 * idle), 0); /* in use */
    acct->sessions--;
    assert_int_equal(dc_ledger_expire(&l, now + idle), 1);
    assert_null(dc_ledger_account_find(&l, 5, "idle"));
    dc_ledger_close(&l);

    /* persistent: dropped once on disk, and read back whole when named */
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    dc_ledger_set_limits(&l, 0, 60);
    acct = dc_ledger_account_get(&l, 5, "idle-disk");
    assert_int_equal(dc_ledger_account_terms(acct, 1e-6, 9.0, &e), 0);
    for (int i = 0; i < 7; i++) assert_int_equal(dc_ledger_spend(&l, acct, 0.02, 1.1, &e), 0);
    eps = acct->eps;
    now = acct->used_ns;
    assert_int_equal(dc_ledger_expire(&l, now + idle), 0); /* not on disk yet */
    assert_int_equal(dc_ledger_save(&l, acct, &e), 0);
    assert_int_equal(dc_ledger_expire(&l, now + idle), 1);
    assert_null(dc_ledger_account_find(&l, 5, "idle-disk"));
    assert_int_equal(dc_ledger_account_open(&l, 5, "idle-disk", &acct, &e), 0);
    assert_true(acct->eps == eps && acct->steps == 7 && acct->delta == 1e-6 &&
                acct->budget_eps == 9.0);
    assert_true(acct->saved_gen == acct->gen);
    dc_ledger_close(&l);
}

/* At the cap, a persistent ledger makes room with accounts that are on
 * disk and unused, instead of refusing. */
static void test_cap_drops_saved_accounts(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_err e;
    char name[32];
    (void)state;
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    dc_ledger_set_limits(&l, 2, 3600);
    for (int i = 0; i < 2; i++) {
        snprintf(name, sizeof name, "saved-%d", i);
        assert_int_equal(dc_ledger_account_open(&l, 9, name, &acct, &e), 0);
        assert_int_equal(dc_ledger_spend(&l, acct, 0.1, 2.0, &e), 0);
    }
    /* one is not on disk yet: only the other may go */
    assert_int_equal(dc_ledger_save(&l, dc_ledger_account_find(&l, 9, "saved-0"), &e), 0);
    assert_int_equal(dc_ledger_account_open(&l, 9, "new", &acct, &e), 0);
    assert_null(dc_ledger_account_find(&l, 9, "saved-0"));
    assert_non_null(dc_ledger_account_find(&l, 9, "saved-1"));
    acct->sessions++;
    assert_int_equal(dc_ledger_account_open(&l, 9, "saved-0", &acct, &e), DC_ENOSPACE);
    dc_ledger_close(&l);
}

/* A spend under --insecure-fixed-seed marks the account, on disk too. */
static void test_insecure_mark(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_err e;
    char *buf;
    size_t len;
    (void)state;
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    l.insecure = true;
    acct = dc_ledger_account_get(&l, 11, "insecure");
    assert_false(acct->insecure);
    assert_int_equal(dc_ledger_spend(&l, acct, 0.1, 2.0, &e), 0);
    assert_true(acct->insecure);
    assert_int_equal(dc_ledger_serialize(acct, &buf, &len), 0);
    assert_non_null(strstr(buf, "\ninsecure 1\n"));
    free(buf);
    assert_int_equal(dc_ledger_save(&l, acct, &e), 0);
    dc_ledger_close(&l);
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0); /* a secure daemon now */
    acct = dc_ledger_account_find(&l, 11, "insecure");
    assert_true(acct->insecure);
    dc_ledger_close(&l);
}

/* Curves are computed on libuv's pool, one at a time, waiters called back
 * on the loop in order once theirs is at hand. */
static int g_order[8], g_called;
static void on_curve(dc_ledger_waiter *w, int rc, const dc_err *err) {
    (void)err;
    assert_int_equal(rc, 0);
    g_order[g_called++] = (int)w->gen;
}

static void test_curve_async(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_ledger_waiter w[3] = {{.gen = 0}, {.gen = 1}, {.gen = 2}};
    uv_loop_t loop;
    dc_err e;
    double expect[DC_RDP_N_ORDERS];
    (void)state;
    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    acct = dc_ledger_account_get(&l, 1, "async");
    assert_false(dc_ledger_has_curve(&l, acct, 0.5, 1e6));
    for (int i = 0; i < 3; i++) w[i].done = on_curve;
    g_called = 0;
    dc_ledger_curve_async(&l, &loop, 0.5, 1e6, &w[0]);
    dc_ledger_curve_async(&l, &loop, 0.25, 3.0, &w[1]);
    dc_ledger_curve_async(&l, &loop, 0.5, 1e6, &w[2]);
    assert_int_equal(g_called, 0); /* nothing computed on this thread */
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(g_called, 3);
    /* the same pair's waiters together, then the next pair */
    assert_int_equal(g_order[0], 0);
    assert_int_equal(g_order[1], 2);
    assert_int_equal(g_order[2], 1);
    assert_true(dc_ledger_has_curve(&l, acct, 0.5, 1e6) &&
                dc_ledger_has_curve(&l, acct, 0.25, 3.0));
    /* and the cached curve is the accountant's */
    dc_rdp_steps(0.25, 3.0, dc_rdp_default_orders(), DC_RDP_N_ORDERS, expect);
    assert_int_equal(dc_ledger_spend(&l, acct, 0.25, 3.0, &e), 0);
    assert_memory_equal(acct->hist[0].rdp, expect, sizeof expect);
    dc_ledger_close(&l);
    assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_persist_roundtrip(void **state) {
    dc_ledger l;
    dc_ledger_account *a, *b;
    dc_err e;
    char path[600];
    double eps_a, eps_b;
    struct stat st;
    (void)state;

    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    assert_true(dc_ledger_persistent(&l));
    /* any bytes: hex in the file name */
    a = dc_ledger_account_get(&l, 1000, "run/../weird name\n");
    b = dc_ledger_account_get(&l, 0, "");
    for (int i = 0; i < 37; i++) assert_int_equal(dc_ledger_spend(&l, a, 0.004, 0.9, &e), 0);
    for (int i = 0; i < 3; i++) assert_int_equal(dc_ledger_spend(&l, a, 1.0, 5.0, &e), 0);
    assert_int_equal(dc_ledger_spend(&l, b, 0.5, 3.0, &e), 0);
    assert_int_equal(dc_ledger_account_terms(a, 0, 12.5, &e), 0);
    assert_int_equal(dc_ledger_save(&l, a, &e), 0);
    assert_int_equal(dc_ledger_save(&l, b, &e), 0);
    assert_true(a->saved_gen == a->gen);
    dc_ledger_account_path(&l, a, path, sizeof path);
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
    assert_int_equal(l.n_accounts, 2);
    a = dc_ledger_account_find(&l, 1000, "run/../weird name\n");
    b = dc_ledger_account_find(&l, 0, "");
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(a->steps, 40);
    assert_int_equal(a->n_hist, 2);
    assert_true(a->delta == 1e-5 && a->budget_eps == 12.5);
    assert_true(a->eps == eps_a); /* %.17g round-trips doubles exactly */
    assert_true(b->eps == eps_b && b->steps == 1);
    dc_ledger_close(&l);
}

/* One member of a data-parallel logical step, as step_account.c takes it:
 * the plan, the charge where planned, the commit. The error's code, or 0. */
static int take(dc_ledger *l, dc_ledger_account *acct, dc_dp_member *m, double own, double q,
                dc_err *e) {
    dc_dp_terms t = {q, 1.0, 8};
    dc_dp_plan p;
    int rc;
    m->declared = true;
    if ((rc = dc_ledger_dp_check(m, own, e)) || (rc = dc_ledger_dp_plan(acct, m, own, &t, &p, e)))
        return rc;
    if (p.charge && (rc = dc_ledger_spend(l, acct, q, m->sigma, e))) return rc;
    dc_ledger_dp_commit(acct, m, own, &t, &p);
    return 0;
}

static dc_dp_member dp_member(uint32_t world, uint32_t rank, double sigma, uint64_t step) {
    dc_dp_member m = {.declared = true, .world = world, .rank = rank, .sigma = sigma, .step = step};
    return m;
}

static void test_data_parallel_members(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_dp_member m;
    dc_dp_terms t = {0.1, 1.0, 8};
    dc_dp_plan p;
    dc_err e;
    (void)state;
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    acct = dc_ledger_account_get(&l, 1, "dp");

    /* the declaration alone */
    m = dp_member(1, 0, 1.0, 0);
    assert_int_equal(dc_ledger_dp_check(&m, 0, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.data_parallel.world");
    m = dp_member(DC_LEDGER_DP_WORLD_MAX + 1, 0, 1.0, 0);
    assert_int_equal(dc_ledger_dp_check(&m, 0, &e), DC_EINVAL);
    m = dp_member(3, 3, 1.0, 0);
    assert_int_equal(dc_ledger_dp_check(&m, 0, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.data_parallel.rank");
    m = dp_member(3, 0, 0.0, 0);
    assert_int_equal(dc_ledger_dp_check(&m, 0, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.data_parallel.noise_multiplier");
    m = dp_member(3, 0, NAN, 0);
    assert_int_equal(dc_ledger_dp_check(&m, 0, &e), DC_EINVAL);
    m = dp_member(3, 0, 1.0, UINT64_C(1) << 63);
    assert_int_equal(dc_ledger_dp_check(&m, 0, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.data_parallel.step");
    m = dp_member(3, 0, 1.0, 0);
    assert_int_equal(dc_ledger_dp_check(&m, 0.99, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.noise_multiplier");
    assert_int_equal(dc_ledger_dp_check(&m, 1.0, &e), 0);
    assert_int_equal(dc_ledger_dp_check(&m, 0.0, &e), 0);

    /* logical step 1 of 3 ranks: the first member charges, noiseless or not */
    m = dp_member(3, 2, 1.0, 0);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), 0);
    assert_int_equal(m.role, DC_DP_CHARGED);
    assert_int_equal(m.step, 1);
    assert_int_equal(acct->steps, 1);
    m = dp_member(3, 1, 1.0, 0);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), 0);
    assert_int_equal(m.role, DC_DP_SHARE);
    assert_int_equal(m.step, 1);
    assert_int_equal(acct->steps, 1);
    assert_int_equal(acct->shares, 2);
    /* a third noiseless member would leave the step without noise */
    m = dp_member(3, 0, 1.0, 0);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.noise_multiplier");
    /* a member with other terms */
    t.q = 0.2;
    assert_int_equal(dc_ledger_dp_plan(acct, &m, 1.0, &t, &p, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.sample_rate");
    t.q = 0.1;
    t.c = 2.0;
    assert_int_equal(dc_ledger_dp_plan(acct, &m, 1.0, &t, &p, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.clip.max_grad_norm");
    t.c = 1.0;
    t.divisor = 16;
    assert_int_equal(dc_ledger_dp_plan(acct, &m, 1.0, &t, &p, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.clip.expected_batch_size");
    /* the noise comes: covered, and every rank is in: the step closes */
    assert_int_equal(take(&l, acct, &m, 1.5, 0.1, &e), 0);
    assert_int_equal(m.role, DC_DP_COVERED);
    assert_int_equal(acct->dp->n_open, 0);
    assert_int_equal(acct->steps, 1);
    /* rank 1 again in step 1: a replay; world and sigma are the account's */
    m = dp_member(3, 1, 1.0, 1);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.data_parallel.step");
    m = dp_member(4, 1, 1.0, 0);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.data_parallel.world");
    m = dp_member(3, 1, 2.0, 0);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.data_parallel.noise_multiplier");

    /* a step closed (every rank in) is charged anew by whoever names it:
     * rank 0 skips to 9, then rank 1 comes to 9 as a share */
    m = dp_member(3, 0, 1.0, 9);
    assert_int_equal(take(&l, acct, &m, 1.0, 0.1, &e), 0);
    assert_int_equal(m.role, DC_DP_CHARGED);
    assert_int_equal(acct->steps, 2);
    assert_int_equal(acct->dp->newest, 9);
    m = dp_member(3, 1, 1.0, 9);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), 0);
    assert_int_equal(m.role, DC_DP_SHARE);
    /* the charge of a step another member took stays */
    m.step = 9;
    assert_false(dc_ledger_dp_unwind(acct, &m));
    /* one no one else took goes: then its next member charges it again */
    m = dp_member(3, 2, 1.0, 12);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), 0);
    assert_int_equal(m.role, DC_DP_CHARGED);
    assert_true(dc_ledger_dp_unwind(acct, &m));
    dc_ledger_refund(acct, 0.1, 1.0);
    assert_int_equal(acct->steps, 2);
    m = dp_member(3, 1, 1.0, 12);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), 0);
    assert_int_equal(m.role, DC_DP_CHARGED);
    assert_int_equal(acct->steps, 3);

    /* the last number: taken once, and then the rank has no next */
    m = dp_member(3, 2, 1.0, (UINT64_C(1) << 63) - 1);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), 0);
    m = dp_member(3, 2, 1.0, 0);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.data_parallel.step");

    /* the window: a step pushed out is charged again by a late member */
    for (uint64_t k = 100; k < 100 + DC_LEDGER_DP_WINDOW + 1; k++) {
        m = dp_member(3, 0, 1.0, k);
        assert_int_equal(take(&l, acct, &m, 1.0, 0.1, &e), 0);
        assert_int_equal(m.role, DC_DP_CHARGED);
    }
    assert_int_equal(acct->dp->n_open, DC_LEDGER_DP_WINDOW);
    m = dp_member(3, 1, 1.0, 100);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), 0);
    assert_int_equal(m.role, DC_DP_CHARGED);
    dc_ledger_close(&l);
}

static void test_data_parallel_persist(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_dp_member m;
    dc_err e;
    double eps;
    (void)state;
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    acct = dc_ledger_account_get(&l, 7, "dp-disk");
    for (int i = 0; i < 3; i++) {
        m = dp_member(4, 0, 1.25, 0);
        assert_int_equal(take(&l, acct, &m, 1.25, 0.1, &e), 0);
    }
    m = dp_member(4, 2, 1.25, 0); /* rank 2 at step 1 of 3: shares open steps */
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), 0);
    assert_int_equal(m.role, DC_DP_SHARE);
    assert_int_equal(dc_ledger_save(&l, acct, &e), 0);
    eps = acct->eps;
    dc_ledger_close(&l);

    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    acct = dc_ledger_account_find(&l, 7, "dp-disk");
    assert_non_null(acct);
    assert_non_null(acct->dp);
    assert_int_equal(acct->dp->world, 4);
    assert_true(acct->dp->sigma == 1.25);
    assert_int_equal(acct->dp->newest, 3);
    assert_int_equal(acct->dp->n_open, 0);
    assert_true(acct->eps == eps && acct->steps == 3);
    /* no step up to the highest can be taken again, by any rank */
    m = dp_member(4, 2, 1.25, 2);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.data_parallel.step");
    m = dp_member(4, 3, 1.25, 3);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), DC_EPRECOND);
    m = dp_member(2, 1, 1.25, 0);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step.data_parallel.world");
    m = dp_member(4, 3, 1.25, 0);
    assert_int_equal(take(&l, acct, &m, 0.0, 0.1, &e), 0);
    assert_int_equal(m.step, 4);
    assert_int_equal(m.role, DC_DP_CHARGED);
    assert_int_equal(acct->steps, 4);
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
    static const struct {
        const char *text, *expect;
    } bad[] = {
        {"not a ledger\n", "bad first line"},
        {"dpclip-ledger 1\nuid 5\njob 6a\ndelta 1e-5\nbudget_epsilon 0\nsteps 2\n"
         "entry 0.1 1 2\n",
         "truncated"},
        {"dpclip-ledger 1\nuid 5\njob 6a\ndelta 1e-5\nbudget_epsilon 0\nsteps 3\n"
         "entry 0.1 1 2\nend\n",
         "add up"},
        {"dpclip-ledger 1\nuid 5\njob 6a\ndelta 1e-5\nsteps 1\nentry 0.1 1 1\nbogus 1\nend\n",
         ":7:"},
        {"dpclip-ledger 1\nuid 5\njob 6a\ndelta 1e-5\nsteps 1\nentry 7 1 1\nend\n", "bad entry"},
        {"dpclip-ledger 2\nuid 5\njob 6a\ndelta 1e-5\nsteps 1\nentry 0.1 1 1\n"
         "data_parallel 1 1 1\nend\n",
         "bad data_parallel"},
        {"dpclip-ledger 2\nuid 5\njob 6a\ndelta 1e-5\nsteps 1\nentry 0.1 1 1\n"
         "data_parallel 4 0 1\nend\n",
         "bad data_parallel"},
        {"dpclip-ledger 2\nuid 5\njob 6a\ndelta 1e-5\nsteps 1\nentry 0.1 1 1\n"
         "data_parallel 4 1 1 9\nend\n",
         "bad data_parallel"},
        {"dpclip-ledger 2\nuid 5\njob 6a\ndelta 1e-5\nsteps 1\nentry 0.1 1 1\n"
         "data_parallel 4 1 1\ndata_parallel 4 1 2\nend\n",
         "bad data_parallel"},
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
        cmocka_unit_test_setup_teardown(test_compose_and_refund, setup, teardown),
        cmocka_unit_test_setup_teardown(test_terms, setup, teardown),
        cmocka_unit_test_setup_teardown(test_delta_fixed_by_first_step, setup, teardown),
        cmocka_unit_test_setup_teardown(test_job_id_length, setup, teardown),
        cmocka_unit_test_setup_teardown(test_history_bounded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_jobs_per_uid, setup, teardown),
        cmocka_unit_test_setup_teardown(test_idle_expiry, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cap_drops_saved_accounts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_insecure_mark, setup, teardown),
        cmocka_unit_test_setup_teardown(test_curve_async, setup, teardown),
        cmocka_unit_test_setup_teardown(test_persist_roundtrip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_data_parallel_members, setup, teardown),
        cmocka_unit_test_setup_teardown(test_data_parallel_persist, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corrupt_files_refuse, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lock, setup, teardown),
        cmocka_unit_test_setup_teardown(test_write_file_errors, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
