/* Kept stores (cuda/backend/backend_kept.cu): a norm group member's norm
 * phase (run_norms) keeps its layers' per-sample gradients as bf16 in a
 * store of its own, and its clip phase (run_clip) sums those layers from
 * the store. Checked against the double-precision per-sample reference
 * (sgrad_test.h's expected(): the kept values rounded to bf16, each
 * sample's coefficient from the norm of what is released):
 *   - the clip phase releases the reference's sums (relative l2 1e-4) and
 *     its coefficients, and every layer came from the store;
 *   - what it releases is what the norm phase measured: the client's data
 *     rewritten between the phases (NaN) changes nothing, where the clip
 *     phase without the store reads the new data and fails;
 *   - two norm phases in flight (a 1F1B stage's micro-batches) keep two
 *     stores, and each clip phase releases its own micro-batch's sums; a
 *     store given back serves the next phase (the stores' device memory does
 *     not grow);
 *   - gpu.sample_grads_max too small for a store: nothing kept, and the
 *     clip phase makes the sums from the client's data (GEMM path);
 *   - a norm pass (no outputs) keeps its layers for its sums steps, which
 *     sum their layers from the store by their index in the pass, clip by
 *     the pass's bound, and draw a ranged output's noise as they sum (one
 *     pass): the same draws as the GEMM path's, in the range only.
 * Without a CUDA device: skipped (77). */
#include "cpu.h"
#include "sgrad_test.h"

enum { N = 6 };
static const uint32_t kB = 3;

static int64_t g_shape[N][3] = {{64, 136, 264},  {70, 64, 72},  {64, 200, 520},
                                {128, 392, 136}, {65, 72, 264}, {64, 256, 256}};

/* The clip phase's bound on its norms' rounding: the norm pass's rule (no
 * layer kept) and the kept layers' own (backend_cuda.cu step_bounds). */
static double clip_phase_e(dc_step *ds, const int *kept) {
    const unsigned how = dc_clip_e_how(ds);
    double e = dc_clip_e_step(ds, how);
    for (size_t l = 0; l < ds->n_layers; l++)
        if (kept[l]) e = fmax(e, dc_clip_e(ds, l, how | DC_E_KEPT));
    return e;
}

/* One norm phase of ds, keeping: its n2 [N*B] and totals [B]; the store. */
static dc_kept *norms(dc_step *ds, double *n2, double *tot) {
    dc_kept *kept = NULL;
    dc_err e;
    int rc = g_cuda->ops->run_norms(g_cuda, ds, n2, &kept, &e);
    if (rc) printf("  norms: %s: %s\n", e.field, e.msg);
    assert_int_equal(rc, 0);
    for (uint32_t b = 0; b < kB; b++) {
        tot[b] = 0.0;
        for (size_t l = 0; l < ds->n_layers; l++) tot[b] += n2[l * kB + b];
    }
    return kept;
}

/* The reference of a clip phase over the host layers h with the layers
 * `want` kept: outputs w, bo, per-sample norms, and the threshold it sets
 * in ds (between the norms, so that some samples are clipped). */
typedef struct ref_out {
    double *w[N], *bo[N], norms[8];
} ref_out;

static void reference(dc_layer *h, dc_step *ds, const int *want, ref_out *r) {
    double C;
    for (int l = 0; l < N; l++) {
        r->w[l] = calloc((size_t)h[l].p * (size_t)h[l].d, sizeof *r->w[l]);
        r->bo[l] = calloc((size_t)h[l].p, sizeof *r->bo[l]);
        assert_non_null(r->w[l]);
        assert_non_null(r->bo[l]);
    }
    expected(h, N, kB, &C, want, clip_phase_e(ds, want), r->w, r->bo, r->norms);
    ds->max_grad_norm = (float)C;
}

static void ref_free(ref_out *r) {
    for (int l = 0; l < N; l++) {
        free(r->w[l]);
        free(r->bo[l]);
    }
}

/* The clip phase with the store `kept` (or none): n_kept layers from the
 * store, norms and outputs against the reference. */
