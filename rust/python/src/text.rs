//! Tokenizer, chat template and incremental detokenizer classes.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::{Map, Value};
use voltllm_chat::{ChatTemplate as RustChatTemplate, RenderOptions};
use voltllm_text::{IncrementalDetokenizer, StopChecker, Tokenizer as RustTokenizer};

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A Hugging Face tokenizer (`tokenizer.json`) with the special tokens of `tokenizer_config.json`.
#[pyclass(module = "voltllm._core", frozen)]
pub struct Tokenizer {
    inner: RustTokenizer,
}

#[pymethods]
impl Tokenizer {
    /// Load `tokenizer.json` and `tokenizer_config.json` from a model folder.
    #[staticmethod]
    fn from_model_dir(path: PathBuf) -> PyResult<Self> {
        Ok(Self {
            inner: RustTokenizer::from_model_dir(path).map_err(value_error)?,
        })
    }

    /// Load a bare `tokenizer.json`.
    #[staticmethod]
    fn from_file(path: PathBuf) -> PyResult<Self> {
        Ok(Self {
            inner: RustTokenizer::from_file(path).map_err(value_error)?,
        })
    }

    /// Token ids of `text`; `add_special_tokens` adds BOS/EOS as the tokenizer's post-processor says.
    #[pyo3(signature = (text, add_special_tokens = true))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        py.detach(|| self.inner.encode(text, add_special_tokens))
            .map_err(value_error)
    }

    /// `encode` over many texts, in parallel where the tokenizer allows.
    #[pyo3(signature = (texts, add_special_tokens = true))]
    fn encode_batch(
        &self,
        py: Python<'_>,
        texts: Vec<String>,
        add_special_tokens: bool,
    ) -> PyResult<Vec<Vec<u32>>> {
        py.detach(|| self.inner.encode_batch(&texts, add_special_tokens))
            .map_err(value_error)
    }

    /// Text of `ids`; an id without a token (a padded vocabulary row) adds no text.
    #[pyo3(signature = (ids, skip_special_tokens = true))]
    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        py.detach(|| self.inner.decode(&ids, skip_special_tokens))
            .map_err(value_error)
    }

    /// `decode` over many id lists.
    #[pyo3(signature = (batch, skip_special_tokens = true))]
    fn decode_batch(
        &self,
        py: Python<'_>,
        batch: Vec<Vec<u32>>,
        skip_special_tokens: bool,
    ) -> PyResult<Vec<String>> {
        let slices: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
        py.detach(|| self.inner.decode_batch(&slices, skip_special_tokens))
            .map_err(value_error)
    }

    /// Vocabulary size, added tokens included.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// Ids that end generation (from `tokenizer_config.json`'s `eos_token`).
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_token_ids().to_vec()
    }

    #[getter]
    fn bos_token(&self) -> Option<String> {
        self.inner.bos_token().map(str::to_owned)
    }

    #[getter]
    fn eos_token(&self) -> Option<String> {
        self.inner.eos_token().map(str::to_owned)
    }

    /// Ids of all special tokens.
    #[getter]
    fn special_token_ids(&self) -> Vec<u32> {
        self.inner.special_token_ids().to_vec()
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    fn __repr__(&self) -> String {
        format!("Tokenizer(vocab_size={})", self.inner.vocab_size())
    }
}

/// A model's chat template, rendered as transformers' `apply_chat_template(tokenize=False)` renders it.
#[pyclass(module = "voltllm._core", frozen)]
pub struct ChatTemplate {
    inner: RustChatTemplate,
}

