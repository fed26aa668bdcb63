/* Norm groups across daemons (daemon/protocol/nccl_link.c): two dpclipd processes
 * form one group through NCCL, and its members' results equal the whole
 * model's per-sample double-precision reference, as on one daemon; a
 * daemon killed mid-step fails the other's step within the group timeout
 * while the survivor goes on serving.
 *
 * Test setting: both daemons use the one GPU of the test machine. NCCL
 * refuses two ranks of a communicator on one GPU of one host, so each
 * daemon gets its own NCCL_HOSTID: NCCL then takes them for two hosts and
 * links them with its socket transport over loopback (NCCL_SOCKET_IFNAME=lo).
 * NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as in the shipped unit.
 * Skipped (77) where the daemon has no NCCL or no GPU. */
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "group_test.h"
#include "harness.h"

#define B DC_GROUP_TEST_B
#define MAXM DC_GROUP_TEST_MAXM

static dc_harness g_d[2]; /* daemon 0 and daemon 1 */

static int start_daemon(int k) {
    char host[32];
    snprintf(host, sizeof host, "dpclip-test-host-%d", k);
    setenv("NCCL_HOSTID", host, 1); /* inherited by the daemon started now */
    return dc_harness_start(&g_d[k], "--workers 2");
}

static int setup(void **state) {
    (void)state;
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    if (!getenv("NCCL_SOCKET_IFNAME")) setenv("NCCL_SOCKET_IFNAME", "lo", 1);
    return start_daemon(0) || start_daemon(1) ? -1 : 0;
}

static int teardown(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++)
        if (g_d[k].pid) dc_harness_stop(&g_d[k]);
    return 0;
}

/* n members over the two daemons, the first half on daemon 0: rank 0 joins
 * first and its reply's NCCL id goes to the others, as a trainer's
 * rendezvous would pass it. */
static void join_all(const char *name, int n, uint32_t timeout_ms, dpclip_client **c) {
    dpclip_group_link link = {.daemons = 2, .daemon_rank = 0, .local_size = (uint32_t)n / 2};
    for (int k = 0; k < n; k++) {
        int d = k < n / 2 ? 0 : 1;
        link.daemon_rank = (uint32_t)d;
        link.local_size = d == 0 ? (uint32_t)n / 2 : (uint32_t)(n - n / 2);
        c[k] = dc_group_member(g_d[d].sock, name, (uint32_t)k, (uint32_t)n, timeout_ms, 0,
                               "nccl-job", &link);
        assert_true(link.nccl_version > 0); /* rank 0's reply filled it */
    }
}

/* Skips the whole test program where cross-daemon groups cannot be. */
static void skip_without_nccl(void) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "nccl-probe"};
    /* two of three members here: the link would open only once both are */
    dpclip_group_opts g = {"probe", 0, 3, 0, 0};
    dpclip_group_link link = {.daemons = 2, .daemon_rank = 0, .local_size = 2};
    assert_int_equal(dpclip_connect(g_d[0].sock, &o, &c), 0);
    int rc = dpclip_join_group_linked(c, &g, &link, NULL);
    if (rc == DPCLIP_EUNIMPL) {
        printf("skipped: %s\n", dpclip_errmsg(c));
        dpclip_disconnect(c);
        teardown(NULL);
        exit(DC_TEST_SKIP);
    }
    assert_int_equal(rc, 0);
    dpclip_disconnect(c); /* dissolves the probe group */
}

/* A small transformer's layers over 2 members (one per daemon) and over 4
 * (two per daemon: the daemons sum their own members, then exchange). */
static void test_pp_across_daemons(void **state) {
    (void)state;
    skip_without_nccl();
    for (int v = 0; v < 2; v++) {
        int n = v ? 4 : 2;
        char name[32];
        dc_test_rng r;
        dpclip_client *c[MAXM];
        dc_shm_step st[MAXM];
        dpclip_result res[MAXM];
        int rcs[MAXM];
        dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
        snprintf(name, sizeof name, "xpp%d", n);
        dc_test_rng_seed(&r, 900 + (uint64_t)v);
        join_all(name, n, 30000, c);
        for (int k = 0; k < n; k++) assert_int_equal(dc_shm_step_init(&st[k], c[k], 0, B, &cfg), 0);
        for (int l = 0; l < 6; l++)
            assert_true(dc_shm_step_add(&st[dc_group_pp_stage_of[v][l]], &dc_group_pp_model[l], &r, 1.0f) >= 0);
        dc_group_set_c(st, n, dc_group_median(st, n), 0.0f); /* clips half */
        for (int it = 0; it < 3; it++) { /* the first step waits for the link to form */
            dc_group_run(st, n, res, rcs);
            for (int k = 0; k < n; k++) {
                if (rcs[k]) print_message("member %d: %s\n", k, dpclip_errmsg(st[k].c));
                assert_int_equal(rcs[k], 0);
            }
            dc_group_check(st, n, res, dc_group_median(st, n));
            /* every member everywhere clips by the same norms, to the bit */
            for (int k = 1; k < n; k++)
                assert_memory_equal(res[k].norms, res[0].norms, B * sizeof *res[0].norms);
            for (int k = 0; k < n; k++) dpclip_result_free(&res[k]);
        }
        for (int k = 0; k < n; k++) {
            dc_shm_step_free(&st[k]);
            dpclip_disconnect(c[k]);
        }
    }
}

