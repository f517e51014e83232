//! Confidence intervals of the report's rates over the prompts they were measured on.

use serde::{Deserialize, Serialize};

use crate::stats::SpecStats;

/// The standard normal distribution's 97.5% quantile: a two-sided 95% interval.
const Z95: f64 = 1.959_963_984_540_054;

/// A confidence interval, `low ≤ high`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    /// Lower bound.
    pub low: f64,
    /// Upper bound.
    pub high: f64,
}

impl Interval {
    /// The interval clipped to `[min, max]` (a rate's normal interval can reach past 0 or 1).
    pub fn clamp(self, min: f64, max: f64) -> Self {
        Self {
            low: self.low.clamp(min, max),
            high: self.high.clamp(min, max),
        }
    }

    /// The interval moved by `by`.
    pub fn shift(self, by: f64) -> Self {
        Self {
            low: self.low + by,
            high: self.high + by,
        }
    }
}

/// The 95% confidence interval of the ratio `R = Σ aᵢ / Σ dᵢ` over clusters `(aᵢ, dᵢ)` — an
/// acceptance rate over prompts, say: accepted and drafted tokens per prompt, whose drafts
/// within one prompt are not independent of each other, so that a binomial interval over the
/// drafts would be too narrow.
///
/// `R ± z · se` with the cluster-robust (HC1) standard error of the ratio estimator,
/// `se² = n / (n − 1) · Σ (aᵢ − R dᵢ)² / (Σ dᵢ)²`, and `z` the normal 97.5% quantile:
/// statsmodels' weighted least squares of `aᵢ / dᵢ` on a constant with weights `dᵢ` and
/// `cov_type="HC1"` gives the same interval (`fixtures/make_ratio_interval_golden.py`).
/// Clusters with `dᵢ = 0` say nothing about `R` and are left out. `None` with fewer than two
/// clusters left, or with a non-finite or negative count.
pub fn ratio_interval(clusters: impl IntoIterator<Item = (f64, f64)>) -> Option<Interval> {
    let kept: Vec<(f64, f64)> = clusters.into_iter().filter(|&(_, d)| d != 0.0).collect();
    let n = kept.len();
    if n < 2
        || kept
            .iter()
            .any(|&(a, d)| !a.is_finite() || !d.is_finite() || a < 0.0 || d < 0.0)
    {
        return None;
    }
    let (sum_a, sum_d) = kept
        .iter()
        .fold((0.0, 0.0), |(sa, sd), &(a, d)| (sa + a, sd + d));
    let r = sum_a / sum_d;
    let squares: f64 = kept.iter().map(|&(a, d)| (a - r * d).powi(2)).sum();
    let se = (squares * n as f64 / (n - 1) as f64).sqrt() / sum_d;
    Some(Interval {
        low: r - Z95 * se,
        high: r + Z95 * se,
    })
}

/// The 95% intervals of the acceptance rate (accepted / drafted, clipped to [0, 1]) and of τ
/// (accepted per verification plus the target's own token, in [1, k + 1]) over the counts of
/// the batches decoded at `k` drafts per verification: [`ratio_interval`] with each batch a
/// cluster. What [`AcceptanceReport`](crate::AcceptanceReport) records.
pub fn acceptance_intervals<'a>(
    batches: impl IntoIterator<Item = &'a SpecStats>,
    k: usize,
) -> (Option<Interval>, Option<Interval>) {
    let batches: Vec<&SpecStats> = batches.into_iter().collect();
    let over = |num: fn(&SpecStats) -> usize, den: fn(&SpecStats) -> usize| {
        ratio_interval(batches.iter().map(|b| (num(b) as f64, den(b) as f64)))
    };
    (
        over(|s| s.accepted, |s| s.drafted).map(|i| i.clamp(0.0, 1.0)),
        over(|s| s.accepted, |s| s.verify_steps).map(|i| i.clamp(0.0, k as f64).shift(1.0)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_few_clusters_or_bad_counts_give_none() {
        assert_eq!(ratio_interval([]), None);
        assert_eq!(ratio_interval([(3.0, 10.0)]), None);
        // A cluster with nothing drafted does not count.
        assert_eq!(ratio_interval([(3.0, 10.0), (0.0, 0.0)]), None);
        assert_eq!(ratio_interval([(3.0, 10.0), (f64::NAN, 4.0)]), None);
        assert_eq!(ratio_interval([(3.0, 10.0), (1.0, -4.0)]), None);
    }

    #[test]
    fn equal_ratios_give_a_point() {
        let i = ratio_interval([(2.0, 4.0), (5.0, 10.0), (1.0, 2.0)]).unwrap();
        assert!(
            (i.low - 0.5).abs() < 1e-15 && (i.high - 0.5).abs() < 1e-15,
            "{i:?}"
        );
    }
}
