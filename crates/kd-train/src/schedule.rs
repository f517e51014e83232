//! Learning rate as a pure function of the step (so a resumed run recomputes it exactly):
//! linear warmup, then cosine, linear or constant, as transformers'
//! `get_{cosine,linear,constant}_schedule_with_warmup`.

use crate::config::SchedulerType;

/// The learning rate of optimizer step `step` (0-based) in a run of `total` steps.
pub fn learning_rate(
    kind: SchedulerType,
    peak: f64,
    step: usize,
    warmup: usize,
    total: usize,
) -> f64 {
    if step < warmup {
        return peak * step as f64 / warmup.max(1) as f64;
    }
    let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    match kind {
        SchedulerType::Constant => peak,
        SchedulerType::Linear => peak * (1.0 - progress).max(0.0),
        SchedulerType::Cosine => {
            peak * (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_decay() {
        let lr = |k, s| learning_rate(k, 1e-3, s, 10, 110);
        assert_eq!(lr(SchedulerType::Cosine, 0), 0.0);
        assert!((lr(SchedulerType::Cosine, 5) - 5e-4).abs() < 1e-12);
        assert!((lr(SchedulerType::Cosine, 10) - 1e-3).abs() < 1e-12);
        assert!((lr(SchedulerType::Cosine, 60) - 5e-4).abs() < 1e-12);
        assert!(lr(SchedulerType::Cosine, 110) < 1e-12);
        assert!((lr(SchedulerType::Linear, 60) - 5e-4).abs() < 1e-12);
        assert_eq!(lr(SchedulerType::Constant, 100), 1e-3);
    }
}
