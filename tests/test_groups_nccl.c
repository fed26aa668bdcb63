/* Norm groups across daemons (daemon/protocol/nccl_link.c): two dpclipd processes
 * form one group through NCCL, and its members' results equal the whole
 * model's per-sample double-precision reference, as on one daemon; a
 * daemon killed mid-step fails the other's step within the group timeout
 * while the survivor goes on serving.
 *
 * Two layouts, by the CUDA devices this process sees:
 *  - two or more: each daemon serves a GPU of its own (CUDA_VISIBLE_DEVICES
 *    naming GPU k by its UUID), and each member's tensors are a copy of its
 *    shared buffer on its daemon's GPU, registered over CUDA IPC. No
 *    NCCL_HOSTID: NCCL sees two GPUs of one host and links them by
 *    P2P/NVLink. The daemons run f32 on the exact kernels
 *    (DPCLIP_CUDA_TF32=0) and results are held to the GPU's bounds.
 *  - one (or none): both daemons use the one GPU of the test machine, the
 *    members' tensors in host memory. NCCL refuses two ranks of a
 *    communicator on one GPU of one host, so each daemon gets its own
 *    NCCL_HOSTID: NCCL then takes them for two hosts and links them with its
 *    socket transport over loopback.
 * NCCL's bootstrap goes over loopback (NCCL_SOCKET_IFNAME=lo) and NVLink
 * multicast stays off (NCCL_NVLS_ENABLE=0), as in the shipped unit. Skipped
 * (77) where the daemon has no NCCL or no GPU. */
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

#ifdef DPCLIP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "dc_clock.h"
#include "gpu.h"
#include "group_test.h"
#include "harness.h"
#include "service.h"

#define B DC_GROUP_TEST_B
#define MAXM DC_GROUP_TEST_MAXM
/* The GPU's bounds against the double reference (test_cuda_kernels.c:
 * bf16/f16 layers' norms within 1e-3; test_cuda_ipc.c: a whole step's
 * outputs) */
#define GPU_NORM_RTOL 1e-3
#define GPU_OUT_RTOL 2e-3
#define GPU_OUT_ATOL 1e-5

static dc_harness g_d[2];                 /* daemon 0 and daemon 1 */
static int g_gpus;                        /* 1: the layout with a GPU per daemon */
static char g_gpu_id[2][DC_GPU_UUID_STR]; /* there, daemon k's CUDA_VISIBLE_DEVICES: GPU k's UUID */

/* A member's tensors on its daemon's GPU (the GPU layout; p is NULL in the
 * other). */
typedef struct gpu_copy {
    void *p;
    int device; /* this process's ordinal */
} gpu_copy;

/* 1 when this process sees two CUDA devices; g_gpu_id then names them. A
 * UUID names the same GPU to a daemon whatever this process's own
 * CUDA_VISIBLE_DEVICES or device order. */
static int find_gpus(void) {
#ifdef DPCLIP_HAVE_CUDA
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
        cudaGetLastError(); /* no GPU: the other layout, not an error */
        return 0;
    }
    for (int k = 0; k < 2; k++) {
        struct cudaDeviceProp p;
        cudaError_t e = cudaGetDeviceProperties(&p, k);
        if (e != cudaSuccess) {
            fprintf(stderr, "cudaGetDeviceProperties(%d): %s\n", k, cudaGetErrorString(e));
            return -1;
        }
        dc_gpu_uuid_str((const uint8_t *)p.uuid.bytes, g_gpu_id[k]); /* as the daemon prints it */
    }
    return 1;
#else
    return 0;
#endif
}

static int start_daemon(int k) {
    char host[32];
    if (g_gpus) {
        /* GPU k alone, its device 0; NCCL needs no fake host id for two
         * GPUs (these are inherited by the daemon started now) */
        unsetenv("NCCL_HOSTID");
        setenv("CUDA_VISIBLE_DEVICES", g_gpu_id[k], 1);
    } else {
        snprintf(host, sizeof host, "dpclip-test-host-%d", k);
        setenv("NCCL_HOSTID", host, 1); /* inherited by the daemon started now */
    }
    return dc_harness_start(&g_d[k], "--workers 2");
}

