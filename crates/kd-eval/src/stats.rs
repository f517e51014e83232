//! The counts of a speculative decoding run: acceptance per position, α, top-1 agreement,
//! forward passes and their time.

use serde::{Deserialize, Serialize};

/// Counts gathered while decoding; [`SpecStats::merge`] adds runs together.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecStats {
    /// Tokens drafted per verification.
    pub k: usize,
    /// Verifications (target forward passes over drafted tokens), summed over rows.
    pub verify_steps: usize,
    /// Drafted tokens (k per verification, fewer with `draft_p_min`).
    pub drafted: usize,
    /// Drafted tokens accepted.
    pub accepted: usize,
    /// Tokens emitted into completions (after cutting at stop tokens and the length limit).
    pub emitted: usize,
    /// `reached[i]`: verifications in which drafted position i was examined (every earlier
    /// draft accepted).
    pub reached: Vec<usize>,
    /// `accepted_at[i]`: verifications in which drafted position i was accepted.
    pub accepted_at: Vec<usize>,
    /// Σ over examined positions of Σ_x min(p(x), q(x)) (see [`SpecStats::alpha`]).
    pub alpha_sum: f64,
    /// Examined positions where the argmax of p equals the argmax of q.
    pub top1_agree: usize,
    /// `in_top[m − 1]`: examined positions where the argmax of p is among the m tokens q
    /// ranks highest, m = 1..=[`TOP_M`] (how often a tree of m drafts at a position would hold
    /// the target's greedy token; empty in counts from before it was recorded).
    #[serde(default)]
    pub in_top: Vec<usize>,
    /// Positions examined (the denominator of α and top-1 agreement).
    pub examined: usize,
    /// Forward passes of the draft.
    pub draft_forwards: usize,
    /// Forward passes of the target.
    pub target_forwards: usize,
    /// Seconds in draft forward passes.
    pub draft_seconds: f64,
    /// Seconds in target forward passes.
    pub target_seconds: f64,
    /// Of `target_forwards`, the prefill passes: every run starts with one over the prompts,
    /// which verifies nothing (the target chooses each row's first token there).
    #[serde(default)]
    pub prefill_forwards: usize,
    /// Of `target_seconds`, the prefill passes' seconds.
    #[serde(default)]
    pub prefill_seconds: f64,
}

/// The widest draft top-m whose agreement with the target's argmax is counted
/// ([`SpecStats::in_top`]).
pub const TOP_M: usize = 8;

impl SpecStats {
    pub(crate) fn new(k: usize) -> Self {
        Self {
            k,
            reached: vec![0; k],
            accepted_at: vec![0; k],
            in_top: vec![0; TOP_M],
            ..Self::default()
        }
    }

    /// Counts one examined position whose target argmax the draft ranks `rank`-th (0 = its
    /// own argmax).
    pub(crate) fn count_rank(&mut self, rank: usize) {
        self.in_top.resize(TOP_M, 0);
        for n in &mut self.in_top[rank.min(TOP_M)..] {
            *n += 1;
        }
    }

    /// Share of examined positions where the target's argmax is among the draft's `m`
    /// most probable tokens (m = 1..=[`TOP_M`]; 0 outside that range or without counts).
    pub fn top_m_agreement(&self, m: usize) -> f64 {
        match m.checked_sub(1).and_then(|i| self.in_top.get(i)) {
            Some(n) => ratio(*n, self.examined),
            None => 0.0,
        }
    }

    /// Adds another run's counts (same k).
    pub fn merge(&mut self, o: &Self) {
        if self.reached.is_empty() {
            self.k = o.k;
            self.reached = vec![0; o.k];
            self.accepted_at = vec![0; o.k];
        }
        self.verify_steps += o.verify_steps;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.emitted += o.emitted;
        for (a, b) in self.reached.iter_mut().zip(&o.reached) {
            *a += b;
        }
        for (a, b) in self.accepted_at.iter_mut().zip(&o.accepted_at) {
            *a += b;
        }
        self.alpha_sum += o.alpha_sum;
        self.top1_agree += o.top1_agree;
        if self.in_top.len() < o.in_top.len() {
            self.in_top.resize(o.in_top.len(), 0);
        }
        for (a, b) in self.in_top.iter_mut().zip(&o.in_top) {
            *a += b;
        }
        self.examined += o.examined;
        self.draft_forwards += o.draft_forwards;
        self.target_forwards += o.target_forwards;
        self.draft_seconds += o.draft_seconds;
        self.target_seconds += o.target_seconds;
        self.prefill_forwards += o.prefill_forwards;
        self.prefill_seconds += o.prefill_seconds;
    }

    /// Seconds per target pass that verifies drafts: the target's passes without the
    /// prefill ([`prefill_seconds`](Self::prefill_seconds)); 0 when there was none.
    pub fn verification_pass_seconds(&self) -> f64 {
        let passes = self.target_forwards.saturating_sub(self.prefill_forwards);
        if passes == 0 {
            return 0.0;
        }
        (self.target_seconds - self.prefill_seconds).max(0.0) / passes as f64
    }

    /// Accepted drafted tokens / drafted tokens.
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted, self.drafted)
    }

    /// Drafted tokens accepted per verification (the bonus / correction token not counted).
    pub fn mean_accepted_length(&self) -> f64 {
        ratio(self.accepted, self.verify_steps)
    }

    /// Tokens gained per verification, counting the target's own token (the bonus after k
    /// acceptances, or the correction at the first rejection): `mean_accepted_length + 1`.
    pub fn mean_accepted_length_with_bonus(&self) -> f64 {
        ratio(self.accepted + self.verify_steps, self.verify_steps)
    }

    /// P(position i accepted | every earlier position accepted), for i = 0..k.
    pub fn per_position_acceptance(&self) -> Vec<f64> {
        self.accepted_at
            .iter()
            .zip(&self.reached)
            .map(|(a, r)| ratio(*a, *r))
            .collect()
    }

    /// α = E[Σ_x min(p(x), q(x))] over the examined positions: the probability that
    /// speculative *sampling* accepts a draft. With sampling, p and q are the warped
    /// distributions decoding used; with greedy decoding they are the plain softmax at
    /// temperature 1 (what sampling at T = 1 would accept).
    pub fn alpha(&self) -> f64 {
        if self.examined == 0 {
            0.0
        } else {
            self.alpha_sum / self.examined as f64
        }
    }

    /// Share of examined positions where the draft's argmax equals the target's.
    pub fn top1_agreement(&self) -> f64 {
        ratio(self.top1_agree, self.examined)
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}
