/* dpclipd + libdpclip end to end: every layer kind and dtype against the
 * double-precision reference, loss reductions, per-layer clipping, the
 * optional outputs, the noise's size, many concurrent clients, and the
 * example trainer. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"

static dc_harness g_h;

static int group_setup(void **state) {
    (void)state;
    return dc_harness_start(&g_h, "--workers 2");
}

static int group_teardown(void **state) {
    (void)state;
    /* normally stopped (and checked) by test_clean_shutdown; this only
     * cleans up after a failure */
    if (g_h.pid) dc_harness_stop(&g_h);
    return 0;
}

static dpclip_client *connect_ok(const char *name) {
    return dc_harness_connect(&g_h, name, "integration");
}

static dpclip_clip_config cfg_of(dpclip_reduction red, uint32_t expected, float sigma,
                                 dpclip_clip_mode mode) {
    dpclip_clip_config c = {.max_grad_norm = 1.0f,
                            .reduction = red,
                            .expected_batch_size = expected,
                            .noise_multiplier = sigma,
                            .mode = mode};
    return c;
}

/* Sets C to the reference median norm so that about half the batch is
 * clipped and half is not. */
static void clip_at_median(dc_shm_step *s) {
    dpclip_clip_config cfg = s->cfg;
    cfg.max_grad_norm = (float)dc_shm_step_median_norm(s);
    assert_true(cfg.max_grad_norm > 0.0f);
    assert_int_equal(dc_shm_step_set_config(s, &cfg), 0);
}

static void run_and_check(dpclip_client *c, dc_shm_step *s, double rtol) {
    dpclip_result res;
    int rc = dpclip_run(c, s->step, &res);
    if (rc) fprintf(stderr, "run: %s (%s)\n", dpclip_errmsg(c), dpclip_errfield(c));
    assert_int_equal(rc, 0);
    assert_int_equal(res.n_layers, s->ref.n_layers);
    double e = dc_shm_step_check(s, &res, rtol, 1e-7);
    assert_true(e <= 1.0);
    dpclip_result_free(&res);
}

/* --- every layer kind, f32 and bf16 --------------------------------------- */

#define B_KINDS 10