static int setup(void **state) {
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    char *saved = cvd ? strdup(cvd) : NULL;
    int rc = -1, found;
    (void)state;
    if (cvd && !saved) return -1;
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    if (!getenv("NCCL_SOCKET_IFNAME")) setenv("NCCL_SOCKET_IFNAME", "lo", 1);
    if ((found = find_gpus()) < 0) goto out;
    g_gpus = found;
    if (g_gpus) {
        setenv("DPCLIP_CUDA_TF32", "0", 1); /* exact f32 kernels: the reference's bounds */
        printf("layout: daemon 0 on %s, daemon 1 on %s (NCCL P2P), tensors on the GPUs\n",
               g_gpu_id[0], g_gpu_id[1]);
    } else {
        printf("layout: both daemons on one GPU, NCCL_HOSTID each (NCCL socket), host tensors\n");
    }
    if (start_daemon(0) || start_daemon(1)) goto out;
    rc = 0;
out:
    /* this process's CUDA read it at its start; only the daemons differ */
    if (saved) setenv("CUDA_VISIBLE_DEVICES", saved, 1);
    else unsetenv("CUDA_VISIBLE_DEVICES");
    free(saved);
    return rc;
}

static int teardown(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++)
        if (g_d[k].pid) dc_harness_stop(&g_d[k]);
    return 0;
}

/* In the GPU layout: a copy of st's shared buffer on `device`, registered
 * over CUDA IPC (by this process's ordinal, as a trainer's buffer is) and
 * named by st's wire step; the reference keeps reading the shared buffer.
 * Nothing in the other layout. 0, or -1 (said why). */
static int to_gpu(dc_shm_step *st, int device, gpu_copy *g) {
    g->p = NULL;
    g->device = device;
    if (!g_gpus) return 0;
#ifdef DPCLIP_HAVE_CUDA
    uint64_t id, off;
    cudaError_t e;
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaMalloc(&g->p, st->used)) != cudaSuccess ||
        (e = cudaMemcpy(g->p, st->base, st->used, cudaMemcpyHostToDevice)) != cudaSuccess ||
        (e = cudaDeviceSynchronize()) != cudaSuccess) { /* landed before the daemon reads */
        print_message("device %d: %s\n", device, cudaGetErrorString(e));
        goto fail;
    }
    if (dpclip_buffer_register_cuda(st->c, g->p, &id, &off)) {
        print_message("device %d: register: %s (%s)\n", device, dpclip_errmsg(st->c),
                      dpclip_errfield(st->c));
        goto fail;
    }
    if (off != 0 || dc_shm_step_wire_buffer(st, id)) goto fail;
    return 0;
fail:
    if (g->p) cudaFree(g->p);
    g->p = NULL;
#endif
    return -1;
}

/* The GPU copy back into the shared buffer, where the checks read the
 * outputs (the reply came after the daemon's writes finished). */
static int from_gpu(dc_shm_step *st, const gpu_copy *g) {
    if (!g->p) return 0;
#ifdef DPCLIP_HAVE_CUDA
    cudaError_t e;
    if ((e = cudaSetDevice(g->device)) != cudaSuccess ||
        (e = cudaMemcpy(st->base, g->p, st->used, cudaMemcpyDeviceToHost)) != cudaSuccess) {
        print_message("device %d: %s\n", g->device, cudaGetErrorString(e));
        return -1;
    }
#endif
    return 0;
}

/* After the member's session is gone (the daemon closed its handle). */
static void gpu_free(gpu_copy *g) {
#ifdef DPCLIP_HAVE_CUDA
    if (g->p && cudaSetDevice(g->device) == cudaSuccess) cudaFree(g->p);
#endif
    g->p = NULL;
}

