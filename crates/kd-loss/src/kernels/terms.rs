//! Each KD objective's per-entry loss term and c = q·∂L/∂q (the contract's formulas,
//! `shared/reference/losses.md`), one zero-sized type per objective so that the row kernel's
//! loop is monomorphised for it.

use super::math::ln;

/// One objective's per-entry loss term and c = q·∂L/∂q, monomorphised into the hot loop.
pub(super) trait Term {
    fn term(lam: f32, p: f32, q: f32, lp: f32, lq: f32) -> (f32, f32);
}

macro_rules! objective_term {
    ($name:ident, |$lam:ident, $p:ident, $q:ident, $lp:ident, $lq:ident| $body:block) => {
        pub(super) struct $name;
        impl Term for $name {
            #[inline(always)]
            #[allow(unused_variables)]
            fn term($lam: f32, $p: f32, $q: f32, $lp: f32, $lq: f32) -> (f32, f32) $body
        }
    };
}

const EPS: f32 = 1e-9;

objective_term!(Fkl, |lam, p, q, lp, lq| {
    let t = if p > 0.0 { p * (lp - lq) } else { 0.0 };
    (t, -p)
});
objective_term!(Rkl, |lam, p, q, lp, lq| {
    let t = if q > 0.0 { q * (lq - lp) } else { 0.0 };
    let c = if q > 0.0 { q * (lq - lp + 1.0) } else { 0.0 };
    (t, c)
});
objective_term!(SkewedFkl, |lam, p, q, lp, lq| {
    let m = lam * p + (1.0 - lam) * q;
    let t = if p > 0.0 { p * (lp - ln(m)) } else { 0.0 };
    let c = if m > 0.0 {
        -(1.0 - lam) * p * q / m
    } else {
        0.0
    };
    (t, c)
});
objective_term!(SkewedRkl, |lam, p, q, lp, lq| {
    let m = (1.0 - lam) * p + lam * q;
    let lm = ln(m);
    let t = if q > 0.0 { q * (lq - lm) } else { 0.0 };
    let c = if q > 0.0 {
        q * (lq + 1.0 - lm - lam * q / m)
    } else {
        0.0
    };
    (t, c)
});
objective_term!(Js, |lam, p, q, lp, lq| {
    let m = 0.5 * (p + q);
    let lm = ln(m + EPS);
    let lqe = ln(q + EPS);
    let t = 0.5 * p * (ln(p + EPS) - lm) + 0.5 * q * (lqe - lm);
    // ∂L/∂q = ½[−p/(2(m+ε))] + ½[ln(q+ε) − ln(m+ε) + q/(q+ε) − q/(2(m+ε))]
    let dq = -0.25 * p / (m + EPS) + 0.5 * (lqe - lm + q / (q + EPS) - 0.5 * q / (m + EPS));
    (t, q * dq)
});
objective_term!(Tv, |lam, p, q, lp, lq| {
    let d = q - p;
    let sign = if d > 0.0 {
        1.0
    } else if d < 0.0 {
        -1.0
    } else {
        0.0
    };
    (0.5 * d.abs(), 0.5 * q * sign)
});
