/* Kept per-sample gradients (cuda/kernels/sgrad.cu, the grouped norm kernel's
 * store): the clipped sum of a layer whose norm pass kept every G_b as bf16
 * is sum_b c_b * bf16(G_b), with c_b = min(1, C / (n_b (1 + e) + 1e-6)), n_b
 * the norm of the kept values (plus the exact bias sums) and e the step's
 * bound on its rounding (step.h; the kept layers' includes the bf16
 * rounding), so that each sample's contribution stays within C, against
 * the kept values and against the exact G_b. Checked against that
 * semantics built from the double-precision per-sample reference
 * (tests/support/ref.h), rounded to bf16 here:
 *   norms: relative 1e-4 (f32 accumulation only; a bf16 rounding that the
 *     kernel's f32 accumulator puts on the other side of a tie flips one
 *     element by 2^-8 of itself, rare and small in a whole norm);
 *   weights and biases: ||got - want|| / ||want|| <= 1e-4 per tensor, for
 *     the same reasons.
 * And against the exact CPU backend (no rounding): at most 2^-8 relative,
 * the bf16 rounding's bound, but more than the GEMM path's 1e-4 on some
 * tensor, so the test would see if the rounding were skipped.
 * Their noise is the output pass's, draw for draw (test_kept_noise).
 * The budget (gpu.sample_grads_max) decides which layers are kept: greedily
 * in step order; 0 keeps none. These run with DPCLIP_CUDA_SGRAD=all (every
 * layer that can be kept, short ones included); the default keeps the
 * layers the cost model picks (test_keep_worth). Without a CUDA device:
 * skipped (77). */
#include "cpu.h"
#include "sgrad_test.h"

/* Runs the step of n device layers d (host twins h) with the budget; checks
 * how many layers were kept, then norms and outputs against expected(). */
static void check_step(dc_layer *h, dc_layer *d, int n, uint32_t B, size_t budget) {
    double C;
    int kept[NL] = {0}, want_kept = 0;
    size_t used = 0;
    for (int l = 0; l < n; l++) { /* the greedy rule of plan_step */
        dcc_linear x = lin(&h[l], B);
        size_t need = al256(dcc_sgrad_bytes(&x));
        if (used + need > budget) continue;
        used += need;
        kept[l] = 1;
        want_kept++;
    }
    double *w[NL], *bo[NL], *norms = calloc(B, sizeof *norms);
    for (int l = 0; l < n; l++) {
        w[l] = calloc((size_t)h[l].p * (size_t)h[l].d, sizeof *w[l]);
        bo[l] = calloc((size_t)h[l].p, sizeof *bo[l]);
    }
    /* the step's bound on its norms' rounding (step.h): its kept layers'
     * include the bf16 rounding of the values kept; the CPU backend the
     * outputs are also compared with clips by the same */
    dc_step es;
    double e_step = 0.0;
    step_init(&es, h, (size_t)n, B, 0);
    for (int l = 0; l < n; l++)
        e_step = fmax(e_step,
                      dc_clip_e(&es, (size_t)l, DC_E_GPU | DC_E_TF32 | (kept[l] ? DC_E_KEPT : 0u)));
    dc_cpu_backend_set_clip_how(g_cpu, DC_E_GPU | DC_E_TF32 | (want_kept ? DC_E_KEPT : 0u));
    expected(h, n, B, &C, kept, e_step, w, bo, norms);

    dc_step ds, hs;
    dc_step_result rd, rh;
    dc_err ed, eh;
    dc_cuda_backend_set_sample_grads(g_cuda, budget);
    step_init(&ds, d, (size_t)n, B, 0);
    step_init(&hs, h, (size_t)n, B, -1);
    ds.max_grad_norm = hs.max_grad_norm = (float)C;
    int rc = run(g_cuda, &ds, &rd, &ed);
    if (rc) fprintf(stderr, "cuda: %s: %s\n", ed.field, ed.msg);
    assert_int_equal(rc, 0);
    assert_int_equal(run(g_cpu, &hs, &rh, &eh), 0);
    assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), want_kept);
    int clipped = 0;
    for (uint32_t b = 0; b < B; b++) {
        assert_true(fabs(rd.norms[b] - norms[b]) <= 1e-4 * norms[b]);
        clipped += norms[b] > C;
    }
    double worst = 0.0, worst_exact = 0.0;
    for (int l = 0; l < n; l++) {
        dc_tensor *o[2] = {&d[l].weight_grad_out, &d[l].bias_grad_out};
        dc_tensor *ho[2] = {&h[l].weight_grad_out, &h[l].bias_grad_out};
        for (int k = 0; k < 2; k++) {
            if (!o[k]->data) continue;
            float *got = dev_to_f32(o[k]), *cpu = host_to_f32(ho[k]);
            double e = rel_l2_d(got, k ? bo[l] : w[l], numel(o[k]));
            double ex = rel_l2(got, cpu, numel(o[k]));
            if (!(e <= 1e-4))
                printf("  layer %d %s (T=%lld d=%lld p=%lld, %s): rel l2 err %.2e\n", l,
                       k ? "bias" : "weight", (long long)h[l].T, (long long)h[l].d,
                       (long long)h[l].p, kept[l] ? "kept" : "GEMM", e);
            if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
            if (k == 0 && kept[l] && ex > worst_exact) worst_exact = ex;
            assert_true(ex <= (kept[l] && k == 0 ? 1.0 / 256 : 1e-4));
            free(got);
            free(cpu);
        }
    }
    printf("B=%u budget %zu: %d of %d layers kept, %d samples clipped, worst rel l2 err %.2e "
           "(kept weights against the exact sum: %.2e)\n",
           B, budget, want_kept, n, clipped, worst, worst_exact);
    assert_true(worst <= 1e-4);
    if (want_kept) assert_true(worst_exact > 1e-4); /* the rounding is there */
    assert_true(clipped > 0 && clipped < (int)B);
    dc_step_result_free(&rd);
    dc_step_result_free(&rh);
    for (int l = 0; l < n; l++) {
        free(w[l]);
        free(bo[l]);
    }
    free(norms);
}

