/* Hostile clients against data-parallel shares (issue 38): noiseless steps
 * a job's other sessions used to take for free. Each attack below released
 * noiseless sums uncharged on the daemon as it was: after charged steps (one
 * free share per charged step and session, and one ahead), from Hello-only
 * sessions past a budget, backed by steps of an absurd noise multiplier, by
 * C clients that named no job (they all shared the account ""), and through
 * a norm group's leader whose share covered its members. Now a noiseless
 * step is free only as a declared member of a data-parallel logical step
 * (ClipStep.data_parallel) that is charged once at the job's sigma, at most
 * world - 1 of them per logical step, each rank once per step, never again
 * by reconnecting or after a restart. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

#define Q 0.05 /* every step's sample rate */

static dc_harness g_h;
static char g_ledger[300];

static int make_ledger_dir(char *out, size_t n) {
    snprintf(out, n, "%s/dpclip-hostile-shares.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    return mkdtemp(out) ? 0 : -1;
}

static int start_daemon(dc_harness *h, const char *ledger) {
    char args[600];
    snprintf(args, sizeof args, NO_SYSTEM_CONFIG "--workers 2 --ledger-dir %s", ledger);
    return dc_harness_start(h, args);
}

static int group_setup(void **state) {
    (void)state;
    if (make_ledger_dir(g_ledger, sizeof g_ledger)) return -1;
    return start_daemon(&g_h, g_ledger);
}

static int group_teardown(void **state) {
    char cmd[400];
    int rc = 0;
    (void)state;
    if (g_h.pid) rc = dc_harness_stop(&g_h);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_ledger);
    return system(cmd) == 0 && rc == 0 ? 0 : -1;
}

/* --- helpers ----------------------------------------------------------------- */

static double acct_eps(double q, double sigma, double steps) {
    double rdp[DC_RDP_N_ORDERS];
    if (steps == 0) return 0.0;
    dc_rdp_steps(q, sigma, dc_rdp_default_orders(), DC_RDP_N_ORDERS, rdp);
    for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] *= steps;
    return dc_rdp_epsilon(dc_rdp_default_orders(), rdp, DC_RDP_N_ORDERS, 1e-5, NULL);
}

static void assert_rel(double got, double want, double rtol) {
    if (!(fabs(got - want) <= rtol * fabs(want))) {
        fprintf(stderr, "got %.17g, want %.17g\n", got, want);
        fail();
    }
}

static dpclip_client *connect_to(const char *sock, const char *job) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "hostile-shares", .job_id = job};
    int rc = dpclip_connect(sock, job ? &o : NULL, &c);
    if (rc) fprintf(stderr, "connect: %s\n", dpclip_errmsg(c));
    assert_int_equal(rc, 0);
    return c;
}

static dpclip_client *connect_job(const char *job) { return connect_to(g_h.sock, job); }

/* A small CPU step (two linear layers, B = 8, SUM, C = 1) on c. */
static void step_on(dc_shm_step *s, dpclip_client *c, float sigma, uint64_t seed) {
    assert_int_equal(dc_service_step_init(s, c, 8, sigma, Q, seed), 0);
}

/* The step's noise multiplier, sample rate and budget (rebuilding it:
 * a data-parallel membership is set again after this). */
static void terms(dc_shm_step *s, float sigma, double q, double budget) {
    dpclip_clip_config cfg = s->cfg;
    cfg.noise_multiplier = sigma;
    cfg.sample_rate = q;
    cfg.target_epsilon = budget;
    assert_int_equal(dc_shm_step_set_config(s, &cfg), 0);
}

/* Runs the step: its status, and the job's epsilon from the reply. */
static int run(dpclip_client *c, dc_shm_step *s, double *eps) {
    dpclip_result res;
    int rc = dpclip_run(c, s->step, &res);
    if (rc == 0) {
        if (eps) *eps = res.epsilon;
        dpclip_result_free(&res);
    }
    return rc;
}