static void clip_checked(dc_layer *d, dc_step *ds, const double *n2, const double *tot,
                         const dc_kept *kept, int n_kept, const ref_out *r) {
    dc_step_result res;
    dc_err e;
    assert_int_equal(dc_step_result_init(&res, kB, N, false), 0);
    int rc = g_cuda->ops->run_clip(g_cuda, ds, n2, tot, 0.0, kept, NULL, &res, &e);
    if (rc) printf("  clip: %s: %s\n", e.field, e.msg);
    assert_int_equal(rc, 0);
    assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), n_kept);
    int clipped = 0;
    for (uint32_t b = 0; b < kB; b++) {
        assert_true(fabs(sqrt(tot[b]) - r->norms[b]) <= 1e-4 * r->norms[b]);
        clipped += r->norms[b] > ds->max_grad_norm;
    }
    assert_true(clipped > 0 && clipped < (int)kB);
    for (int l = 0; l < N; l++) {
        dc_tensor *o[2] = {&d[l].weight_grad_out, &d[l].bias_grad_out};
        for (int k = 0; k < 2; k++) {
            if (!o[k]->data) continue;
            float *got = dev_to_f32(o[k]);
            double err = rel_l2_d(got, k ? r->bo[l] : r->w[l], numel(o[k]));
            if (!(err <= 1e-4)) printf("  layer %d %s: rel l2 err %.2e\n", l, k ? "b" : "w", err);
            assert_true(err <= 1e-4);
            free(got);
        }
    }
    dc_step_result_free(&res);
}

static void setup_layers(dc_layer *h, dc_layer *d, uint64_t seed, size_t budget) {
    make(h, d, N, kB, g_shape, seed);
    set_switches(1, 1);
    g_opts.sgrad = DCC_SGRAD_ALL;
    apply_switches();
    dc_cuda_backend_set_sample_grads(g_cuda, budget);
}

static void teardown_layers(dc_layer *h, dc_layer *d) {
    release(h, d, N);
    set_switches(1, 1);
    dc_cuda_backend_set_sample_grads(g_cuda, DC_SAMPLE_GRADS_AUTO);
}

static const int kAll[N] = {1, 1, 1, 1, 1, 1}, kNone[N] = {0};

/* The kept clip phase against the reference, every layer from the store;
 * then the client's output grads rewritten with NaN between the phases:
 * with the store the release is the same (what the norms measured),
 * without it the clip phase reads the NaN and fails, writing nothing. */
static void test_clip_from_store(void **state) {
    (void)state;
    dc_layer h[N], d[N];
    dc_step ds;
    double n2[N * 3], tot[3];
    ref_out r;
    setup_layers(h, d, 2121, DC_SAMPLE_GRADS_AUTO);
    step_init(&ds, d, N, kB, 0);
    reference(h, &ds, kAll, &r);
    dc_kept *kept = norms(&ds, n2, tot);
    assert_non_null(kept);
    assert_int_equal(kept->n_layers, N);
    for (int l = 0; l < N; l++) assert_int_equal(kept->layer[l], 1);
    clip_checked(d, &ds, n2, tot, kept, N, &r);

    for (int l = 0; l < N; l++) /* 0xffff: NaN in bf16 and f16 */
        CUDA_OK(cudaMemset(d[l].grad.data, 0xff, tensor_bytes(&d[l].grad)));
    CUDA_OK(cudaDeviceSynchronize());
    clip_checked(d, &ds, n2, tot, kept, N, &r);
    g_cuda->ops->kept_free(g_cuda, kept);
    outputs_fill(d, N, 7.0f);
    dc_step_result res;
    dc_err e;
    assert_int_equal(dc_step_result_init(&res, kB, N, false), 0);
    assert_int_equal(g_cuda->ops->run_clip(g_cuda, &ds, n2, tot, 0.0, NULL, NULL, &res, &e),
                     DC_ENONFINITE);
    assert_outputs_hold(d, N, 7.0f);
    dc_step_result_free(&res);
    ref_free(&r);
    teardown_layers(h, d);
}

