//! A thread-safe, cheaply cloneable wrapper around a Hugging Face fast tokenizer.
//!
//! `tokenizer.json` defines the encoding, including which special tokens `add_special_tokens`
//! adds (its post-processor; like transformers 5, `add_bos_token` / `add_eos_token` in the config
//! are ignored when `tokenizer.json` exists). `tokenizer_config.json` (when the tokenizer is
//! loaded from a model folder) supplies the names of the BOS / EOS / PAD / UNK tokens;
//! `generation_config.json` may add further end-of-sequence ids (Llama 3 lists several), which
//! are merged into [`Tokenizer::eos_token_ids`].

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::error::{Result, TextError};

/// A Hugging Face tokenizer plus the special-token facts of its model.
///
/// Cloning is cheap (an `Arc` bump) and the type is `Send + Sync`, so one instance can serve every
/// request of a server.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    tokenizer: tokenizers::Tokenizer,
    vocab_size: usize,
    special: SpecialTokens,
}

/// Special tokens read from `tokenizer_config.json` / `generation_config.json`, and what the
/// post-processor adds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct SpecialTokens {
    bos_token: Option<String>,
    bos_token_id: Option<u32>,
    eos_token: Option<String>,
    eos_token_ids: Vec<u32>,
    pad_token: Option<String>,
    pad_token_id: Option<u32>,
    unk_token: Option<String>,
    unk_token_id: Option<u32>,
    /// Ids of every added token marked `special` in `tokenizer.json`, sorted.
    special_token_ids: Vec<u32>,
    add_bos_token: bool,
    add_eos_token: bool,
}

/// A token entry of `tokenizer_config.json`: either the plain string or a serialized
/// `AddedToken` object (`{"content": "<s>", "lstrip": false, ...}`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenEntry {
    Plain(String),
    Added { content: String },
}

impl TokenEntry {
    fn into_content(self) -> String {
        match self {
            TokenEntry::Plain(s) | TokenEntry::Added { content: s } => s,
        }
    }
}

/// The subset of `tokenizer_config.json` the text layer needs. Unknown keys are ignored.
#[derive(Debug, Default, Deserialize)]
struct TokenizerConfigFile {
    bos_token: Option<TokenEntry>,
    eos_token: Option<TokenEntry>,
    pad_token: Option<TokenEntry>,
    unk_token: Option<TokenEntry>,
}

/// `eos_token_id` of `generation_config.json`: one id or a list of ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Debug, Default, Deserialize)]
struct GenerationConfigFile {
    eos_token_id: Option<OneOrMany>,
}