/* A noiseless release the ledger did not pay for: it succeeded and the
 * job's epsilon is still the finite value it had before. */
static int free_release(int rc, double before, double after) {
    return rc == 0 && isfinite(after) && after == before;
}

/* --- the attacks, as found ------------------------------------------------------ */

/* 50 charged steps, then 153 sigma-0 steps of a second session of the job:
 * the old rule let (sessions - 1) * (steps + 1) of them through with
 * epsilon unchanged. A noiseless step that declares no data parallelism is
 * now charged as what it is. */
static void test_charged_steps_back_no_other_session(void **state) {
    dpclip_client *a = connect_job("h-after-50"), *b = connect_job("h-after-50");
    dc_shm_step sa, sb;
    double eps = 0, after;
    int free_n = 0;
    (void)state;
    step_on(&sa, a, 1.0f, 1);
    step_on(&sb, b, 0.0f, 2);
    for (int i = 0; i < 50; i++) assert_int_equal(run(a, &sa, &eps), 0);
    assert_rel(eps, acct_eps(Q, 1.0, 50), 1e-9);
    for (int i = 0; i < 153; i++) {
        int rc = run(b, &sb, &after);
        free_n += free_release(rc, eps, after);
    }
    if (free_n) fprintf(stderr, "%d noiseless releases left epsilon at %g\n", free_n, eps);
    assert_int_equal(free_n, 0);
    dc_shm_step_free(&sa);
    dc_shm_step_free(&sb);
    dpclip_disconnect(a);
    dpclip_disconnect(b);
}

/* 20 sessions that only said Hello made a job of budget 1 count as 21
 * ranks: 20 unnoised releases with the ledger at 0 steps. */
static void test_hello_only_sessions_back_nothing(void **state) {
    dpclip_client *idle[20], *c;
    dc_shm_step s;
    int released = 0;
    (void)state;
    for (int i = 0; i < 20; i++) idle[i] = connect_job("h-hello");
    c = connect_job("h-hello");
    step_on(&s, c, 0.0f, 3);
    terms(&s, 0.0f, Q, 1.0);
    for (int i = 0; i < 20; i++) {
        int rc = run(c, &s, NULL);
        if (rc == 0) released++;
        else assert_string_equal(dpclip_errfield(c), "clip_step.target_epsilon");
    }
    if (released) fprintf(stderr, "%d unnoised releases under a budget of 1\n", released);
    assert_int_equal(released, 0);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    for (int i = 0; i < 20; i++) dpclip_disconnect(idle[i]);
}

/* Each sigma-0 share backed by one sigma = 1e4 step: 50 unnoised releases
 * at epsilon 0.103. Undeclared, the noiseless steps are charged as such. */
static void test_absurd_sigma_backs_no_undeclared_share(void **state) {
    dpclip_client *a = connect_job("h-1e4"), *b = connect_job("h-1e4");
    dc_shm_step sa, sb;
    double eps = 0, after;
    int free_n = 0;
    (void)state;
    step_on(&sa, a, 1e4f, 4);
    step_on(&sb, b, 0.0f, 5);
    for (int i = 0; i < 50; i++) {
        int rc;
        if (run(a, &sa, &eps) != 0) break;
        rc = run(b, &sb, &after);
        free_n += free_release(rc, eps, after);
    }
    if (free_n) fprintf(stderr, "%d unnoised releases at epsilon %g\n", free_n, eps);
    assert_int_equal(free_n, 0);
    dc_shm_step_free(&sa);
    dc_shm_step_free(&sb);
    dpclip_disconnect(a);
    dpclip_disconnect(b);
}

/* C clients that named no job all shared the account "": a sigma-0
 * baseline run beside a private run of the same uid took free shares of
 * it. Each such handle now has an account of its own. */