/* Two micro-batches of their own data (seeds seed, seed + 1): layers, steps,
 * references, and their norm phases' results and stores. */
typedef struct two_mb {
    dc_layer h[2][N], d[2][N];
    dc_step ds[2];
    double n2[2][N * 3], tot[2][3];
    ref_out r[2];
    dc_kept *kept[2];
} two_mb;

static two_mb *two_setup(uint64_t seed) {
    two_mb *t = calloc(1, sizeof *t);
    assert_non_null(t);
    for (int m = 0; m < 2; m++) {
        setup_layers(t->h[m], t->d[m], seed + (uint64_t)m, DC_SAMPLE_GRADS_AUTO);
        step_init(&t->ds[m], t->d[m], N, kB, 0);
        reference(t->h[m], &t->ds[m], kAll, &t->r[m]);
    }
    return t;
}

/* Both norm phases, keeping: two stores in flight. */
static void two_norms(two_mb *t) {
    for (int m = 0; m < 2; m++) assert_non_null(t->kept[m] = norms(&t->ds[m], t->n2[m], t->tot[m]));
    assert_ptr_not_equal(t->kept[0], t->kept[1]);
}

/* Micro-batch m's clip phase from its store, checked; the store back. */
static void two_clip(two_mb *t, int m) {
    clip_checked(t->d[m], &t->ds[m], t->n2[m], t->tot[m], t->kept[m], N, &t->r[m]);
    g_cuda->ops->kept_free(g_cuda, t->kept[m]);
}

static void two_free(two_mb *t) {
    for (int m = 0; m < 2; m++) {
        ref_free(&t->r[m]);
        teardown_layers(t->h[m], t->d[m]);
    }
    free(t);
}

/* Two norm phases in flight on one GPU (a pipeline stage's micro-batches
 * m and m + 1, whose clip phases wait for the other stages), each of its
 * own data: two stores; each clip phase releases its own micro-batch's
 * sums. Given back, the stores serve the next two phases: the device
 * memory the instance holds stays as it was. */
static void test_two_in_flight(void **state) {
    (void)state;
    two_mb *t = two_setup(3131);
    size_t held = 0;
    for (int round = 0; round < 2; round++) {
        two_norms(t);
        for (int m = 0; m < 2; m++) two_clip(t, m);
        if (round == 0) assert_true((held = dc_cuda_backend_kept_bytes(g_cuda)) > 0);
        else assert_int_equal(dc_cuda_backend_kept_bytes(g_cuda), held);
    }
    two_free(t);
}

/* An idle release (backend.h release, gpu.idle_release_s) frees the stores
 * given back and the workspace grown beyond the preallocation (none here),
 * but not a store a norm phase still holds for its clip phase: that clip
 * phase, after it, sums from its store right; and the next phases grow
 * what they need again. */
static void test_idle_release(void **state) {
    (void)state;
    two_mb *t = two_setup(3232);
    two_norms(t);
    const size_t both = dc_cuda_backend_kept_bytes(g_cuda);
    assert_true(dc_cuda_backend_workspace_bytes(g_cuda) > 0);
    g_cuda->ops->kept_free(g_cuda, t->kept[1]); /* micro-batch 1's phases were dropped */
    dc_backend_release(g_cuda);
    const size_t one = dc_cuda_backend_kept_bytes(g_cuda);
    printf("kept stores: %zu bytes, %zu after a release with one still held; workspace %zu\n", both,
           one, dc_cuda_backend_workspace_bytes(g_cuda));
    assert_true(one > 0 && one < both);
    assert_int_equal(dc_cuda_backend_workspace_bytes(g_cuda), 0);
    two_clip(t, 0); /* the held store intact */
    dc_backend_release(g_cuda);
    assert_int_equal(dc_cuda_backend_kept_bytes(g_cuda), 0);
    assert_int_equal(dc_cuda_backend_workspace_bytes(g_cuda), 0);
    two_norms(t); /* grown again: two stores in flight */
    for (int m = 0; m < 2; m++) two_clip(t, m);
    assert_true(dc_cuda_backend_kept_bytes(g_cuda) == both);
    two_free(t);
}

