#include "accountant.h"

#include <math.h>

static double g_orders[DC_RDP_N_ORDERS];
static int g_orders_ready;

const double *dc_rdp_default_orders(void) {
    /* Idempotent and the same values on every call: a benign first-use
     * initialisation even if two threads race on it. */
    if (!g_orders_ready) {
        int k = 0;
        for (int x = 1; x <= 99; x++) g_orders[k++] = 1.0 + x / 10.0;
        for (int a = 12; a <= 63; a++) g_orders[k++] = (double)a;
        g_orders_ready = 1;
    }
    return g_orders;
}

/* --- log-space arithmetic -------------------------------------------------- */

static double log_add(double x, double y) {
    double a = x < y ? x : y, b = x < y ? y : x;
    if (a == -INFINITY) return b;
    return log1p(exp(a - b)) + b;
}

/* log(e^x - e^y); NaN when y > x (the series lost its precision: the caller
 * then reports that order as unusable, and the conversion skips it). */
static double log_sub(double x, double y) {
    if (x < y) return NAN;
    if (y == -INFINITY) return x;
    /* x + log(1 - e^(y-x)): no overflow however far apart x and y are. */
    return x + log1p(-exp(y - x));
}

double dc_rdp_log_erfc(double x) {
    /* erfc is accurate to the last bits until it turns subnormal (x ~ 26.5);
     * past that, the asymptotic series of erfc(x) x sqrt(pi) e^(x^2), whose
     * terms fall by (2k-1)/(2x^2) < 1/20 each: 12 terms reach 1e-17. */
    if (x < 26.0) return log(erfc(x));
    double inv2x2 = 1.0 / (2.0 * x * x), t = 1.0, s = 1.0;
    for (int k = 1; k <= 12; k++) {
        t *= -(2.0 * k - 1.0) * inv2x2;
        s += t;
    }
    return -x * x - log(x) - 0.5 * log(M_PI) + log(s);
}

/* --- log(A_alpha) ----------------------------------------------------------- */

static double log_a_int(double q, double sigma, int alpha) {
    double log_a = -INFINITY, lq = log(q), l1q = log1p(-q), s2 = 2.0 * sigma * sigma;
    double lg_a1 = lgamma(alpha + 1.0);
    for (int i = 0; i <= alpha; i++) {
        double log_binom = lg_a1 - lgamma(i + 1.0) - lgamma(alpha - i + 1.0);
        double s = log_binom + i * lq + (alpha - i) * l1q + ((double)i * i - i) / s2;
        log_a = log_add(log_a, s);
    }
    return log_a;
}

static int log_a_frac(double q, double sigma, double alpha, size_t max_terms, double *out) {
    double log_a0 = -INFINITY, log_a1 = -INFINITY;
    double lq = log(q), l1q = log1p(-q), s2 = 2.0 * sigma * sigma;
    double z0 = sigma * sigma * log(1.0 / q - 1.0) + 0.5;
    double rs = 1.0 / (M_SQRT2 * sigma);
    /* |C(alpha, i)| and its sign, by the recurrence
     * C(alpha, i) = C(alpha, i-1) (alpha - i + 1) / i, in log space. */
    double log_coef = 0.0;
    int sign = 1;

    for (size_t n = 0; n < max_terms; n++) {
        double i = (double)n, j = alpha - i;
        if (n > 0) {
            double f = alpha - i + 1.0;
            log_coef += log(fabs(f)) - log(i);
            if (f < 0) sign = -sign;
        }
        double log_t0 = log_coef + i * lq + j * l1q;
        double log_t1 = log_coef + j * lq + i * l1q;
        double log_e0 = log(0.5) + dc_rdp_log_erfc((i - z0) * rs);
        double log_e1 = log(0.5) + dc_rdp_log_erfc((z0 - j) * rs);
        double log_s0 = log_t0 + (i * i - i) / s2 + log_e0;
        double log_s1 = log_t1 + (j * j - j) / s2 + log_e1;
        if (sign > 0) {
            log_a0 = log_add(log_a0, log_s0);
            log_a1 = log_add(log_a1, log_s1);
        } else {
            log_a0 = log_sub(log_a0, log_s0);
            log_a1 = log_sub(log_a1, log_s1);
        }
        if (isnan(log_a0) || isnan(log_a1)) return -1;
        if (fmax(log_s0, log_s1) < -30.0) {
            *out = log_add(log_a0, log_a1);
            return 0;
        }
    }
    return -1; /* did not converge */
}

int dc_rdp_log_a_series(double q, double sigma, double alpha, size_t max_terms, double *out) {
    return log_a_frac(q, sigma, alpha, max_terms, out);
}

double dc_rdp_log_a(double q, double sigma, double alpha) {
    double lo, t, r;
    if (alpha == floor(alpha) && alpha < 1e6) return log_a_int(q, sigma, (int)alpha);
    if (log_a_frac(q, sigma, alpha, DC_RDP_SERIES_MAX, &r) == 0) return r;
    if (!(alpha < 1e6)) return NAN;
    /* The chord of the convex log(A) between floor and ceil: above the
     * curve between them. log(A_1) = log(1) = 0. */
    lo = floor(alpha);
    t = alpha - lo;
    r = lo >= 2.0 ? (1.0 - t) * log_a_int(q, sigma, (int)lo) : 0.0;
    return r + t * log_a_int(q, sigma, (int)lo + 1);
}

double dc_rdp_step(double q, double sigma, double alpha) {
    if (!(q >= 0.0 && q <= 1.0) || !(sigma >= 0.0) || !(alpha > 1.0)) return NAN;
    if (q == 0.0) return 0.0;
    if (sigma == 0.0) return INFINITY;
    if (q == 1.0) return alpha / (2.0 * sigma * sigma);
    if (isinf(alpha)) return INFINITY;
    return dc_rdp_log_a(q, sigma, alpha) / (alpha - 1.0);
}

void dc_rdp_steps(double q, double sigma, const double *orders, size_t n, double *out) {
    for (size_t k = 0; k < n; k++) out[k] = dc_rdp_step(q, sigma, orders[k]);
}

double dc_rdp_epsilon(const double *orders, const double *rdp, size_t n, double delta,
                      double *best) {
    double eps = INFINITY, at = NAN, ld = log(delta);
    for (size_t k = 0; k < n; k++) {
        double a = orders[k];
        double e = rdp[k] - (ld + log(a)) / (a - 1.0) + log((a - 1.0) / a);
        if (isnan(e)) continue;
        if (e < eps) {
            eps = e;
            at = a;
        }
    }
    if (best) *best = at;
    return eps < 0.0 ? 0.0 : eps;
}