static void test_no_job_id_shares_no_account(void **state) {
    dpclip_client *a = connect_to(g_h.sock, NULL), *b = connect_to(g_h.sock, NULL);
    dc_shm_step sa, sb;
    double eps = 0, after = 0;
    int rc;
    (void)state;
    step_on(&sa, a, 1.0f, 6);
    step_on(&sb, b, 0.0f, 7);
    for (int i = 0; i < 3; i++) assert_int_equal(run(a, &sa, &eps), 0);
    rc = run(b, &sb, &after);
    assert_int_equal(rc, 0);
    if (isfinite(after)) fprintf(stderr, "a noiseless run got epsilon %g\n", after);
    assert_true(isinf(after)); /* its own account: no privacy */
    /* and the private run's account is its own too */
    assert_int_equal(run(a, &sa, &eps), 0);
    assert_rel(eps, acct_eps(Q, 1.0, 4), 1e-9);
    dc_shm_step_free(&sa);
    dc_shm_step_free(&sb);
    dpclip_disconnect(a);
    dpclip_disconnect(b);
}

/* A GROUP_WISE leader whose sigma-0 step took the share path still marked
 * the group charged, so its member's sigma-0 step was covered too. */
static void test_group_leader_share_covers_no_member(void **state) {
    dpclip_client *x = connect_job("h-gw"), *y = connect_job("h-gw");
    dpclip_group_opts o = {.name = "h-gw", .size = 2, .timeout_ms = 5000, .group_wise = 1};
    dc_shm_step sx, sy;
    uint64_t gid;
    double ex = 0, ey = 0;
    int free_n = 0;
    (void)state;
    o.rank = 0;
    assert_int_equal(dpclip_join_group(x, &o, &gid), 0);
    o.rank = 1;
    assert_int_equal(dpclip_join_group(y, &o, &gid), 0);
    step_on(&sx, x, 0.0f, 8);
    step_on(&sy, y, 0.0f, 9);
    for (int i = 0; i < 3; i++) {
        int rx = run(x, &sx, &ex), ry = run(y, &sy, &ey);
        free_n += (rx == 0 && isfinite(ex)) + (ry == 0 && isfinite(ey));
    }
    if (free_n) fprintf(stderr, "%d noiseless group releases with a finite epsilon\n", free_n);
    assert_int_equal(free_n, 0);
    dc_shm_step_free(&sx);
    dc_shm_step_free(&sy);
    dpclip_disconnect(x);
    dpclip_disconnect(y);
}

/* --- the rules that replace them ---------------------------------------------------
 * (ClipStep.data_parallel, which the daemon as found did not have) */

/* The status of a step that must be refused, with its field. */
static void refused(dpclip_client *c, dc_shm_step *s, int code, const char *field) {
    int rc = run(c, s, NULL);
    if (rc != code || strcmp(dpclip_errfield(c), field) != 0)
        fprintf(stderr, "want %d on %s, got %d on '%s': %s\n", code, field, rc, dpclip_errfield(c),
                dpclip_errmsg(c));
    assert_int_equal(rc, code);
    assert_string_equal(dpclip_errfield(c), field);
}

/* This step is rank `rank`'s member of the job's logical step `step` (0:
 * the rank's next) of `world` ranks charged at sigma `jsigma`. */
static void member(dc_shm_step *s, uint32_t world, uint32_t rank, float jsigma, uint64_t step) {
    assert_int_equal(dpclip_step_set_data_parallel(s->step, world, rank, jsigma, step), 0);
}

/* At most world - 1 noiseless releases per charged logical step, whatever
 * a rank sends: a rank running ahead charges each logical step it opens. */