/* gpu.sample_grads_max below one store: nothing is kept, and the clip
 * phase makes every sum from the client's data. */
static void test_store_over_budget(void **state) {
    (void)state;
    dc_layer h[N], d[N];
    dc_step ds;
    double n2[N * 3], tot[3];
    ref_out r;
    setup_layers(h, d, 4141, 4096);
    step_init(&ds, d, N, kB, 0);
    reference(h, &ds, kNone, &r);
    assert_null(norms(&ds, n2, tot));
    clip_checked(d, &ds, n2, tot, NULL, 0, &r);
    ref_free(&r);
    teardown_layers(h, d);
}

/* test_pass_sums_from_store's noise in a range (cols: columns [d/4,
 * 3d/4) of each weight, else its rows [0, p/2)) on the even layers, from
 * the store and by the GEMM path: noised minus noiseless, the same draws
 * within the range, none outside. */
static void noise_in_range(dc_layer *d, dc_layer *sub, size_t *at, double *n2s, const double *n2,
                           const double *tot, dc_kept *kept, float C, int cols) {
    enum { H = N / 2 };
    dc_step ss;
    for (int i = 0; i < H; i++) {
        at[i] = (size_t)(2 * i);
        sub[i] = d[at[i]];
        sub[i].noise_w = cols ? (dc_noise_range){true, 1, (uint64_t)sub[i].d / 4,
                                                 3 * (uint64_t)sub[i].d / 4}
                              : (dc_noise_range){true, 0, 0, (uint64_t)sub[i].p / 2};
        memcpy(&n2s[i * kB], &n2[at[i] * kB], kB * sizeof *n2s);
    }
    float *noise[2][H];
    for (int path = 0; path < 2; path++) {
        float *out[2][H];
        for (int sig = 0; sig < 2; sig++) {
            step_init(&ss, sub, H, kB, 0);
            ss.max_grad_norm = C;
            ss.noise_multiplier = sig ? 0.5f : 0.0f;
            dc_step_result res;
            dc_err e;
            assert_int_equal(dc_step_result_init(&res, kB, H, false), 0);
            int rc = g_cuda->ops->run_clip(g_cuda, &ss, n2s, tot, 0.0, path ? kept : NULL,
                                           path ? at : NULL, &res, &e);
            if (rc) printf("  noised sums: %s: %s\n", e.field, e.msg);
            assert_int_equal(rc, 0);
            if (path) assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), H);
            for (int j = 0; j < H; j++) out[sig][j] = dev_to_f32(&sub[j].weight_grad_out);
            dc_step_result_free(&res);
        }
        for (int j = 0; j < H; j++) {
            const int64_t n = numel(&sub[j].weight_grad_out);
            for (int64_t x = 0; x < n; x++) out[1][j][x] -= out[0][j][x];
            noise[path][j] = out[1][j];
            free(out[0][j]);
        }
    }
    for (int j = 0; j < H; j++) {
        const int64_t n = numel(&sub[j].weight_grad_out), w = sub[j].d;
        double big = 0.0;
        for (int64_t x = 0; x < n; x++) {
            const bool in = cols ? (x % w >= w / 4 && x % w < 3 * w / 4) : x < (sub[j].p / 2) * w;
            if (!in) /* another rank's part: no noise on either path (but f32 roundings) */
                for (int path = 0; path < 2; path++)
                    assert_true(fabs((double)noise[path][j][x]) <=
                                1e-6 * fabs((double)noise[0][j][0]) + 1e-12);
            big = fmax(big, fabs((double)noise[0][j][x]));
        }
        assert_true(big > 0.0);
        for (int64_t x = 0; x < n; x++)
            assert_true(fabs((double)noise[1][j][x] - noise[0][j][x]) <= 1e-3 * big);
        free(noise[0][j]);
        free(noise[1][j]);
    }
}