impl Tokenizer {
    /// Loads a tokenizer from a `tokenizer.json` file alone.
    ///
    /// Without `tokenizer_config.json` the BOS/EOS/PAD/UNK names are unknown, so
    /// [`Tokenizer::eos_token_ids`] is empty; use [`Tokenizer::from_model_dir`] for a model.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let tokenizer = load_tokenizer_json(path)?;
        Self::build(tokenizer, path, None, None)
    }

    /// Loads the tokenizer of a model folder: `tokenizer.json` (required),
    /// `tokenizer_config.json` and `generation_config.json` (both optional).
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            return Err(TextError::MissingTokenizerFile(dir.to_path_buf()));
        }
        let tokenizer = load_tokenizer_json(&tokenizer_path)?;
        let config: Option<TokenizerConfigFile> =
            read_optional_json(&dir.join("tokenizer_config.json"))?;
        let generation: Option<GenerationConfigFile> =
            read_optional_json(&dir.join("generation_config.json"))?;
        Self::build(tokenizer, dir, config, generation)
    }

    fn build(
        mut tokenizer: tokenizers::Tokenizer,
        source: &Path,
        config: Option<TokenizerConfigFile>,
        generation: Option<GenerationConfigFile>,
    ) -> Result<Self> {
        // transformers enables padding/truncation per call only; a tokenizer.json that stores
        // them would otherwise silently cut or pad every prompt.
        tokenizer.with_truncation(None).ok();
        tokenizer.with_padding(None);

        let mut special = SpecialTokens::default();
        if let Some(config) = config {
            special.bos_token = config.bos_token.map(TokenEntry::into_content);
            special.eos_token = config.eos_token.map(TokenEntry::into_content);
            special.pad_token = config.pad_token.map(TokenEntry::into_content);
            special.unk_token = config.unk_token.map(TokenEntry::into_content);
        }
        let id_of =
            |token: &Option<String>| token.as_deref().and_then(|t| tokenizer.token_to_id(t));
        special.bos_token_id = id_of(&special.bos_token);
        special.pad_token_id = id_of(&special.pad_token);
        special.unk_token_id = id_of(&special.unk_token);
        let mut eos_ids: Vec<u32> = id_of(&special.eos_token).into_iter().collect();
        if let Some(ids) = generation.and_then(|g| g.eos_token_id) {
            let extra = match ids {
                OneOrMany::One(id) => vec![id],
                OneOrMany::Many(ids) => ids,
            };
            for id in extra {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        special.eos_token_ids = eos_ids;

        // What the post-processor really adds, probed on the empty text: transformers 5 ignores
        // `add_bos_token` / `add_eos_token` from the config when `tokenizer.json` exists.
        let probe = tokenizer
            .encode_fast("", true)
            .map_err(|e| TextError::Load {
                path: source.to_path_buf(),
                message: format!("encoding the empty text failed: {e}"),
            })?;
        let probe = probe.get_ids();
        special.add_bos_token =
            special.bos_token_id.is_some() && probe.first() == special.bos_token_id.as_ref();
        special.add_eos_token =
            special.eos_token_id().is_some() && probe.last() == special.eos_token_id().as_ref();

        let added = tokenizer.get_added_tokens_decoder();
        let special_ids: BTreeSet<u32> = added
            .iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| *id)
            .collect();
        special.special_token_ids = special_ids.into_iter().collect();
        let vocab_size = tokenizer.get_vocab_size(true);
        Ok(Self {
            inner: Arc::new(Inner {
                tokenizer,
                vocab_size,
                special,
            }),
        })
    }

    /// Encodes `text` into token ids. `add_special_tokens` applies the post-processor (BOS/EOS
    /// as the tokenizer defines them); special tokens written inside `text` are always
    /// recognised, as in transformers.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TextError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Encodes several texts (in parallel where the `tokenizers` library chooses to).
    pub fn encode_batch<S: AsRef<str>>(
        &self,
        texts: &[S],
        add_special_tokens: bool,
    ) -> Result<Vec<Vec<u32>>> {
        let inputs: Vec<&str> = texts.iter().map(AsRef::as_ref).collect();
        let encodings = self
            .inner
            .tokenizer
            .encode_batch_fast(inputs, add_special_tokens)
            .map_err(|e| TextError::Encode(e.to_string()))?;
        Ok(encodings.iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// Decodes token ids into text. An id without a token (the padded part of a model's
    /// embedding matrix: Qwen's config says 151,936 ids, its tokenizer has 151,669) decodes as
    /// empty text, as in Hugging Face tokenizers; the engine bounds ids by the model's
    /// `vocab_size`. `clean_up_tokenization_spaces` is not applied, matching transformers for BPE
    /// tokenizers and vLLM/TGI's streaming output.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::Decode(e.to_string()))
    }

    /// Decodes several id sequences.
    pub fn decode_batch(&self, ids: &[&[u32]], skip_special_tokens: bool) -> Result<Vec<String>> {
        ids.iter()
            .map(|ids| self.decode(ids, skip_special_tokens))
            .collect()
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// The id of a token string (vocabulary or added token), if any.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tokenizer.token_to_id(token)
    }

    /// The token string of an id, in the model's internal form (e.g. `Ġhello` for byte-level BPE).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tokenizer.id_to_token(id)
    }

    /// The BOS token string from `tokenizer_config.json`.
    pub fn bos_token(&self) -> Option<&str> {
        self.inner.special.bos_token.as_deref()
    }

    /// The BOS token id, when the BOS token is in the vocabulary.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.special.bos_token_id
    }

    /// The EOS token string from `tokenizer_config.json`.
    pub fn eos_token(&self) -> Option<&str> {
        self.inner.special.eos_token.as_deref()
    }

    /// Every id that ends generation: the EOS token of `tokenizer_config.json` first, then the
    /// `eos_token_id`s of `generation_config.json`. Empty when loaded with [`Tokenizer::from_file`].
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.special.eos_token_ids
    }

    /// The PAD token string from `tokenizer_config.json`.
    pub fn pad_token(&self) -> Option<&str> {
        self.inner.special.pad_token.as_deref()
    }

    /// The PAD token id, when the PAD token is in the vocabulary.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.inner.special.pad_token_id
    }

    /// The UNK token string from `tokenizer_config.json`.
    pub fn unk_token(&self) -> Option<&str> {
        self.inner.special.unk_token.as_deref()
    }

    /// The UNK token id, when the UNK token is in the vocabulary.
    pub fn unk_token_id(&self) -> Option<u32> {
        self.inner.special.unk_token_id
    }

    /// Whether `encode(text, true)` starts with the BOS token (decided by the post-processor of
    /// `tokenizer.json`, as in transformers 5). A rendered chat template usually contains BOS
    /// already, so chat prompts are encoded with `add_special_tokens = false`.
    pub fn add_bos_token(&self) -> bool {
        self.inner.special.add_bos_token
    }

    /// Whether `encode(text, true)` ends with the EOS token.
    pub fn add_eos_token(&self) -> bool {
        self.inner.special.add_eos_token
    }

    /// Ids of all added tokens marked special (those `skip_special_tokens` removes), sorted.
    pub fn special_token_ids(&self) -> &[u32] {
        &self.inner.special.special_token_ids
    }

    /// Whether `id` is a special token (removed by `skip_special_tokens`).
    pub fn is_special_token(&self, id: u32) -> bool {
        self.inner
            .special
            .special_token_ids
            .binary_search(&id)
            .is_ok()
    }

    /// The underlying `tokenizers` tokenizer, for features this wrapper does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner.tokenizer
    }
}

impl SpecialTokens {
    fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_ids.first().copied()
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.vocab_size)
            .field("bos_token", &self.inner.special.bos_token)
            .field("eos_token", &self.inner.special.eos_token)
            .field("eos_token_ids", &self.inner.special.eos_token_ids)
            .finish_non_exhaustive()
    }
}

fn load_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer> {
    if !path.is_file() {
        return Err(TextError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        });
    }
    tokenizers::Tokenizer::from_file(path).map_err(|e| TextError::Load {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

fn read_optional_json<T: for<'de> Deserialize<'de>>(path: &PathBuf) -> Result<Option<T>> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TextError::Io {
                path: path.clone(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TextError::Config {
            path: path.clone(),
            message: e.to_string(),
        })
}