/* A LayerNorm both members hold whole, one member per daemon, with noise:
 * its noised gradient is bitwise the same on both (the daemons use daemon
 * 0's group noise key, which only the daemons exchange), while the split
 * Linear's noise is each member's own. The daemons' own group ids differ
 * (the probe formed a group on daemon 0 only), so their own keys would. */
static void test_replicated_across_daemons(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_layer_spec lsp = {DC_LAYER_LINEAR, B, 3, 8, 6, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec nsp = {DC_LAYER_LAYERNORM, B, 3, 8, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.5f);
    dpclip_client *c[2];
    dc_shm_step st[2];
    dpclip_result res[2];
    int rcs[2];
    dc_layer ln; /* the replicated LayerNorm: the same tensors and name on both */
    skip_without_nccl();
    dc_test_rng_seed(&r, 970);
    dc_test_layer_make(&ln, &nsp, &r);
    snprintf(ln.name, sizeof ln.name, "ln");
    ln.replicated = true;
    join_all("xrep", 2, 30000, c);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(dc_shm_step_init(&st[k], c[k], 0, B, &cfg), 0);
        assert_true(dc_shm_step_add_layer(&st[k], &ln) >= 0);
        assert_true(dc_shm_step_add(&st[k], &lsp, &r, 1.0f) >= 0);
        assert_int_equal(dpclip_step_set_replicated(st[k].step, 0, 1), 0);
    }
    for (int it = 0; it < 2; it++) {
        dc_group_run(st, 2, res, rcs);
        for (int k = 0; k < 2; k++) {
            if (rcs[k]) print_message("member %d: %s\n", k, dpclip_errmsg(st[k].c));
            assert_int_equal(rcs[k], 0);
            dpclip_result_free(&res[k]);
        }
        const dc_layer *a = &st[0].ref.layers[0], *b = &st[1].ref.layers[0];
        assert_memory_equal(a->weight_grad_out.data, b->weight_grad_out.data, 8 * sizeof(float));
        assert_memory_equal(a->bias_grad_out.data, b->bias_grad_out.data, 8 * sizeof(float));
        assert_true(memcmp(st[0].ref.layers[1].weight_grad_out.data,
                           st[1].ref.layers[1].weight_grad_out.data, 6 * 8 * sizeof(float)) != 0);
    }
    for (int k = 0; k < 2; k++) {
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c[k]);
    }
    dc_test_layer_free(&ln);
}

/* kill -9 of daemon 1 while daemon 0's member waits in a group step: that
 * step fails within the group's timeout with an error naming the other
 * daemon, and daemon 0 keeps serving (a new session's step runs). */
static void test_peer_daemon_killed(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 3, 8, 6, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    dpclip_client *c[2];
    dc_shm_step st[2];
    dpclip_result res[2];
    int rcs[2];
    const uint32_t timeout_ms = 4000;
    skip_without_nccl();
    dc_test_rng_seed(&r, 950);
    join_all("xkill", 2, timeout_ms, c);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(dc_shm_step_init(&st[k], c[k], 0, B, &cfg), 0);
        assert_true(dc_shm_step_add(&st[k], &sp, &r, 1.0f) >= 0);
    }
    dc_group_run(st, 2, res, rcs); /* the link works */
    assert_int_equal(rcs[0], 0);
    assert_int_equal(rcs[1], 0);
    for (int k = 0; k < 2; k++) dpclip_result_free(&res[k]);

    uint64_t ticket, t0 = dc_ms_now();
    assert_int_equal(dpclip_submit(st[0].c, st[0].step, &ticket), 0);
    struct timespec ts = {0, 200 * 1000000L};
    nanosleep(&ts, NULL); /* the step is in the exchange, waiting for daemon 1 */
    assert_int_equal(kill(g_d[1].pid, SIGKILL), 0);
    int rc = dpclip_wait(st[0].c, ticket, 60000, &res[0]);
    uint64_t took = dc_ms_now() - t0;
    print_message("peer killed: %d after %llu ms: %s\n", rc, (unsigned long long)took,
                  dpclip_errmsg(st[0].c));
    assert_int_equal(rc, DPCLIP_EUNAVAIL);
    assert_non_null(strstr(dpclip_errmsg(st[0].c), "cross-daemon"));
    assert_true(took < timeout_ms + 10000);
    dc_harness_stop(&g_d[1]); /* reaps it; it died from the signal */
    memset(&g_d[1], 0, sizeof g_d[1]);

    /* daemon 0 serves on: this session (its group is gone) and a new one */
    assert_int_equal(dpclip_ping(st[0].c), 0);
    assert_int_equal(dpclip_run(st[0].c, st[0].step, &res[0]), DPCLIP_EUNAVAIL);
    assert_non_null(strstr(dpclip_errmsg(st[0].c), "join again"));
    dpclip_client *fresh = NULL;
    dpclip_connect_opts o = {.client_name = "after-kill"};
    dc_shm_step alone;
    dpclip_result one;
    assert_int_equal(dpclip_connect(g_d[0].sock, &o, &fresh), 0);
    assert_int_equal(dc_shm_step_init(&alone, fresh, 0, B, &cfg), 0);
    assert_true(dc_shm_step_add(&alone, &sp, &r, 1.0f) >= 0);
    assert_int_equal(dpclip_run(fresh, alone.step, &one), 0);
    dpclip_result_free(&one);
    dc_shm_step_free(&alone);
    dpclip_disconnect(fresh);
    for (int k = 0; k < 2; k++) {
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c[k]);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pp_across_daemons),
        cmocka_unit_test(test_replicated_across_daemons),
        cmocka_unit_test(test_peer_daemon_killed),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
