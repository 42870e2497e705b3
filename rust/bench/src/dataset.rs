//! Workloads: the list of prompts a run sends, each with its exact input token count and the number
//! of output tokens it asks for.
//!
//! Token counts come from the model's own tokenizer, so "1024 input tokens" means 1024 tokens to the
//! server too (for `/v1/completions`; the chat route adds the template's tokens on top, as in vLLM).

use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;
use serde::Deserialize;
use tokenizers::Tokenizer;

use crate::args::{DatasetName, ServeArgs};
use crate::error::{BenchError, Result};

/// One request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRequest {
    pub prompt: String,
    /// Prompt length in tokens, counted with the benchmark tokenizer (no special tokens added).
    pub prompt_len: usize,
    /// `max_tokens` sent with the request.
    pub expected_output_len: usize,
}

/// Loads a tokenizer from a `tokenizer.json` file or a folder containing one.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let file = if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    };
    if !file.is_file() {
        return Err(BenchError::Tokenizer {
            path: file,
            reason: "no such file".into(),
        });
    }
    Tokenizer::from_file(&file).map_err(|e| BenchError::Tokenizer {
        path: file,
        reason: e.to_string(),
    })
}

/// Token count of `text` as the server will see it inside a prompt.
pub fn count_tokens(tokenizer: &Tokenizer, text: &str) -> Result<usize> {
    tokenizer
        .encode_fast(text, false)
        .map(|enc| enc.len())
        .map_err(|e| BenchError::Runtime(format!("tokenizer failed: {e}")))
}

/// Builds the workload selected by `--dataset-name`. `n` requests are produced (datasets smaller than
/// `n` are cycled).
pub fn build(
    args: &ServeArgs,
    tokenizer: &Tokenizer,
    n: usize,
    rng: &mut StdRng,
) -> Result<Vec<SampleRequest>> {
    match args.dataset_name {
        DatasetName::Random => {
            if args.dataset_path.is_some() {
                return Err(BenchError::InvalidArgument(
                    "--dataset-path cannot be used with --dataset-name random".into(),
                ));
            }
            let mut gen = TokenTextGenerator::new(tokenizer)?;
            random(&mut gen, args, n, rng)
        }
        DatasetName::PrefixRepetition => {
            let mut gen = TokenTextGenerator::new(tokenizer)?;
            prefix_repetition(&mut gen, args, n, rng)
        }
        DatasetName::Sharegpt => {
            let path = required_path(args, "sharegpt")?;
            let samples = sharegpt(&path, tokenizer, args.sharegpt_output_len)?;
            Ok(cycle_shuffled(samples, n, rng))
        }
        DatasetName::Custom => {
            let path = required_path(args, "custom")?;
            let samples = custom(&path, tokenizer, args.custom_output_len)?;
            Ok(cycle_shuffled(samples, n, rng))
        }
    }
}

fn required_path(args: &ServeArgs, name: &str) -> Result<PathBuf> {
    args.dataset_path.clone().ok_or_else(|| {
        BenchError::InvalidArgument(format!("--dataset-name {name} needs --dataset-path"))
    })
}

/// Shuffles once with the run's seed, then repeats until `n` requests exist.
fn cycle_shuffled(
    mut samples: Vec<SampleRequest>,
    n: usize,
    rng: &mut StdRng,
) -> Vec<SampleRequest> {
    samples.shuffle(rng);
    samples.iter().cycle().take(n).cloned().collect()
}

/// Draws uniformly from `[len*(1-ratio), len*(1+ratio)]`, at least 1 (vLLM's random-dataset rule).
fn sample_len(len: usize, ratio: f64, rng: &mut StdRng) -> usize {
    let lo = ((len as f64) * (1.0 - ratio)).floor().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + ratio)).ceil().max(lo as f64) as usize;
    rng.random_range(lo..=hi)
}