/// Python object -> JSON value, through Python's own `json` so every JSON-able value is accepted.
fn to_json(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Value> {
    let text: String = py
        .import("json")?
        .call_method1("dumps", (obj,))?
        .extract()?;
    serde_json::from_str(&text).map_err(|e| value_error(format!("{what}: {e}")))
}

#[pymethods]
impl ChatTemplate {
    /// The template of a model folder (`chat_template.jinja` or `tokenizer_config.json`), or None.
    #[staticmethod]
    fn from_model_dir(path: PathBuf) -> PyResult<Option<Self>> {
        let found = RustChatTemplate::from_model_dir(path).map_err(value_error)?;
        Ok(found.map(|inner| Self { inner }))
    }

    /// Render `messages` (a list of `{"role", "content"}` dicts) to the prompt text.
    ///
    /// `kwargs` are extra template variables (`chat_template_kwargs`); a template's
    /// `raise_exception(...)` becomes `ValueError`.
    #[pyo3(signature = (messages, add_generation_prompt = true, tools = None, kwargs = None, continue_final_message = false))]
    fn render(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        tools: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
        continue_final_message: bool,
    ) -> PyResult<String> {
        let Value::Array(messages) = to_json(py, messages, "messages")? else {
            return Err(value_error("messages must be a list of dicts"));
        };
        let tools = match tools {
            Some(t) if !t.is_none() => match to_json(py, t, "tools")? {
                Value::Array(list) => Some(list),
                _ => return Err(value_error("tools must be a list of dicts")),
            },
            _ => None,
        };
        let extra: Map<String, Value> = match kwargs {
            Some(k) => match to_json(py, k.as_any(), "kwargs")? {
                Value::Object(map) => map,
                _ => unreachable!("a dict serializes to a JSON object"),
            },
            None => Map::new(),
        };
        let opts = RenderOptions {
            add_generation_prompt,
            continue_final_message,
            tools,
            extra,
            ..RenderOptions::default()
        };
        py.detach(|| self.inner.render(&messages, &opts))
            .map_err(value_error)
    }
}

/// Streaming detokenization of one sequence, with stop strings.
///
/// `push(token_id)` returns the text that became final with this token: never a broken UTF-8
/// character, never a piece of text that could still turn into a stop string. After a stop string
/// matched, `stopped` holds it and further pushes return "".
#[pyclass(module = "voltllm._core")]
pub struct Detokenizer {
    detokenizer: IncrementalDetokenizer,
    stops: StopChecker,
    stopped: Option<String>,
}

#[pymethods]
impl Detokenizer {
    #[new]
    #[pyo3(signature = (tokenizer, prompt_ids, skip_special_tokens = true, stop = Vec::new(), include_stop_str_in_output = false))]
    fn new(
        tokenizer: &Tokenizer,
        prompt_ids: Vec<u32>,
        skip_special_tokens: bool,
        stop: Vec<String>,
        include_stop_str_in_output: bool,
    ) -> PyResult<Self> {
        let detokenizer =
            IncrementalDetokenizer::new(tokenizer.inner.clone(), &prompt_ids, skip_special_tokens)
                .map_err(value_error)?;
        let stops = StopChecker::new(stop, include_stop_str_in_output).map_err(value_error)?;
        Ok(Self {
            detokenizer,
            stops,
            stopped: None,
        })
    }

    /// Add one generated token; returns the newly final text.
    fn push(&mut self, token_id: u32) -> PyResult<String> {
        if self.stopped.is_some() {
            return Ok(String::new());
        }
        let text = self.detokenizer.push(token_id).map_err(value_error)?;
        let update = self.stops.push(&text);
        self.stopped = update.stopped;
        Ok(update.emit)
    }

    /// Add several generated tokens, stopping at the first that completes a stop string; returns the
    /// newly final text and how many of the tokens were taken (all of them unless a stop matched).
    fn push_many(&mut self, token_ids: Vec<u32>) -> PyResult<(String, usize)> {
        let mut text = String::new();
        for (taken, &token_id) in token_ids.iter().enumerate() {
            if self.stopped.is_some() {
                return Ok((text, taken));
            }
            text.push_str(&self.push(token_id)?);
        }
        Ok((text, token_ids.len()))
    }

    /// End of the sequence: the text still held back (incomplete characters, partial stop strings).
    fn flush(&mut self) -> PyResult<String> {
        if self.stopped.is_some() {
            return Ok(String::new());
        }
        let text = self.detokenizer.flush().map_err(value_error)?;
        let mut tail = self.stops.push(&text);
        self.stopped = tail.stopped;
        if self.stopped.is_none() {
            tail.emit.push_str(&self.stops.flush());
        }
        Ok(tail.emit)
    }

    /// The stop string that ended the sequence, if one did.
    #[getter]
    fn stopped(&self) -> Option<String> {
        self.stopped.clone()
    }
}

/// One engine step's detokenization for many sequences in one call: `push_many` of each
/// detokenizer's new tokens. Returns, per sequence, the newly final text and how many tokens it took.
#[pyfunction]
pub fn detokenize_step(
    mut detokenizers: Vec<PyRefMut<'_, Detokenizer>>,
    token_ids: Vec<Vec<u32>>,
) -> PyResult<Vec<(String, usize)>> {
    if detokenizers.len() != token_ids.len() {
        return Err(value_error(format!(
            "detokenize_step: {} detokenizers but {} token lists",
            detokenizers.len(),
            token_ids.len()
        )));
    }
    detokenizers
        .iter_mut()
        .zip(token_ids)
        .map(|(detokenizer, ids)| detokenizer.push_many(ids))
        .collect()
}
