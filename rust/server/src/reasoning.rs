//! Reasoning content: the text a thinking model writes inside `<think>…</think>` goes to
//! `reasoning_content`, the rest to `content` (`--reasoning-parser qwen3|deepseek_r1`).
//!
//! The two families differ in where the reasoning starts. Qwen3 writes `<think>` itself when it
//! thinks (with `enable_thinking: false` the template closes an empty block in the prompt, and the
//! output has no tags): no `<think>` at the start means no reasoning. DeepSeek-R1's template ends
//! the prompt with `<think>\n`, so its output starts inside the reasoning, and an output that never
//! writes `</think>` is all reasoning. Like the tool parsers, the split does not depend on how the
//! text arrives in chunks.

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";

/// The reasoning formats, as vLLM names them.
pub const REASONING_PARSER_NAMES: [&str; 2] = ["qwen3", "deepseek_r1"];

/// Which family's reasoning convention to follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningKind {
    Qwen3,
    DeepSeekR1,
}

impl ReasoningKind {
    /// The kind named `name` (one of [`REASONING_PARSER_NAMES`]).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "qwen3" => Some(Self::Qwen3),
            "deepseek_r1" => Some(Self::DeepSeekR1),
            _ => None,
        }
    }
}

/// A piece of output, split.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasoningSplit {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before the first non-whitespace text: is there a `<think>`?
    Start,
    Reasoning,
    /// After `</think>`: whitespace right after the tag is dropped.
    ContentStart,
    Content,
}

/// Splits one output into reasoning and content, incrementally.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    kind: ReasoningKind,
    phase: Phase,
    /// Text that may still be (part of) a tag.
    buf: String,
}

/// The length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&k| text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

impl ReasoningParser {
    pub fn new(kind: ReasoningKind) -> Self {
        Self {
            kind,
            phase: Phase::Start,
            buf: String::new(),
        }
    }

    /// Whether the output is still inside the reasoning (so a tool call there is not a call).
    pub fn in_reasoning(&self) -> bool {
        matches!(self.phase, Phase::Start | Phase::Reasoning)
    }

    /// Feeds the next piece of output; returns what is settled.
    pub fn push(&mut self, text: &str) -> ReasoningSplit {
        self.buf.push_str(text);
        let mut out = ReasoningSplit::default();
        loop {
            match self.phase {
                Phase::Start => {
                    let head = self.buf.trim_start();
                    if let Some(rest) = head.strip_prefix(THINK_START) {
                        self.buf = rest.to_string();
                        self.phase = Phase::Reasoning;
                    } else if THINK_START.starts_with(head) {
                        return out; // nothing yet, or part of `<think>`
                    } else {
                        self.phase = match self.kind {
                            ReasoningKind::Qwen3 => Phase::Content,
                            ReasoningKind::DeepSeekR1 => Phase::Reasoning,
                        };
                    }
                }
                Phase::Reasoning => {
                    if let Some(pos) = self.buf.find(THINK_END) {
                        out.reasoning.push_str(&self.buf[..pos]);
                        self.buf.drain(..pos + THINK_END.len());
                        self.phase = Phase::ContentStart;
                    } else {
                        let settled = self.buf.len() - partial_tag_len(&self.buf, THINK_END);
                        out.reasoning.push_str(&self.buf[..settled]);
                        self.buf.drain(..settled);
                        return out;
                    }
                }
                Phase::ContentStart => {
                    let kept = self.buf.trim_start().len();
                    self.buf.drain(..self.buf.len() - kept);
                    if self.buf.is_empty() {
                        return out;
                    }
                    self.phase = Phase::Content;
                }
                Phase::Content => {
                    out.content.push_str(&self.buf);
                    self.buf.clear();
                    return out;
                }
            }
        }
    }

    /// The output ended: settles what was held back.
    pub fn finish(&mut self) -> ReasoningSplit {
        let buf = std::mem::take(&mut self.buf);
        let mut out = ReasoningSplit::default();
        match self.phase {
            Phase::Reasoning => out.reasoning = buf,
            Phase::ContentStart => {}
            // A Qwen3 output that is only `<thi`, or only whitespace, is content.
            Phase::Start if self.kind == ReasoningKind::DeepSeekR1 && !buf.trim().is_empty() => {
                out.reasoning = buf
            }
            Phase::Start | Phase::Content => out.content = buf,
        }
        self.phase = Phase::Content;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(kind: ReasoningKind, chunks: &[&str]) -> (String, String) {
        let mut p = ReasoningParser::new(kind);
        let (mut reasoning, mut content) = (String::new(), String::new());
        let mut splits: Vec<ReasoningSplit> = chunks.iter().map(|c| p.push(c)).collect();
        splits.push(p.finish());
        for split in splits {
            reasoning.push_str(&split.reasoning);
            content.push_str(&split.content);
        }
        (reasoning, content)
    }

    /// Every two-chunk split and a char-by-char feed give `reasoning` and `content`.
    fn check(kind: ReasoningKind, text: &str, reasoning: &str, content: &str) {
        let want = (reasoning.to_string(), content.to_string());
        assert_eq!(run(kind, &[text]), want, "{kind:?} {text:?}");
        for (k, _) in text.char_indices().skip(1) {
            assert_eq!(
                run(kind, &[&text[..k], &text[k..]]),
                want,
                "{kind:?} split at {k}"
            );
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(kind, &chars), want, "{kind:?} char by char");
    }

    #[test]
    fn qwen3_outputs() {
        // Qwen3 thinking: the model opens and closes the block, content follows a blank line.
        check(
            ReasoningKind::Qwen3,
            "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?",
            "\nThe user greets me. I should greet back.\n",
            "Hello! How can I help?",
        );
        // enable_thinking=false: the empty block was in the prompt; the output is all content.
        check(
            ReasoningKind::Qwen3,
            "Hello! <think> is a tag.",
            "",
            "Hello! <think> is a tag.",
        );
        // A tool call inside the reasoning is reasoning text.
        check(
            ReasoningKind::Qwen3,
            "<think>maybe <tool_call>{}</tool_call>?</think><tool_call>x</tool_call>",
            "maybe <tool_call>{}</tool_call>?",
            "<tool_call>x</tool_call>",
        );
        // Cut off while thinking: all reasoning.
        check(
            ReasoningKind::Qwen3,
            "<think>\nstill thin",
            "\nstill thin",
            "",
        );
    }

    #[test]
    fn deepseek_r1_outputs() {
        // DeepSeek-R1: the prompt ended with `<think>\n`, the output starts inside the reasoning.
        check(
            ReasoningKind::DeepSeekR1,
            "Okay, 9.11 vs 9.9: 0.9 > 0.11.\n</think>\n\n9.9 is larger.",
            "Okay, 9.11 vs 9.9: 0.9 > 0.11.\n",
            "9.9 is larger.",
        );
        // Older R1 checkpoints write the opening tag themselves.
        check(ReasoningKind::DeepSeekR1, "<think>a</think>b", "a", "b");
        // No closing tag: everything is reasoning.
        check(
            ReasoningKind::DeepSeekR1,
            "thinking without end",
            "thinking without end",
            "",
        );
    }
}