/* Odd shapes (d not a multiple of 128, p not of 256, T not of 64), both
 * 16-bit dtypes, with and without biases; all kept, some, none. */
static void test_kept_layers(void **state) {
    (void)state;
    const uint32_t B = 3;
    int64_t shape[NL][3];
    dc_layer h[NL], d[NL];
    for (int l = 0; l < NL; l++) {
        shape[l][0] = 64 + 61 * (l % 4);       /* T */
        shape[l][1] = 64 + 72 * (l % 5);       /* d */
        shape[l][2] = 72 + 96 * ((l * 7) % 6); /* p */
    }
    make(h, d, NL, B, shape, 1212);
    set_switches(1, 1);
    g_opts.sgrad = DCC_SGRAD_ALL;
    apply_switches();
    size_t all = 0, some = 0;
    for (int l = 0; l < NL; l++) {
        dcc_linear x = lin(&h[l], B);
        all += al256(dcc_sgrad_bytes(&x));
        if (l < NL / 2) some = all;
    }
    check_step(h, d, NL, B, all);
    check_step(h, d, NL, B, some + 1000); /* a few later small layers fit too */
    check_step(h, d, NL, B, 0);
    /* DPCLIP_CUDA_SGRAD=0: none kept whatever the budget */
    g_opts.sgrad = DCC_SGRAD_OFF;
    apply_switches();
    {
        dc_step ds;
        dc_step_result rd;
        dc_err ed;
        dc_cuda_backend_set_sample_grads(g_cuda, all);
        step_init(&ds, d, NL, B, 0);
        assert_int_equal(run(g_cuda, &ds, &rd, &ed), 0);
        assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), 0);
        dc_step_result_free(&rd);
    }
    release(h, d, NL);
    set_switches(1, 1);
    dc_cuda_backend_set_sample_grads(g_cuda, DC_SAMPLE_GRADS_AUTO);
}

/* More samples than the sum stages coefficients for at once (64). */
static void test_kept_many_samples(void **state) {
    (void)state;
    const uint32_t B = 70;
    int64_t shape[3][3] = {{64, 64, 72}, {65, 136, 264}, {100, 200, 72}};
    dc_layer h[3], d[3];
    make(h, d, 3, B, shape, 1313);
    set_switches(1, 1);
    g_opts.sgrad = DCC_SGRAD_ALL;
    apply_switches();
    check_step(h, d, 3, B, DC_SAMPLE_GRADS_AUTO);
    release(h, d, 3);
    set_switches(1, 1);
}

/* One MEAN step (the expected batch B: 3 divides with a rounding, 4 as a
 * power of two) of the layers d with threshold C and noise sigma, on the
 * switches already applied; its code, with the error printed. */
static void mean_init(dc_step *ds, dc_layer *d, int n, uint32_t B, float C, float sigma,
                      bool zero_on_fail) {
    step_init(ds, d, (size_t)n, B, 0);
    ds->max_grad_norm = C;
    ds->noise_multiplier = sigma;
    ds->reduction = DC_REDUCTION_MEAN;
    ds->expected_batch = B;
    ds->zero_on_fail = zero_on_fail;
}

static int mean_step(dc_layer *d, int n, uint32_t B, float C, float sigma, bool zero_on_fail) {
    dc_step ds;
    dc_step_result rd;
    dc_err ed;
    mean_init(&ds, d, n, B, C, sigma, zero_on_fail);
    int rc = run(g_cuda, &ds, &rd, &ed);
    if (rc) printf("  step: %s: %s\n", ed.field, ed.msg);
    dc_step_result_free(&rd);
    return rc;
}