/* dc_group_run, then each member's GPU copy home. */
static void run_group(dc_shm_step *st, int n, dpclip_result *res, int *rcs, const gpu_copy *g) {
    dc_group_run(st, n, res, rcs);
    for (int k = 0; k < n; k++) assert_int_equal(from_gpu(&st[k], &g[k]), 0);
}

/* dc_group_check; in the GPU layout at the GPU's bounds. */
static void check(dc_shm_step *st, int n, const dpclip_result *res, float C) {
    /* the GPU's clip phase bounds its error as TF32 (step.h dc_clip_e_how) */
    dc_group_e_how = g_gpus ? DC_E_GPU | DC_E_TF32 : 0u;
    if (g_gpus) dc_group_check_tol(st, n, res, C, GPU_NORM_RTOL, GPU_OUT_RTOL, GPU_OUT_ATOL);
    else dc_group_check(st, n, res, C);
}

/* Member k's daemon: the first half of n on daemon 0. Its GPU in the GPU
 * layout too. */
static int daemon_of(int k, int n) { return k < n / 2 ? 0 : 1; }

/* n members over the two daemons (daemon_of): rank 0 joins first and its
 * reply's NCCL id goes to the others, as a trainer's rendezvous would pass
 * it. */
static void join_all(const char *name, int n, uint32_t timeout_ms, dpclip_client **c) {
    dpclip_group_link link = {.daemons = 2, .daemon_rank = 0, .local_size = (uint32_t)n / 2};
    for (int k = 0; k < n; k++) {
        int d = daemon_of(k, n);
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
    for (int k = 0; k < 2 && g_gpus; k++) {
        /* a UUID the daemon's CUDA did not take would leave it without a
         * GPU, and this test skipped rather than failed */
        dpclip_daemon_info info;
        assert_int_equal(dpclip_connect(g_d[k].sock, &o, &c), 0);
        assert_int_equal(dpclip_daemon_info_get(c, &info), 0);
        if (!info.has_cuda)
            fail_msg("daemon %d has no GPU with CUDA_VISIBLE_DEVICES=%s", k, g_gpu_id[k]);
        dpclip_disconnect(c);
        c = NULL;
    }
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

/* A group's field in a daemon's /status (the group named `name`), or -1. */
static long long status_field(int d, const char *name, const char *field) {
    char sock[256], key[96];
    char *body = NULL;
    long long v = -1;
    dc_harness_status_path(&g_d[d], sock, sizeof sock);
    if (dc_http(sock, "GET", "/status", 10000, NULL, &body, NULL) != 200) goto out;
    snprintf(key, sizeof key, "\"name\":\"%s\"", name);
    const char *g = strstr(body, key);
    snprintf(key, sizeof key, "\"%s\":", field);
    const char *f = g ? strstr(g, key) : NULL;
    if (f) v = strtoll(f + strlen(key), NULL, 10);
out:
    free(body);
    return v;
}

/* A small transformer's layers over 2 members (one per daemon) and over 4
 * (two per daemon: the daemons sum their own members, then exchange).
 * With 2, at a steady pace: each daemon learns how long its member's norms
 * take to reach the exchange, and has the link's thread polling around
 * then (daemon.spin_us > 0, as here), so that exchanges find it awake:
 * /status counts those (not a timing test: one of the later steps' caught
 * is enough). */
static void test_pp_across_daemons(void **state) {
    (void)state;
    skip_without_nccl();
    for (int v = 0; v < 2; v++) {
        int n = v ? 4 : 2;
        char name[32];
        dc_test_rng r;
        dpclip_client *c[MAXM];
        dc_shm_step st[MAXM];
        gpu_copy gc[MAXM];
        dpclip_result res[MAXM];
        int rcs[MAXM];
        dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
        snprintf(name, sizeof name, "xpp%d", n);
        dc_test_rng_seed(&r, 900 + (uint64_t)v);
        join_all(name, n, 30000, c);
        for (int k = 0; k < n; k++) assert_int_equal(dc_shm_step_init(&st[k], c[k], 0, B, &cfg), 0);
        for (int l = 0; l < 6; l++)
            assert_true(dc_shm_step_add(&st[dc_group_pp_stage_of[v][l]], &dc_group_pp_model[l], &r,
                                        1.0f) >= 0);
        dc_group_set_c(st, n, dc_group_median(st, n), 0.0f); /* clips half */
        for (int k = 0; k < n; k++) assert_int_equal(to_gpu(&st[k], daemon_of(k, n), &gc[k]), 0);
        const int steps = v ? 3 : 12;
        for (int it = 0; it < steps; it++) { /* the first step waits for the link to form */
            run_group(st, n, res, rcs, gc);
            for (int k = 0; k < n; k++) {
                if (rcs[k]) print_message("member %d: %s\n", k, dpclip_errmsg(st[k].c));
                assert_int_equal(rcs[k], 0);
            }
            check(st, n, res, dc_group_median(st, n));
            /* every member everywhere clips by the same norms, to the bit */
            for (int k = 1; k < n; k++)
                assert_memory_equal(res[k].norms, res[0].norms, B * sizeof *res[0].norms);
            for (int k = 0; k < n; k++) dpclip_result_free(&res[k]);
        }
        long long polled = 0;
        for (int d = 0; d < 2 && v == 0; d++) {
            long long x = status_field(d, name, "exchanges"),
                      p = status_field(d, name, "exchanges_polled");
            print_message("daemon %d: %lld exchanges, %lld found the link polling\n", d, x, p);
            assert_true(x == steps); /* every step's, the first (the link forming) included */
            assert_true(p >= 0 && p <= x);
            polled += p;
        }
        assert_true(v != 0 || polled >= 1);
        for (int k = 0; k < n; k++) {
            dc_shm_step_free(&st[k]);
            dpclip_disconnect(c[k]);
            gpu_free(&gc[k]);
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
    gpu_copy gc[2];
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
        /* before the mark: naming the GPU copy rebuilds the wire step */
        assert_int_equal(to_gpu(&st[k], k, &gc[k]), 0);
        assert_int_equal(dpclip_step_set_replicated(st[k].step, 0, 1), 0);
    }
    for (int it = 0; it < 2; it++) {
        run_group(st, 2, res, rcs, gc);
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
        gpu_free(&gc[k]);
    }
    dc_test_layer_free(&ln);
}

/* Two members, one on each daemon, joined as `name`; their steps (one
 * layer each) on their daemons' GPUs where the layout has them. */
static void pair_open(const char *name, uint32_t timeout_ms, dc_test_rng *r, dpclip_client **c,
                      dc_shm_step *st, gpu_copy *gc) {
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 3, 8, 6, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    join_all(name, 2, timeout_ms, c);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(dc_shm_step_init(&st[k], c[k], 0, B, &cfg), 0);
        assert_true(dc_shm_step_add(&st[k], &sp, r, 1.0f) >= 0);
        assert_int_equal(to_gpu(&st[k], k, &gc[k]), 0);
    }
}

static void pair_step_ok(dc_shm_step *st, const gpu_copy *gc) {
    dpclip_result res[2];
    int rcs[2];
    run_group(st, 2, res, rcs, gc);
    for (int k = 0; k < 2; k++) {
        if (rcs[k]) print_message("member %d: %s\n", k, dpclip_errmsg(st[k].c));
        assert_int_equal(rcs[k], 0);
        dpclip_result_free(&res[k]);
    }
}

static void pair_close(dpclip_client **c, dc_shm_step *st, gpu_copy *gc) {
    for (int k = 0; k < 2; k++) {
        dc_shm_step_free(&st[k]);
        if (c[k]) dpclip_disconnect(c[k]);
        gpu_free(&gc[k]);
    }
}

/* A trainer gone mid-step (its socket closed, as when its process is
 * killed) while the other daemon's member waits in the group step: that
 * step fails within the group's timeout, both daemons serve on, and the
 * trainers rejoin as a new group and train on. */
static void test_peer_member_gone(void **state) {
    (void)state;
    dc_test_rng r;
    dpclip_client *c[2], *c2[2];
    dc_shm_step st[2], st2[2];
    gpu_copy gc[2], gc2[2];
    dpclip_result res;
    uint64_t ticket, t0;
    const uint32_t timeout_ms = 4000;
    skip_without_nccl();
    dc_test_rng_seed(&r, 940);
    pair_open("xgone", timeout_ms, &r, c, st, gc);
    pair_step_ok(st, gc); /* the link works */

    t0 = dc_clock_ms();
    assert_int_equal(dpclip_submit(st[0].c, st[0].step, &ticket), 0);
    struct timespec ts = {0, 200 * 1000000L};
    nanosleep(&ts, NULL); /* the step is in the exchange, waiting for member 1 */
    dpclip_disconnect(c[1]);
    c[1] = st[1].c = NULL;
    int rc = dpclip_wait(st[0].c, ticket, 60000, &res);
    uint64_t took = dc_clock_ms() - t0;
    print_message("member gone: %d after %llu ms: %s\n", rc, (unsigned long long)took,
                  dpclip_errmsg(st[0].c));
    assert_int_not_equal(rc, 0);
    assert_true(took < timeout_ms + 10000);
    assert_int_equal(dpclip_ping(st[0].c), 0);

    pair_open("xgone-again", timeout_ms, &r, c2, st2, gc2);
    for (int it = 0; it < 2; it++) pair_step_ok(st2, gc2);
    pair_close(c2, st2, gc2);
    pair_close(c, st, gc);
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
    gpu_copy gc[2], ga;
    dpclip_result res[2];
    int rcs[2];
    const uint32_t timeout_ms = 4000;
    skip_without_nccl();
    dc_test_rng_seed(&r, 950);
    join_all("xkill", 2, timeout_ms, c);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(dc_shm_step_init(&st[k], c[k], 0, B, &cfg), 0);
        assert_true(dc_shm_step_add(&st[k], &sp, &r, 1.0f) >= 0);
        assert_int_equal(to_gpu(&st[k], k, &gc[k]), 0);
    }
    run_group(st, 2, res, rcs, gc); /* the link works */
    assert_int_equal(rcs[0], 0);
    assert_int_equal(rcs[1], 0);
    for (int k = 0; k < 2; k++) dpclip_result_free(&res[k]);

    uint64_t ticket, t0 = dc_clock_ms();
    assert_int_equal(dpclip_submit(st[0].c, st[0].step, &ticket), 0);
    struct timespec ts = {0, 200 * 1000000L};
    nanosleep(&ts, NULL); /* the step is in the exchange, waiting for daemon 1 */
    assert_int_equal(kill(g_d[1].pid, SIGKILL), 0);
    int rc = dpclip_wait(st[0].c, ticket, 60000, &res[0]);
    uint64_t took = dc_clock_ms() - t0;
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
    assert_int_equal(to_gpu(&alone, 0, &ga), 0); /* its GPU too, past the abort */
    assert_int_equal(dpclip_run(fresh, alone.step, &one), 0);
    dpclip_result_free(&one);
    dc_shm_step_free(&alone);
    dpclip_disconnect(fresh);
    gpu_free(&ga);
    for (int k = 0; k < 2; k++) {
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c[k]);
        gpu_free(&gc[k]);
    }
}

int main(void) {
    /* groups across daemons always run in phases */
    dc_group_phased = 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pp_across_daemons),
        cmocka_unit_test(test_replicated_across_daemons),
        cmocka_unit_test(test_peer_member_gone),
        cmocka_unit_test(test_peer_daemon_killed),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
