"""Derives the polynomial of geglu.py's branch-free normal CDF, and checks the result in float32 arithmetic.

    python scripts/fit_normal_cdf.py

With x = z / sqrt(2), a = |x| and t = 1 / (1 + p a), which maps a in [0, inf) onto t in (0, 1]:
    erfc(a) = t R(t) exp(-a^2)
R is smooth on [0, 1] (erfc(a) exp(a^2) ~ 1 / (a sqrt(pi)) for large a, a series in t), so one polynomial
covers every a: no branches, one exponential, one reciprocal. R is a least-squares fit in relative error
on Chebyshev nodes, in float64; mpmath gives the reference.
"""

import math

import mpmath
import numpy as np
from numpy.polynomial import polynomial as P

SCALE, DEGREE = 0.4, 8
mpmath.mp.dps = 30


def fit():
    t = np.cos(np.linspace(0, np.pi, 1500)) * 0.5 + 0.5
    t = t[t > 1e-4]
    a = (1 / t - 1) / SCALE
    target = np.array([float(mpmath.erfc(v) * mpmath.exp(v * v)) / w for v, w in zip(a, t)])
    return P.polyfit(t, target, DEGREE, w=1 / target)


def normal_cdf32(z, r):
    """The kernel's arithmetic, step by step in float32."""
    one = np.float32(1)
    a = np.abs(z.astype(np.float32) * np.float32(1 / math.sqrt(2)))
    t = one / (one + np.float32(SCALE) * a)
    poly = np.float32(r[-1])
    for c in r[-2::-1]:
        poly = (poly * t + np.float32(c)).astype(np.float32)
    gauss = np.exp2(-(a * a) * np.float32(math.log2(math.e))).astype(np.float32)
    half_erfc = np.float32(0.5) * t * poly * gauss
    return np.where(z < 0, half_erfc, one - half_erfc).astype(np.float32)


def main():
    r = fit()
    print("R =", ", ".join(repr(float(c)) for c in r))
    z = np.linspace(-12, 6, 100001)
    exact = np.array([float(mpmath.ncdf(v)) for v in z])
    ours = normal_cdf32(z, r).astype(np.float64)
    naive = 0.5 * (1 + np.vectorize(math.erf)((z / math.sqrt(2)).astype(np.float32)).astype(np.float32))
    for name, value in (("t R(t) exp(-a^2)", ours), ("0.5 (1 + erf) in float32", naive.astype(np.float32))):
        rel = np.abs(value - exact) / exact
        print(f"{name:<26} max relative error: z >= -3: {rel[z >= -3].max():.2e}  z >= -12: {rel.max():.2e}")


if __name__ == "__main__":
    main()