/* Outputs of a noised MEAN step over d (device layers) into host f32
 * copies out[l][0..1] (weight, bias; NULL where none); grouped_min as
 * dcc_options has it (0: every step's layers grouped), and then that many
 * layers kept with DPCLIP_CUDA_SGRAD=all, else none. */
static void noised_step(dc_layer *d, int n, uint32_t B, int sgrad, bool one_pass, float sigma,
                        int grouped_min, float **out) {
    set_switches(1, 1);
    g_opts.sgrad = sgrad;
    g_opts.one_pass = one_pass;
    g_opts.grouped_min = grouped_min;
    apply_switches();
    assert_int_equal(mean_step(d, n, B, 0.05f, sigma, false), 0);
    const int kept = sgrad == DCC_SGRAD_ALL && grouped_min == 0 ? n : 0;
    assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), kept);
    /* every output's bound fits its dtype here: one pass means the kept
     * sums write the outputs themselves */
    assert_int_equal(dc_cuda_backend_kept_direct(g_cuda), kept > 0 && one_pass);
    for (int l = 0; l < n; l++) {
        out[2 * l] = dev_to_f32(&d[l].weight_grad_out);
        out[2 * l + 1] = d[l].bias_grad_out.data ? dev_to_f32(&d[l].bias_grad_out) : NULL;
    }
}

/* The noise the kept gradients' sum adds is the output pass's, draw for
 * draw (dcc_noise.cuh's pairs of an output's elements, which its threads
 * hold in lanes 4 apart): for every element, noised minus noiseless is the
 * same with and without kept gradients, up to the roundings of the two
 * sums (f32, relative 1e-6 of the values and of the noise's scale). A
 * misplaced draw would differ
 * by the noise itself. Staged outputs (one pass off) equal one-pass ones
 * (the same roundings; two runs' norms may differ in their last bits,
 * added atomically). A step planned to keep its gradients that then does not
 * (no grouped norm launch) gets its noise from the output pass, as the
 * GEMM path's does. */
static void test_kept_noise(void **state) {
    (void)state;
    enum { N = 6 };
    const uint32_t B = 3;
    int64_t shape[N][3] = {{64, 136, 264},  {70, 64, 72},  {64, 200, 520},
                           {128, 392, 136}, {65, 72, 264}, {64, 256, 256}};
    dc_layer h[N], d[N];
    make(h, d, N, B, shape, 1515);
    float *kn[2 * N], *kc[2 * N], *gn[2 * N], *gc[2 * N], *ks[2 * N];
    const float sigma = 0.7f;
    noised_step(d, N, B, DCC_SGRAD_ALL, true, sigma, 0, kn);
    noised_step(d, N, B, DCC_SGRAD_ALL, true, 0.0f, 0, kc);
    noised_step(d, N, B, DCC_SGRAD_OFF, true, sigma, 0, gn);
    noised_step(d, N, B, DCC_SGRAD_OFF, true, 0.0f, 0, gc);
    noised_step(d, N, B, DCC_SGRAD_ALL, false, sigma, 0, ks);
    const double std_over_div = sigma * 0.05 / B;
    double worst = 0.0, biggest = 0.0;
    long staged_differ = 0, n_checked = 0;
    for (int o = 0; o < 2 * N; o++) {
        if (!kn[o]) continue;
        const int64_t n = numel(o & 1 ? &d[o / 2].bias_grad_out : &d[o / 2].weight_grad_out);
        for (int64_t i = 0; i < n; i++) {
            const double dk = (double)kn[o][i] - kc[o][i], dg = (double)gn[o][i] - gc[o][i];
            const double tol = 1e-6 * (fabs(kn[o][i]) + fabs(kc[o][i]) + fabs(gn[o][i]) +
                                       fabs(gc[o][i]) + std_over_div);
            if (fabs(dk - dg) / tol > worst) worst = fabs(dk - dg) / tol;
            if (fabs(dk) > biggest) biggest = fabs(dk);
            staged_differ += fabs((double)kn[o][i] - ks[o][i]) >
                             1e-6 * (fabs(kn[o][i]) + std_over_div);
            n_checked++;
        }
        free(kn[o]);
        free(kc[o]);
        free(gn[o]);
        free(gc[o]);
        free(ks[o]);
    }
    printf("noise: %ld values, worst |kept - GEMM| noise difference %.2f of its bound, largest "
           "noise %.2f std, staged values differing from one-pass ones: %ld\n",
           n_checked, worst, biggest / std_over_div, staged_differ);
    assert_true(worst <= 1.0);
    assert_true(biggest > 3.0 * std_over_div); /* the noise is there */
    assert_int_equal(staged_differ, 0);

    /* Planned kept, then not: a step too small for the grouped norm launch
     * (its threshold raised above it) keeps nothing after its outputs were
     * planned as noised by the kept sum; the flags must be taken back, so
     * that the output pass draws the noise, as on the GEMM path. */
    float *un[2 * N], *ug[2 * N];
    noised_step(d, N, B, DCC_SGRAD_ALL, true, sigma, 1 << 30, un);
    noised_step(d, N, B, DCC_SGRAD_OFF, true, sigma, 1 << 30, ug);
    /* within the roundings that atomically added norms leave between two
     * runs (relative 1e-5 of the values or of the noise's scale: an output
     * near 0 rounds on a scale of its terms); without the noise the values
     * would be off by the noise itself, 1e5 times that */
    double worst_back = 0.0;
    for (int o = 0; o < 2 * N; o++) {
        if (!un[o]) continue;
        const int64_t n = numel(o & 1 ? &d[o / 2].bias_grad_out : &d[o / 2].weight_grad_out);
        for (int64_t i = 0; i < n; i++) {
            const double tol = 1e-5 * (fabs(un[o][i]) + fabs(ug[o][i]) + std_over_div);
            if (fabs((double)un[o][i] - ug[o][i]) / tol > worst_back)
                worst_back = fabs((double)un[o][i] - ug[o][i]) / tol;
        }
        free(un[o]);
        free(ug[o]);
    }
    printf("kept, then not (no grouped launch): worst difference from the GEMM path's %.2f of "
           "its bound\n",
           worst_back);
    assert_true(worst_back <= 1.0);
    release(h, d, N);
    set_switches(1, 1);
}