static void test_shares_bounded_by_charges(void **state) {
    dpclip_client *c[3];
    dc_shm_step s[3];
    double eps = 0;
    int noiseless = 0;
    (void)state;
    for (int r = 0; r < 3; r++) {
        c[r] = connect_job("h-bound");
        step_on(&s[r], c[r], r == 0 ? 1.0f : 0.0f, 10 + (uint64_t)r);
        member(&s[r], 3, (uint32_t)r, 1.0f, 0);
    }
    for (int i = 1; i <= 10; i++) {
        double e1 = 0, e2 = 0;
        assert_int_equal(run(c[1], &s[1], &e1), 0); /* the first comes: it charges */
        assert_rel(e1, acct_eps(Q, 1.0, i), 1e-9);
        assert_int_equal(run(c[2], &s[2], &e2), 0);
        assert_int_equal(run(c[0], &s[0], &eps), 0);
        assert_true(e2 == e1 && eps == e1); /* covered */
        noiseless += 2;
    }
    /* rank 1 goes on alone: every logical step it opens is charged */
    for (int i = 11; i <= 30; i++) {
        assert_int_equal(run(c[1], &s[1], &eps), 0);
        assert_rel(eps, acct_eps(Q, 1.0, i), 1e-9);
        noiseless++;
    }
    assert_true(noiseless <= 2 * 30);
    /* rank 2 catches up on steps 11..30: shares of rank 1's charges */
    for (int i = 11; i <= 30; i++) {
        double e = 0;
        assert_int_equal(run(c[2], &s[2], &e), 0);
        assert_true(e == eps);
    }
    /* the last member of each must add the noise: a noiseless rank 0 is refused */
    terms(&s[0], 0.0f, Q, 0);
    member(&s[0], 3, 0, 1.0f, 0);
    refused(c[0], &s[0], DPCLIP_EPRECOND, "clip_step.noise_multiplier");
    for (int r = 0; r < 3; r++) {
        dc_shm_step_free(&s[r]);
        dpclip_disconnect(c[r]);
    }
}

/* A rank takes a logical step once: naming it again, from the same
 * session or a new one, is refused; Hello-only sessions change nothing. */
static void test_replay_refused(void **state) {
    dpclip_client *idle[20], *r0 = connect_job("h-replay"), *r1 = connect_job("h-replay");
    dc_shm_step s0, s1;
    double eps = 0, e1 = 0;
    (void)state;
    for (int i = 0; i < 20; i++) idle[i] = connect_job("h-replay");
    step_on(&s0, r0, 1.0f, 20);
    step_on(&s1, r1, 0.0f, 21);
    member(&s0, 2, 0, 1.0f, 5);
    member(&s1, 2, 1, 1.0f, 5);
    assert_int_equal(run(r0, &s0, &eps), 0);
    assert_int_equal(run(r1, &s1, &e1), 0);
    assert_true(e1 == eps);
    refused(r1, &s1, DPCLIP_EPRECOND, "clip_step.data_parallel.step");
    dc_shm_step_free(&s1);
    dpclip_disconnect(r1);
    r1 = connect_job("h-replay");
    step_on(&s1, r1, 0.0f, 22);
    member(&s1, 2, 1, 1.0f, 5);
    refused(r1, &s1, DPCLIP_EPRECOND, "clip_step.data_parallel.step");
    member(&s1, 2, 1, 1.0f, 3); /* an earlier one too */
    refused(r1, &s1, DPCLIP_EPRECOND, "clip_step.data_parallel.step");
    /* its next (6) is a new logical step: charged */
    member(&s1, 2, 1, 1.0f, 0);
    assert_int_equal(run(r1, &s1, &e1), 0);
    assert_rel(e1, acct_eps(Q, 1.0, 2), 1e-9);
    dc_shm_step_free(&s0);
    dc_shm_step_free(&s1);
    dpclip_disconnect(r0);
    dpclip_disconnect(r1);
    for (int i = 0; i < 20; i++) dpclip_disconnect(idle[i]);
}

/* The job's sigma is fixed: a backing step cannot declare another, a step
 * adding more noise is charged at the job's, less is refused; the world,
 * the ranks, and a logical step's terms are checked, each naming its field. */