/* A norm pass (no outputs: it keeps every layer its sums steps may want)
 * and two sums steps over halves of its layers (each layer's index in the
 * pass), each from the store: against the reference with the pass's bound
 * (DC_E_KEPT_FLOOR); then sums steps with noise on half of each weight's
 * rows (a sharded rank's range), and on half its columns: the noise the
 * kept sum draws (sgrad.cu, in one pass), within the range only, is the
 * one the GEMM path draws, element for element. */
static void test_pass_sums_from_store(void **state) {
    (void)state;
    enum { H = N / 2 };
    dc_layer h[N], d[N], dp[N], sub[H];
    dc_step ps, ss, full;
    double n2[N * 3], tot[3], n2s[H * 3];
    size_t at[H];
    ref_out r;
    setup_layers(h, d, 5151, DC_SAMPLE_GRADS_AUTO);
    for (int l = 0; l < N; l++) {
        dp[l] = d[l];
        dp[l].weight_grad_out.data = dp[l].bias_grad_out.data = NULL;
    }
    step_init(&ps, dp, N, kB, 0);
    dc_kept *kept = norms(&ps, n2, tot);
    assert_non_null(kept);
    for (int l = 0; l < N; l++) assert_int_equal(kept->layer[l], 1);
    step_init(&full, d, N, kB, 0);
    /* the reference with the pass's e: expected() sets C in full */
    {
        double C;
        for (int l = 0; l < N; l++) {
            r.w[l] = calloc((size_t)h[l].p * (size_t)h[l].d, sizeof *r.w[l]);
            r.bo[l] = calloc((size_t)h[l].p, sizeof *r.bo[l]);
        }
        expected(h, N, kB, &C, kAll, fmax(clip_phase_e(&full, kAll), DC_E_KEPT_FLOOR), r.w, r.bo,
                 r.norms);
        full.max_grad_norm = (float)C;
    }
    for (int half = 0; half < 2; half++) {
        for (int i = 0; i < H; i++) {
            at[i] = (size_t)(2 * i + half);
            sub[i] = d[at[i]];
            memcpy(&n2s[i * kB], &n2[at[i] * kB], kB * sizeof *n2s);
        }
        step_init(&ss, sub, H, kB, 0);
        ss.max_grad_norm = full.max_grad_norm;
        dc_step_result res;
        dc_err e;
        assert_int_equal(dc_step_result_init(&res, kB, H, false), 0);
        int rc = g_cuda->ops->run_clip(g_cuda, &ss, n2s, tot, 0.0, kept, at, &res, &e);
        if (rc) printf("  sums: %s: %s\n", e.field, e.msg);
        assert_int_equal(rc, 0);
        assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), H);
        for (int i = 0; i < H; i++) {
            const size_t l = at[i];
            dc_tensor *o[2] = {&d[l].weight_grad_out, &d[l].bias_grad_out};
            for (int k = 0; k < 2; k++) {
                if (!o[k]->data) continue;
                float *got = dev_to_f32(o[k]);
                double err = rel_l2_d(got, k ? r.bo[l] : r.w[l], numel(o[k]));
                if (!(err <= 1e-4))
                    printf("  layer %zu %s: rel l2 err %.2e\n", l, k ? "b" : "w", err);
                assert_true(err <= 1e-4);
                free(got);
            }
        }
        dc_step_result_free(&res);
    }

    /* noise in a range, a rank's rows and then a transposed weight's
     * columns: kept (one pass: the kept sum draws it) against the GEMM
     * path, noised minus noiseless */
    for (int cols = 0; cols < 2; cols++)
        noise_in_range(d, sub, at, n2s, n2, tot, kept, full.max_grad_norm, cols);
    g_cuda->ops->kept_free(g_cuda, kept);
    ref_free(&r);
    teardown_layers(h, d);
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clip_from_store),      cmocka_unit_test(test_two_in_flight),
        cmocka_unit_test(test_idle_release),         cmocka_unit_test(test_store_over_budget),
        cmocka_unit_test(test_pass_sums_from_store),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup_gpu_bounds, cuda_test_teardown);
}
