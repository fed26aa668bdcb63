/* The RDP accountant (daemon/privacy/accountant.c) against reference values.
 *
 * Where each number comes from:
 *  [TFP] TensorFlow Privacy, tensorflow_privacy/privacy/analysis/
 *        rdp_accountant_test.py (test_compute_rdp_no_data, _no_sampling,
 *        _scalar, _sequence, test_get_privacy_spent_check_target_delta).
 *  [OPA] Opacus, opacus/tests/accountants_test.py, test_rdp_accountant:
 *        sigma 1.5, q 0.04, int(90/0.04) = 2250 steps, delta 1e-5 over the
 *        default orders -> eps 7.32911117143 (assertAlmostEqual: 7 places).
 *  [OPD] Opacus, opacus/accountants/analysis/rdp.py module docstring:
 *        [(1e-5, 1.0, 10), (1e-4, 3.0, 4)], orders 2..32, delta 1e-5 ->
 *        (0.336, 23) (doctest +NUMBER: 3 decimals).
 *  [MP]  tests/accountant_ref.py: an independent 50-digit computation with
 *        mpmath that integrates A_alpha numerically (fractional orders) or
 *        sums the binomial expansion exactly (integer orders), then composes
 *        and converts the same way. Run it to regenerate. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cmocka.h>

#include "accountant.h"

static void assert_close(double got, double want, double rtol, double atol, const char *what) {
    double tol = atol + rtol * fabs(want);
    if (!(fabs(got - want) <= tol)) {
        fprintf(stderr, "%s: got %.17g, want %.17g (tolerance %.3g)\n", what, got, want, tol);
        fail();
    }
}

static void test_default_orders(void **state) {
    const double *o = dc_rdp_default_orders();
    (void)state;
    /* [1 + x/10 for x in 1..99] + [12..63], as Opacus' DEFAULT_ALPHAS */
    assert_close(o[0], 1.1, 0, 1e-15, "first order");
    assert_close(o[98], 10.9, 0, 1e-12, "last fractional order");
    assert_true(o[99] == 12.0 && o[DC_RDP_N_ORDERS - 1] == 63.0);
    for (int k = 1; k < DC_RDP_N_ORDERS; k++) assert_true(o[k] > o[k - 1]);
}

static void test_tf_privacy_values(void **state) {
    static const double orders[] = {1.5, 2.5, 5, 50, 100};
    static const double want[] = {0.00065, 0.001085, 0.00218075, 0.023846, 167.416307};
    (void)state;
    /* [TFP] test_compute_rdp_no_data / _no_sampling */
    assert_true(dc_rdp_step(0, 10, 20) == 0.0);
    assert_close(dc_rdp_step(1, 10, 20), 0.1, 1e-15, 0, "q=1");
    /* [TFP] test_compute_rdp_scalar: compute_rdp(0.1, 2, 10 steps, order 5) */
    assert_close(10 * dc_rdp_step(0.1, 2, 5), 0.07737, 0, 0.5e-5, "scalar");
    /* [TFP] test_compute_rdp_sequence: q 0.01, sigma 2.5, 50 steps, delta 1e-5 abs */
    for (int k = 0; k < 5; k++)
        assert_close(50 * dc_rdp_step(0.01, 2.5, orders[k]), want[k], 0, 1e-5, "sequence");
    assert_true(isinf(dc_rdp_step(0.01, 2.5, INFINITY)));
    /* no noise: no privacy */
    assert_true(isinf(dc_rdp_step(0.01, 0.0, 2.0)));
    assert_true(isnan(dc_rdp_step(1.5, 1.0, 2.0)) && isnan(dc_rdp_step(0.1, 1.0, 1.0)));
}

static void test_log_a_against_integration(void **state) {
    /* [MP] q, sigma, alpha, log(A_alpha): the fractional orders by numerical
     * integration, the integer ones by the exact sum. The first five and the
     * integer ones are TF Privacy's test_compute_log_a_equals_mp cases,
     * which TFP checks to rtol 1e-4; we hold the series to 1e-6 (the tiny-q
     * case loses ~1e-14 absolute to cancellation near log(1), as TFP's
     * series does). */
    static const double cases[][4] = {
        {1e-07, 0.1, 1.01, 4.0034123225263986e-8}, {1e-05, 0.1, 256.1, 3263607.0397884213},
        {0.0001, 1, 1.5, 6.4426869538366497e-9},   {0.1, 100, 20.5, 0.00019991818458068296},
        {0.999, 100, 256.1, 3.2601080379731127},   {0.01, 1.1, 3.7, 0.00066227685135477125},
        {0.04, 1.5, 7.3, 0.023960807433380018},    {0.3, 0.8, 2.5, 0.72165454849659227},
        {0.01, 2.5, 1.5, 6.5007089718803974e-6},   {1e-06, 0.1, 256, 3260463.2292971608},
        {1e-06, 1, 27, 8.7695113048484979e-10},    {0.001, 1, 2, 1.7182803522145154e-6},
        {0.01, 10, 20, 0.00019129699912842963},    {0.99, 0.1, 256, 3263997.4271140211},
        {0.02, 0.9, 63, 2164.6536617691378},
    };
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char what[96];
        snprintf(what, sizeof what, "log A(q=%g, sigma=%g, alpha=%g)", cases[i][0], cases[i][1],
                 cases[i][2]);
        assert_close(dc_rdp_log_a(cases[i][0], cases[i][1], cases[i][2]), cases[i][3], 1e-6, 1e-13,
                     what);
    }
}