/* An output of another dtype, allocated on the device in place of t's. */
static void retype(dc_tensor *t, dc_dtype dt) {
    dev_free(t);
    t->dtype = dt;
    CUDA_OK(cudaMalloc(&t->data, tensor_bytes(t)));
}

static int g_out_blocks; /* kept_step's dcc_options.out_blocks */

/* A MEAN step of the layers d, kept as `budget` allows (mean_step). */
static int kept_step(dc_layer *d, int n, uint32_t B, size_t budget, bool one_pass, float C,
                     float sigma, bool zero_on_fail) {
    set_switches(1, 1);
    g_opts.sgrad = DCC_SGRAD_ALL;
    g_opts.one_pass = one_pass;
    g_opts.out_blocks = g_out_blocks;
    apply_switches();
    dc_cuda_backend_set_sample_grads(g_cuda, budget);
    return mean_step(d, n, B, C, sigma, zero_on_fail);
}

/* Every output of d read back, each value written (none is 7, the fill):
 * run 0 keeps them in ref[2 l + k]; a later run's are compared with those
 * (differ, at the noise's scale), adding to *exact and *total. Returns how
 * many values differ. */
static long outputs_against(dc_layer *d, int n, int run, float **ref, double scale, long *exact,
                            long *total) {
    long bad = 0;
    for (int o = 0; o < 2 * n; o++) {
        const dc_tensor *t = o & 1 ? &d[o / 2].bias_grad_out : &d[o / 2].weight_grad_out;
        if (!t->data) continue;
        float *v = dev_to_f32(t);
        for (int64_t i = 0; i < numel(t); i++) assert_true(v[i] != 7.0f);
        if (run == 0) {
            ref[o] = v;
            continue;
        }
        bad += differ(ref[o], v, numel(t), t->dtype, scale, exact);
        *total += numel(t);
        free(v);
    }
    return bad;
}

/* The outputs of a kept step of d (every layer kept) in one pass, then
 * staged (one pass off), each over outputs filled with 7 first: the one
 * pass writes its outputs itself (kept_direct) or not, as `direct` says,
 * and every value is written and agrees with the staged one
 * (outputs_against). Returns how many values differ; adds to *exact and
 * *total. */
static long against_staged(dc_layer *d, int n, uint32_t B, float C, float sigma, bool direct,
                           long *exact, long *total) {
    float *got[2 * NL] = {NULL};
    long bad = 0;
    for (int pass = 0; pass < 2; pass++) {
        outputs_fill(d, (size_t)n, 7.0f);
        assert_int_equal(kept_step(d, n, B, DC_SAMPLE_GRADS_AUTO, pass == 0, C, sigma, false), 0);
        assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), n);
        assert_int_equal(dc_cuda_backend_kept_direct(g_cuda), pass == 0 && direct);
        bad += outputs_against(d, n, pass, got, sigma * C / B, exact, total);
    }
    for (int o = 0; o < 2 * n; o++) free(got[o]);
    return bad;
}

/* Kept layers' sums written straight into their outputs (mode 1), in every
 * output dtype: the values the staged path (one pass off: staging, then the
 * division and the commit's conversion) writes. Where the check cannot
 * prove the outputs safe beforehand, the kept sums go through staging: an
 * f16 output whose bound 2 B C / divisor exceeds its range although its
 * values do not is still written, right; and a step that fails in its output pass
 * (another layer's f16 output overflowing with the noise) leaves the kept
 * layer's outputs as they were, or zeros with zero_on_fail. */
