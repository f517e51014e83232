//! Data for distillation and speculator training, independent of any tensor library: it
//! yields token ids, labels, masks and records as plain Rust values.
//!
//! - Sources ([`source`]): OpenAI batch prompts (`data_dir/*/batch_input.jsonl`),
//!   question/answer sets (JSON array or JSONL, dotted keys), plain text, and prompt/completion
//!   pairs a program holds ([`PromptCompletion`]); streamed, with a
//!   bad-record policy (`error` names file and line; `skip` counts by reason) and
//!   deterministic sampling ([`Sampling`]).
//! - Chat templates ([`ChatTemplate`]): the model's own Jinja template rendered with
//!   `minijinja` exactly as transformers renders it.
//! - Tokenization ([`ChatTokenizer`], [`build_example`]): prompt + completion → ids and labels
//!   (−100 on the prompt by position, never by token value), truncation that keeps the end of
//!   the prompt and the start of the completion.
//! - Batches ([`plan_batches`], [`collate`]): length buckets, padding, optional packing.
//!
//! ```no_run
//! use kd_data::{ChatTokenizer, OpenAiBatchSource, Sampling};
//!
//! # fn main() -> kd_data::Result<()> {
//! let source = OpenAiBatchSource::from_data_dir("data/sft_llama".as_ref())?;
//! let prompts = Sampling { max_samples: Some(1000), shuffle: true, seed: 42 }.apply(source.records())?;
//! let tokenizer = ChatTokenizer::from_dir("models/Llama-3.2-1B-Instruct")?;
//! let conversations: Vec<_> = prompts.iter().map(|p| p.messages.clone()).collect();
//! let ids = tokenizer.encode_prompts(&conversations)?;
//! # let _ = ids;
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod batch;
mod error;
mod gguf;
pub mod source;
mod template;
mod tokenize;

pub use batch::{Batch, BatchOptions, BatchPlan, collate, plan_batches};
pub use error::{DataError, Result};
pub use source::{
    BadRecordKind, BadRecordPolicy, Location, Message, OpenAiBatchSource, PromptCompletion,
    PromptRecord, QaKeys, QaRecord, QaSource, Sampling, SkipReport, TextRecord, TextSource,
    find_batch_files,
};
pub use template::{ChatTemplate, load_template, special_tokens};
pub use tokenize::{
    ChatTokenizer, Example, ExampleOptions, IGNORE_INDEX, Truncation, build_example,
};
