//! Finding a model's chat template(s) and special-token strings in its folder.
//!
//! Sources, in transformers' order of precedence: `chat_template.jinja` (the default template) and
//! `additional_chat_templates/*.jinja` (named ones); otherwise the `chat_template` entry of
//! `tokenizer_config.json`, either a string or a list of `{"name", "template"}` objects.

use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value as Json;

use crate::error::{ChatError, Result};
use crate::template::{ChatTemplate, SpecialTokenStrings, DEFAULT_TEMPLATE_NAME};

const TEMPLATE_FILE: &str = "chat_template.jinja";
const TEMPLATE_DIR: &str = "additional_chat_templates";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";

#[derive(Debug, Default, Deserialize)]
struct TokenizerConfigFile {
    chat_template: Option<Json>,
    bos_token: Option<Json>,
    eos_token: Option<Json>,
    unk_token: Option<Json>,
    pad_token: Option<Json>,
}

impl ChatTemplate {
    /// Loads the chat template(s) of a model folder, with `bos_token` / `eos_token` /
    /// `unk_token` / `pad_token` from `tokenizer_config.json`. `Ok(None)` when the model has no
    /// chat template (a base model).
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Option<ChatTemplate>> {
        let dir = dir.as_ref();
        let config_path = dir.join(TOKENIZER_CONFIG);
        let config: TokenizerConfigFile = match read_optional(&config_path)? {
            Some(text) => serde_json::from_str(&text).map_err(|e| ChatError::Config {
                path: config_path.clone(),
                message: e.to_string(),
            })?,
            None => TokenizerConfigFile::default(),
        };
        let tokens = SpecialTokenStrings {
            bos_token: token_string(config.bos_token.as_ref()),
            eos_token: token_string(config.eos_token.as_ref()),
            unk_token: token_string(config.unk_token.as_ref()),
            pad_token: token_string(config.pad_token.as_ref()),
        };

        let mut templates = template_files(dir)?;
        if templates.is_empty() {
            if let Some(entry) = config.chat_template {
                templates = templates_from_config(entry, &config_path)?;
            }
        }
        if templates.is_empty() {
            return Ok(None);
        }
        ChatTemplate::with_named(templates, tokens).map(Some)
    }
}

/// `chat_template.jinja` and `additional_chat_templates/<name>.jinja`.
fn template_files(dir: &Path) -> Result<Vec<(String, String)>> {
    let mut templates = Vec::new();
    if let Some(source) = read_optional(&dir.join(TEMPLATE_FILE))? {
        templates.push((DEFAULT_TEMPLATE_NAME.to_string(), source));
    }
    let extra_dir = dir.join(TEMPLATE_DIR);
    if extra_dir.is_dir() {
        let entries = fs::read_dir(&extra_dir).map_err(|source| ChatError::Io {
            path: extra_dir.clone(),
            source,
        })?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == "jinja"))
            .collect();
        paths.sort();
        for path in paths {
            let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            let name = name.to_string();
            if let Some(source) = read_optional(&path)? {
                templates.push((name, source));
            }
        }
    }
    Ok(templates)
}

/// The `chat_template` entry of `tokenizer_config.json`: a string, or a list of named templates.
fn templates_from_config(entry: Json, path: &Path) -> Result<Vec<(String, String)>> {
    let invalid = |message: String| ChatError::Config {
        path: path.to_path_buf(),
        message,
    };
    match entry {
        Json::Null => Ok(Vec::new()),
        Json::String(source) => Ok(vec![(DEFAULT_TEMPLATE_NAME.to_string(), source)]),
        Json::Array(items) => items
            .into_iter()
            .map(|item| {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some(name), Some(template)) => Ok((name.to_string(), template.to_string())),
                    _ => Err(invalid(
                        "each chat_template list entry needs string \"name\" and \"template\""
                            .into(),
                    )),
                }
            })
            .collect(),
        _ => Err(invalid(
            "chat_template must be a string or a list of {name, template}".into(),
        )),
    }
}

/// A token entry: a string or a serialized `AddedToken` (`{"content": ...}`).
fn token_string(entry: Option<&Json>) -> Option<String> {
    match entry? {
        Json::String(s) => Some(s.clone()),
        Json::Object(map) => map.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

fn read_optional(path: &Path) -> Result<Option<String>> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ChatError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}
