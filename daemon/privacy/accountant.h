/* RDP accountant for the Poisson-subsampled Gaussian mechanism (DP-SGD).
 *
 * One application of the mechanism: each sample enters the batch with
 * probability q (sample rate), the clipped sum (sensitivity C) gets
 * N(0, sigma^2 C^2) noise. Its Renyi DP at order alpha is
 *     rdp(alpha) = log(A_alpha) / (alpha - 1)
 * with A_alpha from Mironov, Talwar, Zhang 2019, "Renyi Differential Privacy
 * of the Sampled Gaussian Mechanism" (arXiv:1908.10530), section 3.3:
 *   - integer alpha: the binomial expansion
 *       A = sum_{i=0..alpha} C(alpha,i) (1-q)^(alpha-i) q^i exp((i^2-i)/(2 sigma^2)),
 *     summed in log space;
 *   - fractional alpha: the two series split at z0 = sigma^2 log(1/q - 1) + 1/2,
 *     with log-erfc terms, summed in log space until the terms are < e^-30,
 *     or at most DC_RDP_SERIES_MAX terms: where it has not converged by then
 *     (q near 1/2 with a huge sigma needs ~10^5 terms, 47 ms a curve), log(A)
 *     is bounded from above by the chord between the neighbouring integer
 *     orders, as log(A_alpha) is convex in alpha (a cumulant generating
 *     function). The result is then a little larger, never smaller: a valid
 *     bound on epsilon, at a bounded cost.
 * RDP composes by addition over steps. Conversion to (eps, delta) uses the
 * tighter bound of Balle et al. 2020 (arXiv:1905.09982, Thm 21), as Opacus
 * does:
 *     eps = min_alpha  rdp(alpha) - (log(delta) + log(alpha)) / (alpha - 1)
 *                      + log((alpha - 1) / alpha).
 *
 * Everything here is pure math (no allocation, no state): thread-safe. */
#ifndef DC_ACCOUNTANT_H
#define DC_ACCOUNTANT_H

#include <stddef.h>

/* Opacus' default orders: 1 + x/10 for x in 1..99, then 12..63 (151). */
#define DC_RDP_N_ORDERS 151
/* Terms of a fractional order's series before the bound above is used:
 * Opacus' settings (q <= 0.1, sigma >= 0.5) converge within ~2200. */
#define DC_RDP_SERIES_MAX 2500

/* The default orders, ascending. */
const double *dc_rdp_default_orders(void);

/* RDP of ONE step at order alpha > 1: 0 when q == 0, +inf when sigma == 0
 * (no noise: no privacy), alpha / (2 sigma^2) when q == 1. Returns NaN for
 * arguments outside q in [0, 1], sigma >= 0, alpha > 1. */
double dc_rdp_step(double q, double sigma, double alpha);

/* out[k] = dc_rdp_step(q, sigma, orders[k]) for k < n. */
void dc_rdp_steps(double q, double sigma, const double *orders, size_t n, double *out);

/* log(erfc(x)), accurate where erfc(x) itself underflows (x > ~26). */
double dc_rdp_log_erfc(double x);

/* log(A_alpha) of one step (exposed for the tests, which compare it with a
 * numerical integration). 0 < q < 1, sigma > 0, alpha > 1. */
double dc_rdp_log_a(double q, double sigma, double alpha);
/* The fractional series alone, cut at max_terms: 0 and *out when it
 * converged, -1 when not (or it lost its precision). */
int dc_rdp_log_a_series(double q, double sigma, double alpha, size_t max_terms, double *out);

/* The (eps, delta) conversion above over n orders with accumulated RDP
 * rdp[k]: returns eps (+inf when every order is infinite) and, if best is
 * non-NULL, the order that attains it (NaN when none does). delta in (0, 1).
 * Never negative: where the formula goes below 0 (a tiny spend at a large
 * delta), the mechanism is (0, delta)-DP and 0 is returned. */
double dc_rdp_epsilon(const double *orders, const double *rdp, size_t n, double delta,
                      double *best);

#endif