static const dc_test_layer_spec k_specs[] = {
    /* linear: 2D and 3D, with and without bias, each algorithm */
    {DC_LAYER_LINEAR, B_KINDS, 0, 16, 12, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LINEAR, B_KINDS, 6, 10, 7, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LINEAR, B_KINDS, 9, 5, 6, DC_F32, 0, DC_ALGO_DIRECT, 1, 0},
    {DC_LAYER_LINEAR, B_KINDS, 4, 12, 9, DC_F32, 1, DC_ALGO_GHOST, 1, 0},
    {DC_LAYER_LINEAR, B_KINDS, 0, 7, 3, DC_F32, 0, DC_ALGO_AUTO, 0, 0}, /* no outputs */
    /* embedding: 1D and 2D indices, repeated and distinct tokens */
    {DC_LAYER_EMBEDDING, B_KINDS, 0, 8, 20, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_EMBEDDING, B_KINDS, 7, 6, 15, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_EMBEDDING, B_KINDS, 5, 4, 30, DC_F32, 0, DC_ALGO_AUTO, 1, 1},
    /* layer norm with and without bias, rms norm; 2D and 3D */
    {DC_LAYER_LAYERNORM, B_KINDS, 5, 12, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LAYERNORM, B_KINDS, 0, 9, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_RMSNORM, B_KINDS, 4, 10, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_RMSNORM, B_KINDS, 0, 11, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
};
#define N_SPECS (sizeof k_specs / sizeof k_specs[0])

static void kinds_for(dc_dtype dt, uint64_t seed) {
    dpclip_client *c = connect_ok("kinds");
    dc_test_rng r;
    dpclip_clip_config cfg = cfg_of(DPCLIP_SUM, 0, 0.0f, DPCLIP_FLAT);
    dc_shm_step all;

    dc_test_rng_seed(&r, seed);
    /* each layer alone */
    for (size_t i = 0; i < N_SPECS; i++) {
        dc_shm_step s;
        dc_test_layer_spec sp = k_specs[i];
        sp.dtype = dt;
        assert_int_equal(dc_shm_step_init(&s, c, 1u << 20, B_KINDS, &cfg), 0);
        assert_int_equal(dc_shm_step_add(&s, &sp, &r, 1.0f), 0);
        clip_at_median(&s);
        run_and_check(c, &s, dc_test_rtol(dt));
        dc_shm_step_free(&s);
    }
    /* all of them in one step, twice with fresh data */
    assert_int_equal(dc_shm_step_init(&all, c, 4u << 20, B_KINDS, &cfg), 0);
    for (size_t i = 0; i < N_SPECS; i++) {
        dc_test_layer_spec sp = k_specs[i];
        sp.dtype = dt;
        assert_int_equal(dc_shm_step_add(&all, &sp, &r, 1.0f), (int)i);
    }
    clip_at_median(&all);
    run_and_check(c, &all, dc_test_rtol(dt));
    dc_shm_step_refill(&all, &r);
    run_and_check(c, &all, dc_test_rtol(dt));
    dc_shm_step_free(&all);
    dpclip_disconnect(c);
}

static void test_kinds_f32(void **state) {
    (void)state;
    kinds_for(DC_F32, 101);
}

static void test_kinds_bf16(void **state) {
    (void)state;
    kinds_for(DC_BF16, 202);
}

static void test_kinds_f16(void **state) {
    (void)state;
    kinds_for(DC_F16, 303);
}

/* --- loss reduction ------------------------------------------------------- */

static void add_mixed(dc_shm_step *s, uint32_t B, dc_test_rng *r) {
    dc_test_layer_spec lin = {DC_LAYER_LINEAR, B, 5, 12, 8, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec emb = {DC_LAYER_EMBEDDING, B, 6, 8, 25, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec ln = {DC_LAYER_LAYERNORM, B, 5, 12, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec rms = {DC_LAYER_RMSNORM, B, 5, 8, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    assert_true(dc_shm_step_add(s, &lin, r, 1.0f) >= 0);
    assert_true(dc_shm_step_add(s, &emb, r, 1.0f) >= 0);
    assert_true(dc_shm_step_add(s, &ln, r, 1.0f) >= 0);
    assert_true(dc_shm_step_add(s, &rms, r, 1.0f) >= 0);
}

static void test_mean_vs_sum(void **state) {
    (void)state;
    const uint32_t B = 12;
    dpclip_client *c = connect_ok("reduction");
    dpclip_clip_config sum = cfg_of(DPCLIP_SUM, 0, 0.0f, DPCLIP_FLAT);
    dpclip_clip_config mean = cfg_of(DPCLIP_MEAN, B + 6, 0.0f, DPCLIP_FLAT);
    dpclip_result rs, rm;
    dc_test_rng r;
    dc_shm_step s;

    dc_test_rng_seed(&r, 7);
    assert_int_equal(dc_shm_step_init(&s, c, 1u << 20, B, &sum), 0);
    add_mixed(&s, B, &r);
    clip_at_median(&s);
    assert_int_equal(dpclip_run(c, s.step, &rs), 0);
    assert_true(dc_shm_step_check(&s, &rs, dc_test_rtol(DC_F32), 1e-7) <= 1.0);

    /* Same data read as mean-loss gradients: per-sample norms are B times
     * larger, and the clipped sum is divided by expected_batch_size. */
    mean.max_grad_norm = s.cfg.max_grad_norm * (float)B;
    assert_int_equal(dc_shm_step_set_config(&s, &mean), 0);
    assert_int_equal(dpclip_run(c, s.step, &rm), 0);
    assert_true(dc_shm_step_check(&s, &rm, dc_test_rtol(DC_F32), 1e-7) <= 1.0);
    for (uint32_t b = 0; b < B; b++) {
        assert_float_equal(rm.norms[b], rs.norms[b] * (float)B, 1e-4 * rm.norms[b]);
        assert_float_equal(rm.coefs[b], rs.coefs[b], 1e-5);
    }
    /* expected_batch_size 0 means the batch size */
    mean.expected_batch_size = 0;
    assert_int_equal(dc_shm_step_set_config(&s, &mean), 0);
    run_and_check(c, &s, dc_test_rtol(DC_F32));
    dpclip_result_free(&rs);
    dpclip_result_free(&rm);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* --- per-layer clipping ------------------------------------------------------ */

static void test_per_layer(void **state) {
    (void)state;
    const uint32_t B = 16;
    dpclip_client *c = connect_ok("per_layer");
    dpclip_clip_config cfg = cfg_of(DPCLIP_SUM, 0, 0.0f, DPCLIP_PER_LAYER);
    dpclip_result res;
    dc_test_rng r;
    dc_shm_step s;
    int clipped = 0, unclipped = 0;

    dc_test_rng_seed(&r, 8);
    assert_int_equal(dc_shm_step_init(&s, c, 1u << 20, B, &cfg), 0);
    add_mixed(&s, B, &r);
    /* each layer's threshold at the median of its own norms */
    dc_shm_step_median_norm(&s); /* fills s.layer_sq */
    for (size_t l = 0; l < s.ref.n_layers; l++) {
        double v[16];
        for (uint32_t b = 0; b < B; b++) v[b] = sqrt(s.layer_sq[l * B + b]);
        for (uint32_t i = 1; i < B; i++) /* insertion sort, 16 values */
            for (uint32_t j = i; j > 0 && v[j - 1] > v[j]; j--) {
                double t = v[j];
                v[j] = v[j - 1];
                v[j - 1] = t;
            }
        s.ref.layers[l].max_grad_norm = (float)(0.5 * (v[B / 2 - 1] + v[B / 2]));
    }
    assert_int_equal(dc_shm_step_set_config(&s, &cfg), 0);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    assert_non_null(res.layer_norms);
    assert_non_null(res.layer_coefs);
    assert_true(dc_shm_step_check(&s, &res, dc_test_rtol(DC_F32), 1e-7) <= 1.0);
    for (size_t i = 0; i < s.ref.n_layers * B; i++) {
        if (res.layer_coefs[i] < 0.999f) clipped++;
        else unclipped++;
    }
    assert_true(clipped > 0 && unclipped > 0);
    for (uint32_t b = 0; b < B; b++) assert_float_equal(res.coefs[b], 1.0f, 0.0f);
    dpclip_result_free(&res);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* --- norms_out / coefs_out / layer norms -------------------------------------- */

static void test_outputs(void **state) {
    (void)state;
    const uint32_t B = 9;
    dpclip_client *c = connect_ok("outputs");
    dpclip_clip_config cfg = cfg_of(DPCLIP_MEAN, 0, 0.0f, DPCLIP_FLAT);
    dpclip_result res;
    dc_test_rng r;
    dc_shm_step s;

    dc_test_rng_seed(&r, 9);
    assert_int_equal(dc_shm_step_init(&s, c, 1u << 20, B, &cfg), 0);
    add_mixed(&s, B, &r);
    assert_int_equal(dc_shm_step_add_outputs(&s, 1, 1), 0);
    dc_shm_step_want_layer_norms(&s, 1);
    clip_at_median(&s);
    dc_shm_step_fill_outputs(&s, -777.0f);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    assert_non_null(res.layer_norms);
    assert_null(res.layer_coefs);
    assert_true(dc_shm_step_check(&s, &res, dc_test_rtol(DC_F32), 1e-7) <= 1.0);
    /* what the daemon wrote equals what it replied */
    for (uint32_t b = 0; b < B; b++) {
        assert_float_equal(((float *)s.ref.norms_out.data)[b], res.norms[b], 0.0f);
        assert_float_equal(((float *)s.ref.coefs_out.data)[b], res.coefs[b], 0.0f);
    }
    dpclip_result_free(&res);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* --- noise -------------------------------------------------------------------- */

static void noise_case(dpclip_client *c, dpclip_reduction red, uint32_t expected, float sigma) {
    const uint32_t B = 8;
    dc_test_layer_spec big = {DC_LAYER_LINEAR, B, 3, 48, 64, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec ln = {DC_LAYER_LAYERNORM, B, 3, 64, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = cfg_of(red, expected, 0.0f, DPCLIP_FLAT);
    dpclip_result r0, r1, r2;
    dc_test_rng r;
    dc_shm_step s;
    float *o0, *o1, *o2;
    int64_t n;
    double mean = 0.0, var = 0.0, want, C;
    int64_t same = 0, differ12 = 0;

    dc_test_rng_seed(&r, 11 + (uint64_t)red);
    assert_int_equal(dc_shm_step_init(&s, c, 1u << 20, B, &cfg), 0);
    assert_true(dc_shm_step_add(&s, &big, &r, 1.0f) >= 0);
    assert_true(dc_shm_step_add(&s, &ln, &r, 1.0f) >= 0);
    clip_at_median(&s);
    n = dc_shm_step_outputs(&s, NULL);
    o0 = malloc((size_t)n * sizeof *o0);
    o1 = malloc((size_t)n * sizeof *o1);
    o2 = malloc((size_t)n * sizeof *o2);
    assert_true(o0 && o1 && o2);

    /* sigma = 0: exact */
    assert_int_equal(dpclip_run(c, s.step, &r0), 0);
    assert_true(dc_shm_step_check(&s, &r0, dc_test_rtol(DC_F32), 1e-7) <= 1.0);
    dc_shm_step_outputs(&s, o0);

    cfg = s.cfg;
    cfg.noise_multiplier = sigma;
    C = cfg.max_grad_norm;
    assert_int_equal(dc_shm_step_set_config(&s, &cfg), 0);
    assert_int_equal(dpclip_run(c, s.step, &r1), 0);
    dc_shm_step_outputs(&s, o1);
    assert_int_equal(dpclip_run(c, s.step, &r2), 0);
    dc_shm_step_outputs(&s, o2);

    /* norms and coefficients do not depend on the noise */
    for (uint32_t b = 0; b < B; b++) {
        assert_float_equal(r1.norms[b], r0.norms[b], 0.0f);
        assert_float_equal(r1.coefs[b], r0.coefs[b], 0.0f);
    }
    for (int64_t i = 0; i < n; i++) {
        double d = (double)o1[i] - o0[i];
        mean += d;
        var += d * d;
        if (o1[i] == o0[i]) same++;
        if (o2[i] != o1[i]) differ12++;
    }
    mean /= (double)n;
    var = var / (double)n - mean * mean;
    want = sigma * C / (red == DPCLIP_MEAN ? (expected ? expected : B) : 1);
    fprintf(stderr, "noise: %lld values, std %.6g, expected %.6g, mean %.3g\n", (long long)n,
            sqrt(var), want, mean);
    /* n ~ 3300: the sample std is within a few percent of the truth; the
     * bounds are loose on purpose */
    assert_true(sqrt(var) > 0.85 * want && sqrt(var) < 1.15 * want);
    assert_true(fabs(mean) < 6.0 * want / sqrt((double)n));
    assert_true(same < n / 100);
    assert_true(differ12 > n - n / 100); /* every step draws fresh noise */
    dpclip_result_free(&r0);
    dpclip_result_free(&r1);
    dpclip_result_free(&r2);
    free(o0);
    free(o1);
    free(o2);
    dc_shm_step_free(&s);
}

static void test_noise(void **state) {
    (void)state;
    dpclip_client *c = connect_ok("noise");
    noise_case(c, DPCLIP_SUM, 0, 1.3f);
    noise_case(c, DPCLIP_MEAN, 32, 0.7f);
    dpclip_disconnect(c);
}

/* --- concurrent clients ---------------------------------------------------------- */

#define N_CLIENTS 8
#define N_STEPS 200

typedef struct worker {
    int id;
    int steps_ok;
    int bad;    /* wrong results */
    int failed; /* calls that failed */
    char why[256];
} worker;

static void *client_thread(void *arg) {
    worker *w = arg;
    const uint32_t B = 6 + (uint32_t)w->id;
    dpclip_client *c = NULL;
    dpclip_clip_config cfg = cfg_of(w->id % 2 ? DPCLIP_MEAN : DPCLIP_SUM, 0, 0.0f, DPCLIP_FLAT);
    dc_test_layer_spec lin = {DC_LAYER_LINEAR, B, 4, 6, 5, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec emb = {DC_LAYER_EMBEDDING, B, 4, 5, 11, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec rms = {DC_LAYER_RMSNORM, B, 4, 6, 0, DC_BF16, 0, DC_ALGO_AUTO, 1, 0};
    dc_test_rng r;
    dc_shm_step s;
    int have_step = 0;

    dc_test_rng_seed(&r, 1000 + (uint64_t)w->id);
    if (dpclip_connect(g_h.sock, NULL, &c)) {
        snprintf(w->why, sizeof w->why, "connect: %s", dpclip_errmsg(c));
        w->failed++;
        goto out;
    }
    if (dc_shm_step_init(&s, c, 1u << 20, B, &cfg) || dc_shm_step_add(&s, &lin, &r, 1.0f) < 0 ||
        dc_shm_step_add(&s, &emb, &r, 1.0f) < 0 || dc_shm_step_add(&s, &rms, &r, 1.0f) < 0 ||
        dc_shm_step_add_outputs(&s, 1, 0)) {
        snprintf(w->why, sizeof w->why, "building the step failed");
        w->failed++;
        goto out;
    }
    have_step = 1;
    cfg.max_grad_norm = (float)dc_shm_step_median_norm(&s);
    dc_shm_step_set_config(&s, &cfg);
    for (int i = 0; i < N_STEPS; i++) {
        dpclip_result res;
        dc_shm_step_refill(&s, &r);
        if (dpclip_run(c, s.step, &res)) {
            snprintf(w->why, sizeof w->why, "step %d: %s", i, dpclip_errmsg(c));
            w->failed++;
            break;
        }
        if (dc_shm_step_check(&s, &res, dc_test_rtol(DC_BF16), 1e-7) > 1.0) w->bad++;
        else w->steps_ok++;
        dpclip_result_free(&res);
    }
out:
    if (have_step) dc_shm_step_free(&s);
    dpclip_disconnect(c);
    return NULL;
}

static void test_concurrent_clients(void **state) {
    (void)state;
    pthread_t th[N_CLIENTS];
    worker w[N_CLIENTS];
    for (int i = 0; i < N_CLIENTS; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].id = i;
        assert_int_equal(pthread_create(&th[i], NULL, client_thread, &w[i]), 0);
    }
    for (int i = 0; i < N_CLIENTS; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N_CLIENTS; i++) {
        if (w[i].failed || w[i].bad)
            fprintf(stderr, "client %d: %d ok, %d wrong, %d failed: %s\n", i, w[i].steps_ok,
                    w[i].bad, w[i].failed, w[i].why);
        assert_int_equal(w[i].failed, 0);
        assert_int_equal(w[i].bad, 0);
        assert_int_equal(w[i].steps_ok, N_STEPS);
    }
}

/* --- the example trainer ---------------------------------------------------- */

static void test_example_trainer(void **state) {
    (void)state;
    const char *exe = DPCLIP_EXAMPLES_DIR "/train_mlp";
    char out[16384];
    size_t got = 0;
    int p[2], status;
    pid_t pid;
    const char *line;
    double acc = -1.0, eps = -1.0;

    assert_int_equal(access(exe, X_OK), 0);
    assert_int_equal(pipe(p), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(p[1], 1);
        close(p[0]);
        close(p[1]);
        execl(exe, exe, "--socket", g_h.sock, "--epochs", "3", (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    for (;;) {
        ssize_t n = read(p[0], out + got, sizeof out - 1 - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
        if (got == sizeof out - 1) break;
    }
    out[got] = '\0';
    close(p[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    fprintf(stderr, "%s", out);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    line = strstr(out, "epoch 3 loss ");
    assert_non_null(line);
    /* the ledger charged 96 steps at the sampling rate q = 1/32 the example
     * passes: a few units of epsilon at delta 1e-5 (charged as q = 1, the
     * same steps would cost about forty times that) */
    line = strstr(line, "epsilon ");
    assert_non_null(line);
    assert_int_equal(sscanf(line, "epsilon %lf", &eps), 1);
    assert_true(eps > 0.5 && eps < 10.0);
    line = strstr(out, "final accuracy ");
    assert_non_null(line);
    assert_int_equal(sscanf(line, "final accuracy %lf", &acc), 1);
    /* 4 classes: chance is 0.25; with noise on it must still learn */
    assert_true(acc > 0.6 && acc <= 1.0);
}

/* SIGTERM: the daemon finishes, exits 0 and removes its socket (cmocka
 * does not count a failing group teardown, so this is a test). */
static void test_clean_shutdown(void **state) {
    (void)state;
    assert_int_equal(dc_harness_stop(&g_h), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kinds_f32),       cmocka_unit_test(test_kinds_bf16),
        cmocka_unit_test(test_kinds_f16),       cmocka_unit_test(test_mean_vs_sum),
        cmocka_unit_test(test_per_layer),       cmocka_unit_test(test_outputs),
        cmocka_unit_test(test_noise),           cmocka_unit_test(test_concurrent_clients),
        cmocka_unit_test(test_example_trainer), cmocka_unit_test(test_clean_shutdown),
    };
    return cmocka_run_group_tests_name("integration", tests, group_setup, group_teardown);
}