static void test_kept_direct(void **state) {
    (void)state;
    enum { N = 4 };
    const uint32_t B = 3;
    int64_t shape[N][3] = {{64, 136, 264}, {70, 64, 72}, {64, 200, 520}, {65, 72, 264}};
    const dc_dtype odt[N] = {DC_F32, DC_BF16, DC_F16, DC_BF16};
    dc_layer h[N], d[N];
    make(h, d, N, B, shape, 1717);
    for (int l = 0; l < N; l++) {
        retype(&d[l].weight_grad_out, odt[l]);
        if (d[l].bias_grad_out.data) retype(&d[l].bias_grad_out, odt[(l + 1) % N]);
    }
    /* 1. direct against staged, noised (std / B = 0.7 * 0.05 / 3) */
    long exact = 0, total = 0;
    const long bad = against_staged(d, N, B, 0.05f, 0.7f, true, &exact, &total);
    printf("kept sums into the outputs: %ld values, %ld bit-equal to the staged path's, %ld "
           "beyond its roundings\n",
           total, exact, bad);
    assert_int_equal(bad, 0);
    /* 1b. every output of one dtype (the kernels that know it at compile
     * time), with a divisor that rounds (B = 3) and one that is a power of
     * two (B = 4: one multiply) */
    for (uint32_t b = 3; b <= 4; b++)
        for (int k = 0; k < 3; k++) {
            dc_layer h1[N], d1[N];
            make(h1, d1, N, b, shape, 1718 + 10 * b + (uint64_t)k);
            for (int l = 0; l < N; l++) {
                retype(&d1[l].weight_grad_out, odt[k]);
                if (d1[l].bias_grad_out.data) retype(&d1[l].bias_grad_out, odt[k]);
            }
            long ex1 = 0, tot1 = 0;
            const long bad1 = against_staged(d1, N, b, 0.05f, 0.7f, true, &ex1, &tot1);
            printf("  all %s, B = %u: %ld values, %ld bit-equal, %ld beyond the roundings\n",
                   dc_dtype_name(odt[k]), b, tot1, ex1, bad1);
            assert_int_equal(bad1, 0);
            release(h1, d1, N);
        }
    /* 2. a bound the f16 output cannot hold: 2 B C / B = 8e4 > 65504, while
     * its values (no sample is clipped, no noise) stay small */
    assert_int_equal(against_staged(d, N, B, 40000.0f, 0.0f, false, &exact, &total), 0);

    /* 3. layer 0 kept (f32 output), layer 2 not (the budget holds layer 0
     * only) with an f16 output that the noise (std 1e5 / 3) overflows:
     * the step fails in the output pass, after the kept sum ran */
    dc_layer two[2] = {d[0], d[2]};
    const dcc_linear x0 = lin(&h[0], B);
    const size_t only0 = al256(dcc_sgrad_bytes(&x0));
    for (int zero = 0; zero < 2; zero++) {
        outputs_fill(two, 2, 7.0f);
        assert_true(kept_step(two, 2, B, only0, true, 1e5f, 1.0f, zero) != 0);
        assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), 1);
        assert_outputs_hold(two, 2, zero ? 0.0f : 7.0f);
    }
    printf("a failing step (f16 overflow in a GEMM-path layer) left the kept layer's outputs "
           "untouched, or zeroed with zero_on_fail\n");
    release(h, d, N);
    set_switches(1, 1);
    dc_cuda_backend_set_sample_grads(g_cuda, DC_SAMPLE_GRADS_AUTO);
}

/* The output passes' grid changes no value. A step whose kept layers'
 * outputs the passes skip (mode 1: the kept sum wrote them) among outputs
 * they write, on the blocks that fill the GPU, then on 1 and 3 blocks,
 * which walk many chunks each and jump the kept outputs whole: every value
 * is written and agrees with the first run's (differ). */
static void test_out_blocks(void **state) {
    (void)state;
    enum { N = 4 };
    const uint32_t B = 3;
    const float C = 0.05f, sigma = 0.7f;
    int64_t shape[N][3] = {{64, 136, 264}, {70, 64, 72}, {64, 200, 520}, {65, 72, 264}};
    dc_layer h[N], d[N];
    make(h, d, N, B, shape, 1919);
    const dcc_linear x0 = lin(&h[0], B);
    const size_t only0 = al256(dcc_sgrad_bytes(&x0));
    const int blocks[3] = {0, 1, 3};
    float *ref[2 * N] = {NULL};
    long bad = 0, exact = 0, total = 0;
    for (int r = 0; r < 3; r++) {
        g_out_blocks = blocks[r];
        outputs_fill(d, N, 7.0f);
        assert_int_equal(kept_step(d, N, B, only0, true, C, sigma, false), 0);
        const int kept = dc_cuda_backend_kept_layers(g_cuda);
        assert_true(kept >= 1 && kept < N);
        assert_true(dc_cuda_backend_kept_direct(g_cuda));
        bad += outputs_against(d, N, r, ref, sigma * C / B, &exact, &total);
    }
    printf("output passes on 1 and 3 blocks: %ld values, %ld bit-equal to the full grid's, %ld "
           "beyond the roundings\n",
           total, exact, bad);
    assert_int_equal(bad, 0);
    for (int o = 0; o < 2 * N; o++) free(ref[o]);
    g_out_blocks = 0;
    release(h, d, N);
    set_switches(1, 1);
    dc_cuda_backend_set_sample_grads(g_cuda, DC_SAMPLE_GRADS_AUTO);
}