static void test_terms_fixed(void **state) {
    dpclip_client *r0 = connect_job("h-sigma"), *r1 = connect_job("h-sigma");
    dc_shm_step s0, s1;
    double eps = 0, e1 = 0;
    int n = 0;
    (void)state;
    step_on(&s0, r0, 1.0f, 30);
    step_on(&s1, r1, 0.0f, 31);
    member(&s0, 2, 0, 1.0f, 0);
    member(&s1, 2, 1, 1.0f, 0);
    for (int i = 0; i < 5; i++, n++) {
        assert_int_equal(run(r0, &s0, &eps), 0);
        assert_int_equal(run(r1, &s1, &e1), 0);
    }
    assert_rel(eps, acct_eps(Q, 1.0, n), 1e-9);
    /* sigma 1e4 declared for the job: refused */
    terms(&s0, 1e4f, Q, 0);
    member(&s0, 2, 0, 1e4f, 0);
    refused(r0, &s0, DPCLIP_EPRECOND, "clip_step.data_parallel.noise_multiplier");
    /* sigma 1e4 added, the job's sigma declared: charged at the job's */
    member(&s0, 2, 0, 1.0f, 0);
    for (int i = 0; i < 50; i++, n++) {
        assert_int_equal(run(r0, &s0, &eps), 0);
        assert_int_equal(run(r1, &s1, &e1), 0);
        assert_true(e1 == eps);
    }
    assert_rel(eps, acct_eps(Q, 1.0, n), 1e-9);
    /* less noise than the job's: refused */
    terms(&s0, 0.5f, Q, 0);
    member(&s0, 2, 0, 1.0f, 0);
    refused(r0, &s0, DPCLIP_EINVAL, "clip_step.noise_multiplier");
    /* another world, a rank outside it */
    terms(&s0, 1.0f, Q, 0);
    member(&s0, 3, 0, 1.0f, 0);
    refused(r0, &s0, DPCLIP_EPRECOND, "clip_step.data_parallel.world");
    member(&s0, 2, 0, 1.0f, 0);
    assert_int_equal(run(r0, &s0, &eps), 0); /* opens step n + 1 */
    n++;
    /* a member of that step with another sample rate or another C */
    terms(&s1, 0.0f, 2 * Q, 0);
    member(&s1, 2, 1, 1.0f, 0);
    refused(r1, &s1, DPCLIP_EPRECOND, "clip_step.sample_rate");
    {
        dpclip_clip_config cfg = s1.cfg;
        cfg.sample_rate = Q;
        cfg.max_grad_norm = 100.0f;
        assert_int_equal(dc_shm_step_set_config(&s1, &cfg), 0);
        member(&s1, 2, 1, 1.0f, 0);
        refused(r1, &s1, DPCLIP_EPRECOND, "clip_step.clip.max_grad_norm");
        cfg.max_grad_norm = 1.0f;
        assert_int_equal(dc_shm_step_set_config(&s1, &cfg), 0);
        member(&s1, 2, 1, 1.0f, 0);
    }
    assert_int_equal(run(r1, &s1, &e1), 0);
    assert_true(e1 == eps);
    assert_rel(eps, acct_eps(Q, 1.0, n), 1e-9);
    dc_shm_step_free(&s0);
    dc_shm_step_free(&s1);
    dpclip_disconnect(r0);
    dpclip_disconnect(r1);
}

/* A logical step no longer open (past the window of open steps) is
 * charged again by a member that comes late: more than owed, never less. */
static void test_window(void **state) {
    dpclip_client *r0 = connect_job("h-window"), *r1 = connect_job("h-window");
    dc_shm_step s0, s1;
    double eps = 0, e1 = 0;
    const int N = 70; /* past the 64 steps a job keeps open */
    (void)state;
    step_on(&s0, r0, 1.0f, 40);
    step_on(&s1, r1, 0.0f, 41);
    member(&s0, 2, 0, 1.0f, 0);
    for (int i = 0; i < N; i++) assert_int_equal(run(r0, &s0, &eps), 0);
    assert_rel(eps, acct_eps(Q, 1.0, N), 1e-9);
    member(&s1, 2, 1, 1.0f, 1);
    assert_int_equal(run(r1, &s1, &e1), 0);
    assert_rel(e1, acct_eps(Q, 1.0, N + 1), 1e-9);
    member(&s1, 2, 1, 1.0f, (uint64_t)N); /* still open: a share */
    assert_int_equal(run(r1, &s1, &eps), 0);
    assert_true(eps == e1);
    dc_shm_step_free(&s0);
    dc_shm_step_free(&s1);
    dpclip_disconnect(r0);
    dpclip_disconnect(r1);
}