static void test_log_erfc(void **state) {
    (void)state;
    /* Continuity where the implementation switches to the asymptotic series,
     * and agreement with log(erfc) where erfc is still normal. */
    assert_close(dc_rdp_log_erfc(25.999999), dc_rdp_log_erfc(26.000001), 0, 1e-3, "switch");
    assert_close(dc_rdp_log_erfc(26.0), log(erfc(26.0)), 1e-13, 0, "at 26");
    assert_close(dc_rdp_log_erfc(-3.0), log(erfc(-3.0)), 1e-15, 0, "negative");
    /* Far out, erfc underflows but the log is finite: -x^2 - log(x sqrt(pi)) + O(1/x^2) */
    assert_close(dc_rdp_log_erfc(1000.0), -1e6 - log(1000.0 * sqrt(M_PI)) - 0.5e-6, 1e-15, 0,
                 "x=1000");
}

static double eps_for(double q, double sigma, double steps, double delta, double *best) {
    double rdp[DC_RDP_N_ORDERS];
    const double *o = dc_rdp_default_orders();
    dc_rdp_steps(q, sigma, o, DC_RDP_N_ORDERS, rdp);
    for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] *= steps;
    return dc_rdp_epsilon(o, rdp, DC_RDP_N_ORDERS, delta, best);
}

static void test_opacus_epsilon(void **state) {
    double best;
    (void)state;
    /* [OPA] */
    assert_close(eps_for(0.04, 1.5, 2250, 1e-5, &best), 7.32911117143, 0, 0.5e-7, "opacus");
    /* [MP] the same, and three more settings; the optimal order too */
    assert_close(eps_for(0.04, 1.5, 2250, 1e-5, &best), 7.3291111714841742, 1e-9, 0, "mp 1");
    assert_true(best == 3.9);
    assert_close(eps_for(0.01, 1.1, 10000, 1e-5, &best), 5.6319923686818018, 1e-9, 0, "mp 2");
    assert_true(fabs(best - 4.7) < 1e-12);
    assert_close(eps_for(0.001, 0.7, 5000, 1e-6, &best), 2.2907782594596503, 1e-9, 0, "mp 3");
    assert_true(fabs(best - 6.3) < 1e-12);
    assert_close(eps_for(0.25, 3, 40, 1e-5, &best), 2.5695173756704486, 1e-9, 0, "mp 4");
    assert_true(fabs(best - 7.8) < 1e-12);
}

static void test_conversion(void **state) {
    double orders[31], rdp[31], best;
    (void)state;
    /* [TFP] test_get_privacy_spent_check_target_delta: constant RDP 1.1 on
     * orders 2..32 at delta 1e-5 picks order 32 and eps 1.32783806176. */
    for (int k = 0; k < 31; k++) {
        orders[k] = 2 + k;
        rdp[k] = 1.1;
    }
    assert_close(dc_rdp_epsilon(orders, rdp, 31, 1e-5, &best), 1.32783806176, 0, 0.5e-7,
                 "constant rdp");
    assert_true(best == 32.0);

    /* [OPD] two kinds of steps composed, orders 2..32. */
    for (int k = 0; k < 31; k++)
        rdp[k] = 10 * dc_rdp_step(1e-5, 1.0, orders[k]) + 4 * dc_rdp_step(1e-4, 3.0, orders[k]);
    assert_close(dc_rdp_epsilon(orders, rdp, 31, 1e-5, &best), 0.336, 0, 0.5e-3, "docstring");
    assert_true(best == 23.0);

    /* No noise at all: infinite, with no order attaining it. */
    for (int k = 0; k < 31; k++) rdp[k] = INFINITY;
    assert_true(isinf(dc_rdp_epsilon(orders, rdp, 31, 1e-5, &best)) && isnan(best));
}

static void test_gaussian_fine_orders(void **state) {
    /* [TFP] test_get_privacy_spent_check_target_delta, second part: the
     * Gaussian mechanism without sampling at sigma 4.530877117 is exactly
     * (1, 1e-6)-DP; on the fine orders 1.000..99.999 the conversion gets
     * eps = 1 to 7 places. */
    static double orders[98999], rdp[98999];
    size_t n = 0;
    (void)state;
    for (int i = 1001; i < 100000; i++) orders[n++] = 0.001 * i;
    dc_rdp_steps(1.0, 4.530877117, orders, n, rdp);
    assert_close(dc_rdp_epsilon(orders, rdp, n, 1e-6, NULL), 1.0, 0, 0.5e-7, "gaussian");
}