/* Kept gradients never take the GPU's last tenth of memory: a backend whose
 * workspace must grow to keep them, on a GPU with a little less than a
 * tenth free, runs the step without them (and succeeds); with the memory
 * back, a new backend keeps them. */
static int kept_on_fresh_backend(dc_layer *d, int n, uint32_t B, bool one_pass, size_t *ws) {
    dc_backend *be;
    dc_err err;
    dc_step ds;
    dc_step_result rd;
    assert_int_equal(dc_cuda_backend_create(0, &be, &err), 0);
    assert_int_equal(dc_cuda_backend_set_workspace(be, 0, 0, &err), 0);
    dcc_options o = g_opts;
    o.sgrad = DCC_SGRAD_ALL;
    o.one_pass = one_pass;
    dc_cuda_backend_set_options(be, &o);
    step_init(&ds, d, (size_t)n, B, 0);
    int rc = run(be, &ds, &rd, &err);
    if (rc) fprintf(stderr, "cuda: %s: %s\n", err.field, err.msg);
    assert_int_equal(rc, 0);
    int kept = dc_cuda_backend_kept_layers(be);
    if (ws) *ws = dc_cuda_backend_workspace_bytes(be);
    dc_step_result_free(&rd);
    dc_backend_destroy(be);
    return kept;
}

static void test_keep_leaves_memory_free(void **state) {
    (void)state;
    int64_t shape[2][3] = {{64, 1024, 1024}, {64, 512, 2048}};
    dc_layer h[2], d[2];
    make(h, d, 2, 16, shape, 1616);
    set_switches(1, 1);
    size_t avail, total;
    assert_int_equal(cudaMemGetInfo(&avail, &total), cudaSuccess);
    /* leave 256 MiB less than a tenth: the workspace would fit with the
     * kept gradients (64 MiB, and some MiB of tables), so only
     * the rule, not a failed allocation, leaves them out */
    size_t fill = avail - (total / 10 - ((size_t)256 << 20));
    void *filler = NULL;
    assert_int_equal(cudaMalloc(&filler, fill), cudaSuccess);
    const int full = kept_on_fresh_backend(d, 2, 16, true, NULL);
    assert_int_equal(cudaFree(filler), cudaSuccess);
    const int free_again = kept_on_fresh_backend(d, 2, 16, true, NULL);
    printf("GPU filled to 256 MiB under a tenth free: %d layers kept; memory back: %d\n", full,
           free_again);
    assert_int_equal(full, 0);
    assert_int_equal(free_again, 2);
    release(h, d, 2);
}

/* A one-pass step's kept layers hold no staging of their own (plan_step:
 * their sums go straight to their outputs, or are checked where they are
 * made): a fresh workspace for a step of two kept layers is smaller than
 * the staged step's (one pass off) by at least their outputs' f32 staging.
 * Where the output check cannot prove such a layer's output safe (mode 0),
 * its sum is checked in the kept pass and written after every output's
 * check (test_kept_direct, 2.); a value of its own that leaves its dtype
 * fails the step there, naming that output, and nothing is written (zeros
 * with zero_on_fail). */
static void test_kept_unstaged(void **state) {
    (void)state;
    enum { N = 2 };
    const uint32_t B = 4;
    int64_t shape[N][3] = {{64, 1024, 1024}, {64, 512, 2048}};
    dc_layer h[N], d[N];
    make(h, d, N, B, shape, 1818);
    set_switches(1, 1);
    size_t ws_one = 0, ws_staged = 0, staging = 0;
    assert_int_equal(kept_on_fresh_backend(d, N, B, true, &ws_one), N);
    assert_int_equal(kept_on_fresh_backend(d, N, B, false, &ws_staged), N);
    for (int l = 0; l < N; l++)
        staging += (size_t)(numel(&d[l].weight_grad_out) +
                            (d[l].bias_grad_out.data ? numel(&d[l].bias_grad_out) : 0)) *
                   4;
    printf("workspace of a step of %d kept layers: %zu bytes in one pass, %zu staged (their "
           "staging %zu)\n",
           N, ws_one, ws_staged, staging);
    assert_true(ws_staged >= ws_one + staging);

    /* 2. layer 1 alone, its weight output f16, noise std 1e5 / B: its
     * bound 2 B C / B = 2e5 puts the step in mode 0, and its own values
     * overflow f16 (|z| > 2.6: about 1% of its 1M elements) */
    retype(&d[1].weight_grad_out, DC_F16);
    for (int zero = 0; zero < 2; zero++) {
        outputs_fill(&d[1], 1, 7.0f);
        set_switches(1, 1);
        g_opts.sgrad = DCC_SGRAD_ALL;
        apply_switches();
        dc_cuda_backend_set_sample_grads(g_cuda, DC_SAMPLE_GRADS_AUTO);
        dc_step ds;
        dc_step_result rd;
        dc_err ed;
        mean_init(&ds, &d[1], 1, B, 1e5f, 1.0f, zero);
        const int rc = run(g_cuda, &ds, &rd, &ed);
        printf("  zero_on_fail %d: %s: %s\n", zero, ed.field, ed.msg);
        assert_int_equal(rc, DC_ENONFINITE);
        assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), 1);
        char want[160];
        snprintf(want, sizeof want, "%s.weight_grad_out", h[1].name);
        assert_string_equal(ed.field, want);
        assert_non_null(strstr(ed.msg, "f16"));
        assert_outputs_hold(&d[1], 1, zero ? 0.0f : 7.0f);
        dc_step_result_free(&rd);
    }
    release(h, d, N);
    set_switches(1, 1);
}