/* Across a restart: the job's world and sigma stay, and no logical step
 * taken before can be taken again; the ranks go on above the highest. */
static void test_restart(void **state) {
    dc_harness h;
    char dir[300];
    dpclip_client *r0, *r1;
    dc_shm_step s0, s1;
    double eps = 0, e1 = 0;
    (void)state;
    assert_int_equal(make_ledger_dir(dir, sizeof dir), 0);
    assert_int_equal(start_daemon(&h, dir), 0);
    r0 = connect_to(h.sock, "h-restart");
    r1 = connect_to(h.sock, "h-restart");
    step_on(&s0, r0, 1.0f, 50);
    step_on(&s1, r1, 0.0f, 51);
    member(&s0, 2, 0, 1.0f, 0);
    member(&s1, 2, 1, 1.0f, 0);
    for (int i = 0; i < 5; i++) assert_int_equal(run(r0, &s0, &eps), 0);
    for (int i = 0; i < 3; i++) assert_int_equal(run(r1, &s1, &e1), 0);
    assert_true(e1 == eps);
    dc_shm_step_free(&s0);
    dc_shm_step_free(&s1);
    dpclip_disconnect(r0);
    dpclip_disconnect(r1);
    assert_int_equal(dc_harness_stop(&h), 0);

    assert_int_equal(start_daemon(&h, dir), 0);
    r0 = connect_to(h.sock, "h-restart");
    r1 = connect_to(h.sock, "h-restart");
    step_on(&s0, r0, 1.0f, 52);
    step_on(&s1, r1, 0.0f, 53);
    /* steps 4 and 5 were rank 0's alone: rank 1 cannot take them now */
    member(&s1, 2, 1, 1.0f, 4);
    refused(r1, &s1, DPCLIP_EPRECOND, "clip_step.data_parallel.step");
    member(&s1, 2, 1, 1.0f, 5);
    refused(r1, &s1, DPCLIP_EPRECOND, "clip_step.data_parallel.step");
    member(&s1, 3, 1, 1.0f, 0);
    refused(r1, &s1, DPCLIP_EPRECOND, "clip_step.data_parallel.world");
    member(&s1, 2, 1, 2.0f, 0);
    refused(r1, &s1, DPCLIP_EPRECOND, "clip_step.data_parallel.noise_multiplier");
    /* its next is step 6: new, charged */
    member(&s1, 2, 1, 1.0f, 0);
    assert_int_equal(run(r1, &s1, &e1), 0);
    assert_rel(e1, acct_eps(Q, 1.0, 6), 1e-9);
    member(&s0, 2, 0, 1.0f, 0);
    assert_int_equal(run(r0, &s0, &eps), 0);
    assert_true(eps == e1);
    dc_shm_step_free(&s0);
    dc_shm_step_free(&s1);
    dpclip_disconnect(r0);
    dpclip_disconnect(r1);
    assert_int_equal(dc_harness_stop(&h), 0);
    {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        assert_int_equal(system(cmd), 0);
    }
}

/* A norm group's leader whose step is a data-parallel share paid nothing:
 * its group's member is not covered by it. */