fn random(
    gen: &mut TokenTextGenerator<'_>,
    args: &ServeArgs,
    n: usize,
    rng: &mut StdRng,
) -> Result<Vec<SampleRequest>> {
    if !(0.0..1.0).contains(&args.random_range_ratio) {
        return Err(BenchError::InvalidArgument(
            "--random-range-ratio must be in [0, 1)".into(),
        ));
    }
    let prefix_ids = gen.random_ids(args.random_prefix_len, rng);
    (0..n)
        .map(|_| {
            let input_len = sample_len(args.random_input_len, args.random_range_ratio, rng);
            let output_len = sample_len(args.random_output_len, args.random_range_ratio, rng);
            let mut ids = prefix_ids.clone();
            ids.extend(gen.random_ids(input_len, rng));
            let (prompt, prompt_len) =
                gen.text_of_len(ids, args.random_prefix_len + input_len, rng)?;
            Ok(SampleRequest {
                prompt,
                prompt_len,
                expected_output_len: output_len,
            })
        })
        .collect()
}

fn prefix_repetition(
    gen: &mut TokenTextGenerator<'_>,
    args: &ServeArgs,
    n: usize,
    rng: &mut StdRng,
) -> Result<Vec<SampleRequest>> {
    if args.prefix_repetition_num_prefixes == 0 {
        return Err(BenchError::InvalidArgument(
            "--prefix-repetition-num-prefixes must be > 0".into(),
        ));
    }
    let target = args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len;
    let prefixes: Vec<Vec<u32>> = (0..args.prefix_repetition_num_prefixes)
        .map(|_| gen.random_ids(args.prefix_repetition_prefix_len, rng))
        .collect();
    let mut out = Vec::with_capacity(n);
    // Requests are laid out prefix by prefix and then shuffled, so each prefix is reused by n/k
    // requests that arrive interleaved, as real shared-system-prompt traffic does.
    for i in 0..n {
        let mut ids = prefixes[i % prefixes.len()].clone();
        ids.extend(gen.random_ids(args.prefix_repetition_suffix_len, rng));
        let (prompt, prompt_len) = gen.text_of_len(ids, target, rng)?;
        out.push(SampleRequest {
            prompt,
            prompt_len,
            expected_output_len: args.prefix_repetition_output_len,
        });
    }
    out.shuffle(rng);
    Ok(out)
}

/// Produces text whose re-tokenization has an exact number of tokens.
struct TokenTextGenerator<'a> {
    tokenizer: &'a Tokenizer,
    /// Ordinary (non-special, non-added) token ids to draw from.
    vocab: Vec<u32>,
}

impl<'a> TokenTextGenerator<'a> {
    fn new(tokenizer: &'a Tokenizer) -> Result<Self> {
        let added = tokenizer.get_added_tokens_decoder();
        let mut vocab: Vec<u32> = tokenizer
            .get_vocab(false)
            .into_values()
            .filter(|id| !added.contains_key(id))
            .collect();
        // HashMap order is random per process; sort so a seed always gives the same prompts.
        vocab.sort_unstable();
        if vocab.is_empty() {
            return Err(BenchError::Runtime(
                "tokenizer has an empty vocabulary".into(),
            ));
        }
        Ok(Self { tokenizer, vocab })
    }

    fn random_ids(&self, n: usize, rng: &mut StdRng) -> Vec<u32> {
        (0..n)
            .map(|_| self.vocab[rng.random_range(0..self.vocab.len())])
            .collect()
    }

    /// Decodes `ids` and nudges the token list until the decoded text re-encodes to exactly `target`
    /// tokens (decode→encode is not the identity: merges change at token boundaries). Returns the
    /// text and its true token count, which equals `target` unless the tokenizer never converges.
    fn text_of_len(
        &mut self,
        mut ids: Vec<u32>,
        target: usize,
        rng: &mut StdRng,
    ) -> Result<(String, usize)> {
        let mut best: Option<(String, usize)> = None;
        for _ in 0..16 {
            let text = self
                .tokenizer
                .decode(&ids, true)
                .map_err(|e| BenchError::Runtime(format!("tokenizer decode failed: {e}")))?;
            let enc = self
                .tokenizer
                .encode_fast(text.as_str(), false)
                .map_err(|e| BenchError::Runtime(format!("tokenizer encode failed: {e}")))?;
            let len = enc.len();
            if len == target {
                return Ok((text, len));
            }
            let closer = best
                .as_ref()
                .is_none_or(|(_, b)| len.abs_diff(target) < b.abs_diff(target));
            if closer {
                best = Some((text, len));
            }
            ids = enc.get_ids().to_vec();
            if len > target {
                ids.truncate(target);
            } else {
                ids.extend(self.random_ids(target - len, rng));
            }
        }
        Ok(best.expect("loop runs at least once"))
    }
}

