#!/usr/bin/env python3
"""Independent reference values for tests/test_accountant.c.

The daemon computes log(A_alpha) of the Poisson-subsampled Gaussian with the
series of Mironov et al. 2019 (binomial expansion for integer orders, two
log-erfc series for fractional ones). This script gets the same quantities a
different way, by numerical integration of the definition in 50-digit
arithmetic (mpmath):

    A_alpha = integral over z of mu0(z) * (mu(z) / mu0(z))^alpha,
    mu0 = N(0, sigma^2),  mu = (1 - q) N(0, sigma^2) + q N(1, sigma^2),

(the same check TF Privacy's rdp_accountant_test.py uses), then composes over
steps and converts to (eps, delta) with Balle et al. 2020, Thm 21. It prints
the numbers pasted into the C test. Needs python3-mpmath only.

    python3 tests/accountant_ref.py
"""
import mpmath as mp

mp.mp.dps = 50


def log_a_integral(q, sigma, alpha):
    q, sigma, alpha = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)

    def f(z):
        ratio = (1 - q) + q * mp.exp((2 * z - 1) / (2 * sigma**2))
        return mp.npdf(z, 0, sigma) * ratio**alpha

    # The integrand peaks near alpha/sigma^2-ish shifts of the two Gaussians:
    # give quad breakpoints around where the mass is so it does not miss it.
    pts = sorted(set([-mp.inf, -40 * sigma, -10 * sigma, 0, mp.mpf(1) / 2, 1,
                      alpha, 10 * sigma, 40 * sigma + alpha, mp.inf]))
    return mp.log(mp.quad(f, pts, maxdegree=10))


def log_a_binomial(q, sigma, alpha):
    """Integer alpha: the exact finite sum, in 50 digits (no log tricks)."""
    q, sigma = mp.mpf(q), mp.mpf(sigma)
    s = mp.mpf(0)
    for i in range(int(alpha) + 1):
        s += mp.binomial(alpha, i) * (1 - q)**(alpha - i) * q**i * \
            mp.exp((i * i - i) / (2 * sigma**2))
    return mp.log(s)


def rdp(q, sigma, alpha):
    if q == 0:
        return mp.mpf(0)
    if q == 1:
        return mp.mpf(alpha) / (2 * mp.mpf(sigma)**2)
    la = log_a_binomial(q, sigma, alpha) if float(alpha).is_integer() \
        else log_a_integral(q, sigma, alpha)
    return la / (mp.mpf(alpha) - 1)


def eps_of(orders, rdps, delta):
    best = None
    for a, r in zip(orders, rdps):
        a = mp.mpf(a)
        e = r - (mp.log(delta) + mp.log(a)) / (a - 1) + mp.log((a - 1) / a)
        if best is None or e < best[0]:
            best = (e, a)
    return best


DEFAULT_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))

if __name__ == "__main__":
    print("# log(A_alpha): integration (fractional) / exact sum (integer)")
    for q, sigma, alpha in [(1e-7, .1, 1.01), (1e-5, .1, 256.1), (1e-4, 1., 1.5),
                            (.1, 100, 20.5), (.999, 100, 256.1), (0.01, 1.1, 3.7),
                            (0.04, 1.5, 7.3), (0.3, 0.8, 2.5), (0.01, 2.5, 1.5),
                            (1e-6, .1, 256), (1e-6, 1, 27), (1e-3, 1., 2),
                            (.01, 10, 20), (.99, .1, 256), (0.02, 0.9, 63)]:
        print("{%g, %g, %g, %s}," % (q, sigma, alpha,
                                     mp.nstr(rdp(q, sigma, alpha) * (alpha - 1), 17)))
    print("# log(A_alpha) where the series needs more than DC_RDP_SERIES_MAX terms")
    for q, sigma, alpha in [(0.5, 1e6, 1.1), (0.5, 1e6, 2.5), (0.5, 1e3, 2.2), (0.5, 1.0, 1.3),
                            (0.5, 10.0, 1.6), (0.3, 0.5, 1.1), (0.5, 1.0, 1.5)]:
        print("{%g, %g, %g, %s}," % (q, sigma, alpha,
                                     mp.nstr(log_a_integral(q, sigma, alpha), 17)))
    print("# eps over the default orders")
    for q, sigma, steps, delta in [(0.04, 1.5, 2250, 1e-5), (0.01, 1.1, 10000, 1e-5),
                                   (0.001, 0.7, 5000, 1e-6), (0.25, 3.0, 40, 1e-5)]:
        rd = [rdp(q, sigma, a) * steps for a in DEFAULT_ORDERS]
        e, a = eps_of(DEFAULT_ORDERS, rd, mp.mpf(delta))
        print("{%g, %g, %d, %g, %s, %s}," % (q, sigma, steps, delta, mp.nstr(e, 17),
                                             mp.nstr(a, 6)))