static void test_monotone(void **state) {
    (void)state;
    /* More steps, a larger sample rate or less noise never cost less. */
    double a = eps_for(0.01, 1.0, 100, 1e-5, NULL), b = eps_for(0.01, 1.0, 200, 1e-5, NULL);
    double c = eps_for(0.02, 1.0, 100, 1e-5, NULL), d = eps_for(0.01, 0.8, 100, 1e-5, NULL);
    assert_true(a > 0 && b > a && c > a && d > a);
    /* a smaller delta costs more */
    assert_true(eps_for(0.01, 1.0, 100, 1e-7, NULL) > a);
}

static void test_epsilon_never_negative(void **state) {
    double rdp[DC_RDP_N_ORDERS], best;
    const double *o = dc_rdp_default_orders();
    (void)state;
    /* A large delta and a tiny spend: the conversion's formula goes below 0
     * (-0.69 here). Any mechanism with a negative bound is (0, delta)-DP, so
     * 0 is what is reported, never a negative epsilon. */
    dc_rdp_steps(1e-4, 2.0, o, DC_RDP_N_ORDERS, rdp);
    assert_true(dc_rdp_epsilon(o, rdp, DC_RDP_N_ORDERS, 0.5, &best) == 0.0);
    assert_false(isnan(best));
    for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] = 0.0;
    assert_true(dc_rdp_epsilon(o, rdp, DC_RDP_N_ORDERS, 1e-5, NULL) >= 0.0);
    /* where the formula is positive it is reported as it is */
    dc_rdp_steps(1e-4, 2.0, o, DC_RDP_N_ORDERS, rdp);
    assert_true(dc_rdp_epsilon(o, rdp, DC_RDP_N_ORDERS, 1e-5, NULL) > 0.0);
}

/* The fractional orders' series is cut at DC_RDP_SERIES_MAX terms; where it
 * has not converged by then (q = 0.5 needs up to ~270000 terms, 47 ms a
 * curve), log(A) is bounded from above by the chord between the
 * neighbouring integer orders (log A is convex in alpha). [MP] values by
 * numerical integration: the bound is never below them, and no worse than
 * the next integer order; the long series itself even overshoots at
 * sigma = 1e6 (1.1e-13 for a true 1.4e-14: cancellation over 10^5 terms). */
static void test_series_bound(void **state) {
    static const double cases[][4] = {
        {0.5, 1e+06, 1.1, 1.3750000000002076e-14}, {0.5, 1e+06, 2.5, 4.6875000000023437e-13},
        {0.5, 1000, 2.2, 3.3000014025003115e-7},   {0.5, 1, 1.3, 0.058135710707566645},
        {0.5, 10, 1.6, 0.0012033016976809444},     {0.3, 0.5, 1.1, 0.037294843305469452},
        {0.5, 1, 1.5, 0.11757901724126551},
    };
    double full;
    int bounded = 0;
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double q = cases[i][0], sigma = cases[i][1], alpha = cases[i][2], want = cases[i][3];
        double got = dc_rdp_log_a(q, sigma, alpha), up = ceil(alpha);
        char what[96];
        snprintf(what, sizeof what, "log A(q=%g, sigma=%g, alpha=%g)", q, sigma, alpha);
        if (dc_rdp_log_a_series(q, sigma, alpha, DC_RDP_SERIES_MAX, &full) == 0) {
            /* converged within the cap: the series, as accurate as ever */
            assert_true(got == full);
            assert_close(got, want, 1e-6, 1e-13, what);
            continue;
        }
        bounded++;
        if (!(got >= want && isfinite(got))) {
            fprintf(stderr, "%s: %.17g is below the true %.17g\n", what, got, want);
            fail();
        }
        assert_true(got / (alpha - 1.0) <= dc_rdp_log_a(q, sigma, up) / (up - 1.0) * (1.0 + 1e-12));
    }
    assert_true(bounded >= 6); /* all but the last need more terms than the cap */
    /* Opacus' settings converge well within the cap: the series as before. */
    for (double q = 1e-4; q <= 0.1; q *= 3)
        for (double sigma = 0.5; sigma <= 20; sigma *= 1.7)
            for (int x = 1; x <= 99; x += 7)
                assert_int_equal(
                    dc_rdp_log_a_series(q, sigma, 1 + x / 10.0, DC_RDP_SERIES_MAX, &full), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_orders),
        cmocka_unit_test(test_tf_privacy_values),
        cmocka_unit_test(test_log_a_against_integration),
        cmocka_unit_test(test_log_erfc),
        cmocka_unit_test(test_opacus_epsilon),
        cmocka_unit_test(test_conversion),
        cmocka_unit_test(test_gaussian_fine_orders),
        cmocka_unit_test(test_monotone),
        cmocka_unit_test(test_epsilon_never_negative),
        cmocka_unit_test(test_series_bound),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
