//! Chat templates for voltllm: render a list of OpenAI-style messages into a prompt exactly as
//! Hugging Face transformers' `apply_chat_template(..., tokenize=False)` does.
//!
//! ```
//! use voltllm_chat::{ChatTemplate, RenderOptions, SpecialTokenStrings};
//!
//! let template = ChatTemplate::new(
//!     "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}\
//!      {% if add_generation_prompt %}<|assistant|>{% endif %}",
//!     SpecialTokenStrings::default(),
//! )?;
//! let messages = [serde_json::json!({"role": "user", "content": " Hi "})];
//! let opts = RenderOptions { add_generation_prompt: true, ..Default::default() };
//! assert_eq!(template.render(&messages, &opts)?, "<|user|>Hi\n<|assistant|>");
//! # Ok::<(), voltllm_chat::ChatError>(())
//! ```

mod error;
mod loader;
mod pyfmt;
mod template;

pub use error::{ChatError, Result};
pub use template::{
    ChatTemplate, RenderOptions, SpecialTokenStrings, DEFAULT_TEMPLATE_NAME, TOOL_USE_TEMPLATE_NAME,
};
