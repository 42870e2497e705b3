//! The text layer of voltllm: everything between token ids and the text a client sees.
//!
//! * [`Tokenizer`] — a Hugging Face fast tokenizer plus its model's special tokens, shared by all
//!   requests (`Send + Sync`, cheap to clone).
//! * [`IncrementalDetokenizer`] — per request, turns generated ids into text pieces without ever
//!   emitting a broken UTF-8 character.
//! * [`StopChecker`] — per request, finds stop strings across piece boundaries, holding back text
//!   that might be the start of one.
//!
//! A request's output flows `ids → IncrementalDetokenizer::push → StopChecker::push → client`; at
//! the end call `IncrementalDetokenizer::flush`, feed its text to the checker, then
//! `StopChecker::flush`.

mod detokenizer;
mod error;
mod stop;
mod tokenizer;

pub use detokenizer::IncrementalDetokenizer;
pub use error::{Result, TextError};
pub use stop::{StopChecker, StopUpdate};
pub use tokenizer::Tokenizer;