#[derive(Deserialize)]
struct ShareGptEntry {
    conversations: Vec<ShareGptTurn>,
}

#[derive(Deserialize)]
struct ShareGptTurn {
    value: String,
}

/// Loads a ShareGPT JSON file: the first turn of each conversation is the prompt, the second turn's
/// token count is the output length. Same filters as vLLM: skip sequences shorter than 4 tokens,
/// prompts over 1024 tokens and prompt+output over 2048 tokens (unless the output length is fixed).
pub fn sharegpt(
    path: &Path,
    tokenizer: &Tokenizer,
    fixed_output_len: Option<usize>,
) -> Result<Vec<SampleRequest>> {
    let bad = |reason: String| BenchError::Dataset {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let entries: Vec<ShareGptEntry> = serde_json::from_slice(&bytes).map_err(|e| {
        bad(format!(
            "expected a JSON list of {{\"conversations\": [{{\"value\": ...}}, ...]}}: {e}"
        ))
    })?;
    let mut out = Vec::new();
    for entry in entries.iter().filter(|e| e.conversations.len() >= 2) {
        let prompt = &entry.conversations[0].value;
        let prompt_len = count_tokens(tokenizer, prompt)?;
        let output_len = match fixed_output_len {
            Some(n) => n,
            None => count_tokens(tokenizer, &entry.conversations[1].value)?,
        };
        let too_short = prompt_len < 4 || output_len < 4;
        let too_long =
            fixed_output_len.is_none() && (prompt_len > 1024 || prompt_len + output_len > 2048);
        if !too_short && !too_long {
            out.push(SampleRequest {
                prompt: prompt.clone(),
                prompt_len,
                expected_output_len: output_len,
            });
        }
    }
    if out.is_empty() {
        return Err(bad(
            "no conversation with at least two turns of usable length".into(),
        ));
    }
    Ok(out)
}

#[derive(Deserialize)]
struct CustomLine {
    prompt: String,
    #[serde(default)]
    output_tokens: Option<usize>,
}

/// Loads a prompts file. `.jsonl` files hold one `{"prompt": ..., "output_tokens"?: N}` object per
/// line (vLLM's custom format); any other file holds one plain-text prompt per non-empty line.
pub fn custom(path: &Path, tokenizer: &Tokenizer, output_len: usize) -> Result<Vec<SampleRequest>> {
    let bad = |reason: String| BenchError::Dataset {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    let mut out = Vec::new();
    for (lineno, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let (prompt, out_len) = if jsonl {
            let parsed: CustomLine = serde_json::from_str(line).map_err(|e| {
                bad(format!(
                    "line {}: expected {{\"prompt\": \"...\"}}: {e}",
                    lineno + 1
                ))
            })?;
            (parsed.prompt, parsed.output_tokens.unwrap_or(output_len))
        } else {
            (line.to_string(), output_len)
        };
        let prompt_len = count_tokens(tokenizer, &prompt)?;
        out.push(SampleRequest {
            prompt,
            prompt_len,
            expected_output_len: out_len,
        });
    }
    if out.is_empty() {
        return Err(bad("file has no prompts".into()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    pub(crate) fn fixture_tokenizer() -> Tokenizer {
        let path = Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("run under cargo"))
            .join("../../tests/fixtures/smollm2/tokenizer.json");
        load_tokenizer(&path).expect("fixture tokenizer")
    }

    fn args(extra: &[&str]) -> ServeArgs {
        use clap::Parser;
        let mut argv = vec!["voltllm-bench", "serve"];
        argv.extend_from_slice(extra);
        match crate::args::Cli::parse_from(argv).command {
            crate::args::Command::Serve(a) => *a,
        }
    }

    #[test]
    fn random_prompts_have_exact_token_lengths() {
        let tok = fixture_tokenizer();
        let a = args(&[
            "--random-input-len",
            "100",
            "--random-output-len",
            "7",
            "--random-range-ratio",
            "0.5",
        ]);
        let mut rng = StdRng::seed_from_u64(1);
        let reqs = build(&a, &tok, 20, &mut rng).unwrap();
        assert_eq!(reqs.len(), 20);
        let lens: Vec<usize> = reqs.iter().map(|r| r.prompt_len).collect();
        for r in &reqs {
            assert_eq!(count_tokens(&tok, &r.prompt).unwrap(), r.prompt_len);
            assert!((50..=150).contains(&r.prompt_len), "{}", r.prompt_len);
            assert!((3..=11).contains(&r.expected_output_len));
        }
        assert!(
            lens.iter().any(|&l| l != lens[0]),
            "range ratio must vary lengths"
        );
    }

    #[test]
    fn random_fixed_length_is_exact() {
        let tok = fixture_tokenizer();
        let a = args(&["--random-input-len", "64"]);
        let reqs = build(&a, &tok, 10, &mut StdRng::seed_from_u64(3)).unwrap();
        assert!(
            reqs.iter().all(|r| r.prompt_len == 64),
            "{:?}",
            reqs.iter().map(|r| r.prompt_len).collect::<Vec<_>>()
        );
    }

    #[test]
    fn seed_makes_workload_reproducible() {
        let tok = fixture_tokenizer();
        let a = args(&["--random-input-len", "32"]);
        let x = build(&a, &tok, 5, &mut StdRng::seed_from_u64(9)).unwrap();
        let y = build(&a, &tok, 5, &mut StdRng::seed_from_u64(9)).unwrap();
        let z = build(&a, &tok, 5, &mut StdRng::seed_from_u64(10)).unwrap();
        assert_eq!(x, y);
        assert_ne!(x, z);
    }

    #[test]
    fn prefix_repetition_shares_prefixes() {
        let tok = fixture_tokenizer();
        let a = args(&[
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            "40",
            "--prefix-repetition-suffix-len",
            "10",
            "--prefix-repetition-num-prefixes",
            "2",
        ]);
        let reqs = build(&a, &tok, 8, &mut StdRng::seed_from_u64(0)).unwrap();
        let mut heads: Vec<String> = reqs
            .iter()
            .map(|r| r.prompt.chars().take(60).collect())
            .collect();
        heads.sort();
        heads.dedup();
        assert_eq!(heads.len(), 2, "8 requests over 2 prefixes");
        assert!(reqs.iter().all(|r| r.prompt_len == 50));
    }

    #[test]
    fn sharegpt_parses_and_rejects_malformed() {
        let tok = fixture_tokenizer();
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("sg.json");
        std::fs::write(
            &good,
            r#"[{"conversations":[{"from":"human","value":"Tell me a long story about a cat and a dog."},
                {"from":"gpt","value":"Once upon a time there was a cat and a dog who were friends."}]},
               {"conversations":[{"from":"human","value":"hi"}]}]"#,
        )
        .unwrap();
        let reqs = sharegpt(&good, &tok, None).unwrap();
        assert_eq!(reqs.len(), 1);
        assert!(reqs[0].expected_output_len > 4);
        let broken = dir.path().join("bad.json");
        std::fs::write(&broken, r#"{"not": "a list"}"#).unwrap();
        let err = sharegpt(&broken, &tok, None).unwrap_err().to_string();
        assert!(err.starts_with("malformed dataset"), "{err}");
    }

    #[test]
    fn custom_reads_jsonl_and_plain_text() {
        let tok = fixture_tokenizer();
        let dir = tempfile::tempdir().unwrap();
        let jl = dir.path().join("p.jsonl");
        std::fs::write(
            &jl,
            "{\"prompt\": \"hello there\", \"output_tokens\": 5}\n\n{\"prompt\": \"bye\"}\n",
        )
        .unwrap();
        let reqs = custom(&jl, &tok, 9).unwrap();
        assert_eq!(
            reqs.iter()
                .map(|r| r.expected_output_len)
                .collect::<Vec<_>>(),
            vec![5, 9]
        );
        let txt = dir.path().join("p.txt");
        std::fs::write(&txt, "one prompt\nanother prompt\n").unwrap();
        assert_eq!(custom(&txt, &tok, 3).unwrap().len(), 2);
        std::fs::write(&jl, "{\"text\": 1}\n").unwrap();
        let err = custom(&jl, &tok, 3).unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
    }
}
