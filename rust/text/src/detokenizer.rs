//! Incremental detokenization: turn a stream of token ids into a stream of text pieces.
//!
//! Decoding one token at a time is wrong for most tokenizers: byte-level BPE and byte-fallback
//! tokens split multi-byte UTF-8 characters across tokens, and SentencePiece-style decoders treat
//! the first token of a sequence differently (they drop its leading space). The standard remedy,
//! used by vLLM and TGI, decodes a small sliding window instead:
//!
//! * `prefix_offset..read_offset` is text already emitted, kept as left context;
//! * `read_offset..` are tokens not yet emitted.
//!
//! On every new token the window is decoded twice (context alone, context plus new tokens) and the
//! difference is emitted — unless the decoded window ends in U+FFFD, which means the last token(s)
//! end inside a UTF-8 sequence: then nothing is emitted and the tokens wait for the rest of the
//! character. Invariant: for tokenizers whose decoding is compositional at token boundaries
//! (byte-level BPE, byte fallback), the concatenation of everything returned by
//! [`IncrementalDetokenizer::push`] and [`IncrementalDetokenizer::flush`] equals the full
//! decode of the output ids.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// How many prompt tokens are kept as left context (vLLM's
/// `INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`).
const PROMPT_CONTEXT_TOKENS: usize = 5;

/// Per-request incremental detokenizer. See the module documentation for the algorithm.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// Tokens from `prefix_offset` on; earlier tokens are dropped as soon as they stop mattering.
    window: Vec<u32>,
    /// Index in `window` where not-yet-emitted tokens start (`prefix_offset` is always 0).
    read_offset: usize,
    /// `decode(window[..read_offset])`, cached because it changes only when text is emitted.
    prefix_text: String,
}

impl IncrementalDetokenizer {
    /// Starts detokenizing the output of a request whose prompt was `prompt_ids`. The last few
    /// prompt tokens serve as left context so that the first output token decodes as it would
    /// inside the full sequence (e.g. keeps its leading space).
    pub fn new(
        tokenizer: Tokenizer,
        prompt_ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<Self> {
        let context = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        let prefix_text = tokenizer.decode(context, skip_special_tokens)?;
        Ok(Self {
            tokenizer,
            skip_special_tokens,
            window: context.to_vec(),
            read_offset: context.len(),
            prefix_text,
        })
    }

    /// Adds one generated token and returns the text it completes: possibly empty (the token
    /// ends inside a multi-byte character, or is a skipped special token), possibly covering
    /// earlier held-back tokens too. Never returns a partial UTF-8 character. An id without a
    /// token (a padded vocabulary row) adds no text.
    pub fn push(&mut self, token_id: u32) -> Result<String> {
        self.window.push(token_id);
        let text = self
            .tokenizer
            .decode(&self.window, self.skip_special_tokens)?;
        if text.ends_with(char::REPLACEMENT_CHARACTER) || text.len() <= self.prefix_text.len() {
            return Ok(String::new());
        }
        self.emit(text)
    }

    /// Adds several tokens; returns the concatenation of what [`Self::push`] would return.
    pub fn push_many(&mut self, token_ids: &[u32]) -> Result<String> {
        let mut out = String::new();
        for &id in token_ids {
            out.push_str(&self.push(id)?);
        }
        Ok(out)
    }

    /// Ends the stream: returns whatever is still held back, decoded as is. This is empty unless
    /// generation stopped inside a multi-byte character, in which case the text ends with
    /// U+FFFD exactly as a full decode would.
    pub fn flush(&mut self) -> Result<String> {
        if self.read_offset == self.window.len() {
            return Ok(String::new());
        }
        let text = self
            .tokenizer
            .decode(&self.window, self.skip_special_tokens)?;
        if text.len() <= self.prefix_text.len() {
            // Only skipped special tokens are pending: nothing to show.
            self.read_offset = self.window.len();
            return Ok(String::new());
        }
        self.emit(text)
    }

    /// Emits the part of `text` (the decoded window) past the context and slides the window.
    fn emit(&mut self, text: String) -> Result<String> {
        let start = common_prefix_len(&self.prefix_text, &text);
        let new_text = text[start..].to_string();
        // The tokens just emitted become the context for the next ones.
        self.window.drain(..self.read_offset);
        self.read_offset = self.window.len();
        self.prefix_text = self
            .tokenizer
            .decode(&self.window, self.skip_special_tokens)?;
        Ok(new_text)
    }
}

/// Length in bytes of the longest common prefix of `a` and `b` that ends on a character
/// boundary. Normally `a` is a prefix of `b`; the fallback keeps slicing safe when a decoder
/// rewrites the context once more tokens follow (e.g. a prompt ending inside a character).
fn common_prefix_len(a: &str, b: &str) -> usize {
    if b.starts_with(a) {
        return a.len();
    }
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}

#[cfg(test)]
mod tests {
    use super::common_prefix_len;

    #[test]
    fn common_prefix_respects_char_boundaries() {
        assert_eq!(common_prefix_len("ab", "abc"), 2);
        assert_eq!(common_prefix_len("a\u{FFFD}", "a好x"), 1);
        assert_eq!(common_prefix_len("abc", "ab"), 2);
        assert_eq!(common_prefix_len("", "x"), 0);
    }
}
