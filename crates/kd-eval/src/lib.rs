//! Speculative decoding of a target model by a draft, and the acceptance report that says how
//! well the draft serves it.
//!
//! - [`speculative_generate`]: the draft proposes `k` tokens, the target verifies them in one
//!   forward pass over its KV cache, both caches roll back to the accepted prefix, the target
//!   adds its own token. Greedy output equals the target's greedy output; sampled output
//!   follows the target's sampling distribution. Batched (rows finish independently) and
//!   seeded per prompt.
//! - [`Drafter`]: what the loop asks of a draft, implemented by a Llama (the LoRA draft) and
//!   by [`Eagle3Drafter`] (an EAGLE-3 draft reading the target's features).
//! - [`evaluate`]: an [`AcceptanceReport`] over a prompt set — acceptance rate, mean accepted
//!   length (without and with the bonus token), per-position acceptance, α = E[Σ min(p, q)],
//!   top-1 agreement, wall-clock speedup over the target alone on this machine, and the
//!   theoretical speedup for a cost ratio; 95% confidence intervals of the acceptance rate and
//!   of the tokens per verification over the prompts ([`ratio_interval`]); [`acceptance_svg`]
//!   draws its per-position acceptance (before and after training, say) as an SVG chart.
//!
//! ```no_run
//! use kd_eval::{EvalOptions, evaluate};
//! use kd_model::{Llama, parse_device};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let device = parse_device("cpu")?;
//! let target = Llama::load("models/target", &device)?;
//! let draft = Llama::load("models/draft", &device)?;
//! let prompts = vec![vec![1, 17, 45], vec![1, 88]];
//! let report = evaluate(&target, &draft, &prompts, &EvalOptions::default(), |_, _, _| {})?;
//! println!("{}", report.summary());
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod draft;
mod error;
mod interval;
mod plot;
mod report;
mod speculative;
mod stats;
mod verify;

pub use draft::{DraftSession, Drafter, Eagle3Drafter, Prefill, RowOutcome, check_pair};
pub use error::{EvalError, Result};
pub use interval::{Interval, acceptance_intervals, ratio_interval};
pub use plot::acceptance_svg;
pub use report::{
    AcceptanceReport, EvalOptions, EvalPhase, evaluate, evaluate_across, expected_length,
};
pub use speculative::{SpecConfig, SpecOutput, speculative_generate};
pub use stats::{SpecStats, TOP_M};