/* A logical step of M micro-batches over layers d (kept: DPCLIP_CUDA_SGRAD
 * =all), into accumulators the caller set, one pass on or off: FIRST, ADD,
 * then the COMMIT of a MEAN step over the M B samples; every micro-batch
 * keeps all n layers. Returns the commit's code (*e its error). */
enum { KL_M = 3 };
static int kept_logical(dc_layer *d, int n, uint32_t B, bool one_pass, float C, float sigma,
                        bool zero_on_fail, dc_err *e) {
    set_switches(1, 1);
    g_opts.sgrad = DCC_SGRAD_ALL;
    g_opts.one_pass = one_pass;
    apply_switches();
    dc_cuda_backend_set_sample_grads(g_cuda, DC_SAMPLE_GRADS_AUTO);
    int rc = 0;
    for (int k = 0; k < KL_M; k++) {
        dc_step ds;
        dc_step_result rd;
        mean_init(&ds, d, n, B, C, sigma, zero_on_fail);
        ds.expected_batch = KL_M * B;
        ds.noise_step = 7;
        ds.acc = k == 0 ? DC_ACC_FIRST : k < KL_M - 1 ? DC_ACC_ADD : DC_ACC_COMMIT;
        rc = run(g_cuda, &ds, &rd, e);
        dc_step_result_free(&rd);
        assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), n);
        if (k < KL_M - 1) assert_int_equal(rc, 0);
    }
    return rc;
}

/* A logical step's kept layers have no staging either: each micro-batch's
 * kept sum sets or adds to their accumulators itself, and the commit's adds
 * them after its noise, checks and writes its outputs as a step's in mode
 * 0 (sgrad.cu). Its outputs, in every dtype, are the staged path's (one
 * pass off: every output staged, dcc_acc_store / dcc_acc_fold) within the
 * roundings two runs may differ by; a commit whose kept f16 output the
 * noise overflows fails naming it, writing nothing (zeros with
 * zero_on_fail). */
static void test_kept_logical(void **state) {
    (void)state;
    enum { N = 3 };
    const uint32_t B = 4;
    int64_t shape[N][3] = {{64, 136, 264}, {70, 64, 72}, {64, 200, 520}};
    const dc_dtype odt[N] = {DC_F32, DC_BF16, DC_F16};
    dc_layer h[N], d[N];
    make(h, d, N, B, shape, 2020);
    float *acc[N][2] = {{NULL}};
    for (int l = 0; l < N; l++) {
        retype(&d[l].weight_grad_out, odt[l]);
        if (d[l].bias_grad_out.data) retype(&d[l].bias_grad_out, DC_F32);
        for (int k = 0; k < 2; k++) {
            const dc_tensor *t = k ? &d[l].bias_grad_out : &d[l].weight_grad_out;
            if (!t->data) continue;
            acc[l][k] = g_cuda->ops->acc_alloc(g_cuda, (size_t)numel(t));
            assert_non_null(acc[l][k]);
        }
        d[l].acc_w = acc[l][0];
        d[l].acc_b = acc[l][1];
    }
    const float C = 0.05f, sigma = 0.7f;
    float *got[2 * N] = {NULL};
    long exact = 0, total = 0, bad = 0;
    dc_err e;
    for (int pass = 0; pass < 2; pass++) { /* one pass (unstaged), then staged */
        outputs_fill(d, N, 7.0f);
        const int rc = kept_logical(d, N, B, pass == 0, C, sigma, false, &e);
        if (rc) printf("  commit: %s: %s\n", e.field, e.msg);
        assert_int_equal(rc, 0);
        bad += outputs_against(d, N, pass, got, sigma * C / (KL_M * B), &exact, &total);
    }
    printf("a logical step of %d micro-batches, kept layers unstaged against staged: %ld values, "
           "%ld bit-equal, %ld beyond the roundings\n",
           KL_M, total, exact, bad);
    assert_int_equal(bad, 0);
    for (int o = 0; o < 2 * N; o++) free(got[o]);

    /* 2. C = 1e6: the f16 weight's noise (std 1e6 / 12) overflows it */
    for (int zero = 0; zero < 2; zero++) {
        outputs_fill(d, N, 7.0f);
        const int rc = kept_logical(d, N, B, true, 1e6f, 1.0f, zero, &e);
        printf("  zero_on_fail %d: %s: %s\n", zero, e.field, e.msg);
        assert_int_equal(rc, DC_ENONFINITE);
        char want[160];
        snprintf(want, sizeof want, "%s.weight_grad_out", h[2].name);
        assert_string_equal(e.field, want);
        assert_outputs_hold(d, N, zero ? 0.0f : 7.0f);
    }
    for (int l = 0; l < N; l++)
        for (int k = 0; k < 2; k++)
            if (acc[l][k]) g_cuda->ops->acc_free(g_cuda, acc[l][k]);
    release(h, d, N);
    set_switches(1, 1);
}