static void test_group_leader_declared_share_covers_no_member(void **state) {
    dpclip_client *w = connect_job("h-gw2"), *x = connect_job("h-gw2"), *y = connect_job("h-gw2");
    dpclip_group_opts o = {.name = "h-gw2", .size = 2, .timeout_ms = 5000, .group_wise = 1};
    dc_shm_step sw, sx, sy;
    uint64_t gid;
    double ew = 0, ex = 0, ey = 0;
    (void)state;
    o.rank = 0;
    assert_int_equal(dpclip_join_group(x, &o, &gid), 0);
    o.rank = 1;
    assert_int_equal(dpclip_join_group(y, &o, &gid), 0);
    step_on(&sw, w, 1.0f, 60);
    step_on(&sx, x, 0.0f, 61);
    step_on(&sy, y, 0.0f, 62);
    member(&sw, 2, 0, 1.0f, 0);
    member(&sx, 2, 1, 1.0f, 0);
    assert_int_equal(run(w, &sw, &ew), 0);
    assert_int_equal(run(x, &sx, &ex), 0); /* a share of w's logical step */
    assert_true(ex == ew && isfinite(ex));
    assert_int_equal(run(y, &sy, &ey), 0);
    if (isfinite(ey)) fprintf(stderr, "the member was covered by a share: epsilon %g\n", ey);
    assert_true(isinf(ey)); /* charged itself, as no privacy */
    assert_int_equal(strncmp(dpclip_job_id(w), "h-gw2", 6), 0);
    dc_shm_step_free(&sw);
    dc_shm_step_free(&sx);
    dc_shm_step_free(&sy);
    dpclip_disconnect(w);
    dpclip_disconnect(x);
    dpclip_disconnect(y);
}

/* A handle without a job id names a fresh one, each its own; the
 * library checks a membership before it is sent. */
static void test_fresh_job_ids(void **state) {
    dpclip_client *a = connect_to(g_h.sock, NULL), *b = connect_to(g_h.sock, NULL);
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f, .reduction = DPCLIP_SUM};
    dpclip_step *st = dpclip_step_new(4, &cfg);
    (void)state;
    assert_non_null(st);
    assert_int_equal(dpclip_step_set_data_parallel(st, 1, 0, 1.0f, 0), DPCLIP_EARG);
    assert_int_equal(dpclip_step_set_data_parallel(st, 2, 2, 1.0f, 0), DPCLIP_EARG);
    assert_int_equal(dpclip_step_set_data_parallel(st, 2, 0, 0.0f, 0), DPCLIP_EARG);
    assert_int_equal(dpclip_step_set_data_parallel(st, 2, 0, NAN, 0), DPCLIP_EARG);
    assert_int_equal(dpclip_step_set_data_parallel(st, 2, 0, INFINITY, 0), DPCLIP_EARG);
    assert_int_equal(dpclip_step_set_data_parallel(st, 2, 0, 1.0f, UINT64_C(1) << 63), DPCLIP_EARG);
    assert_int_equal(dpclip_step_set_data_parallel(st, 2, 1, 1.0f, 7), 0);
    assert_int_equal(dpclip_step_set_data_parallel(st, 0, 0, 0.0f, 0), 0); /* off */
    assert_int_equal(dpclip_step_set_data_parallel(NULL, 2, 1, 1.0f, 0), DPCLIP_EARG);
    dpclip_step_free(st);
    assert_int_equal(strncmp(dpclip_job_id(a), "anon-", 5), 0);
    assert_int_equal(strlen(dpclip_job_id(a)), 21);
    assert_string_not_equal(dpclip_job_id(a), dpclip_job_id(b));
    dpclip_disconnect(a);
    dpclip_disconnect(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_charged_steps_back_no_other_session),
        cmocka_unit_test(test_hello_only_sessions_back_nothing),
        cmocka_unit_test(test_absurd_sigma_backs_no_undeclared_share),
        cmocka_unit_test(test_no_job_id_shares_no_account),
        cmocka_unit_test(test_group_leader_share_covers_no_member),
        cmocka_unit_test(test_shares_bounded_by_charges),
        cmocka_unit_test(test_replay_refused),
        cmocka_unit_test(test_terms_fixed),
        cmocka_unit_test(test_window),
        cmocka_unit_test(test_restart),
        cmocka_unit_test(test_group_leader_declared_share_covers_no_member),
        cmocka_unit_test(test_fresh_job_ids),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