/* gpu.sample_grads_max = auto, a fresh backend's default: an eighth of the
 * device's memory (DC_SAMPLE_GRADS_PARTS), read from the device; a size
 * and 0 stay as given. */
static void test_budget_auto(void **state) {
    (void)state;
    dc_backend *be;
    dc_err err;
    size_t avail, total;
    assert_int_equal(dc_cuda_backend_create(0, &be, &err), 0);
    assert_int_equal(cudaMemGetInfo(&avail, &total), cudaSuccess);
    const uint64_t want = (uint64_t)total / DC_SAMPLE_GRADS_PARTS;
    printf("auto: %llu of %zu bytes\n", (unsigned long long)dc_cuda_backend_sample_grads(be),
           total);
    assert_true(want > 0 && dc_cuda_backend_sample_grads(be) == want);
    dc_cuda_backend_set_sample_grads(be, 0);
    assert_true(dc_cuda_backend_sample_grads(be) == 0);
    dc_cuda_backend_set_sample_grads(be, (uint64_t)3 << 30);
    assert_true(dc_cuda_backend_sample_grads(be) == (uint64_t)3 << 30);
    dc_cuda_backend_set_sample_grads(be, DC_SAMPLE_GRADS_AUTO);
    assert_true(dc_cuda_backend_sample_grads(be) == want);
    dc_backend_destroy(be);
}

/* The cost model (dcc_sgrad_worth) on the shapes it was measured for, and
 * the default mode keeping only the layers it picks. */
static void test_keep_worth(void **state) {
    (void)state;
    /* GPT-2-small, T = 1024, direct norms: kept */
    assert_true(dcc_sgrad_worth(1024, 768, 3072, DC_ALGO_DIRECT));
    assert_true(dcc_sgrad_worth(1024, 3072, 768, DC_ALGO_DIRECT));
    /* short samples: the GEMM is cheaper than the bytes */
    assert_false(dcc_sgrad_worth(64, 768, 3072, DC_ALGO_DIRECT));
    assert_false(dcc_sgrad_worth(256, 4096, 4096, DC_ALGO_DIRECT));
    /* Llama-1B's MLP at T = 2048 (ghost norms alone): kept, its norms direct */
    assert_true(dcc_sgrad_worth(2048, 2048, 8192, DC_ALGO_GHOST));
    /* ghost norms far cheaper than the bytes: not kept */
    assert_false(dcc_sgrad_worth(128, 4096, 4096, DC_ALGO_GHOST));

    int64_t shape[2][3] = {{64, 64, 72}, {512, 128, 136}};
    dc_layer h[2], d[2];
    make(h, d, 2, 2, shape, 1414);
    set_switches(1, 1);
    g_opts.sgrad = DCC_SGRAD_AUTO;
    apply_switches();
    dc_step ds;
    dc_step_result rd;
    dc_err ed;
    step_init(&ds, d, 2, 2, 0);
    assert_int_equal(run(g_cuda, &ds, &rd, &ed), 0);
    assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), 1);
    dc_step_result_free(&rd);
    release(h, d, 2);
    set_switches(1, 1);
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kept_layers),   cmocka_unit_test(test_kept_many_samples),
        cmocka_unit_test(test_kept_noise),    cmocka_unit_test(test_kept_direct),
        cmocka_unit_test(test_out_blocks),    cmocka_unit_test(test_keep_worth),
        cmocka_unit_test(test_budget_auto),   cmocka_unit_test(test_keep_leaves_memory_free),
        cmocka_unit_test(test_kept_unstaged), cmocka_unit_test(test_kept_logical),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup_gpu_bounds, cuda_test_teardown);
}
