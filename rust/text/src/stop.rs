//! Stop strings over streamed text.
//!
//! Text arrives in arbitrary pieces (one per detokenized token), so a stop string can straddle
//! pieces. The checker therefore holds back the longest tail of the text that is a proper prefix
//! of some stop string: it is released as soon as the following text shows it is not a stop, and
//! never emitted if it is. A partial stop string is thus never shown to the client.
//!
//! Which stop wins when several match is defined on the whole text, independently of how it was
//! split into pieces: the one that is complete first (smallest end offset), and among those the
//! longest. This is exactly what checking after every single character would give.

use crate::error::{Result, TextError};

/// The result of feeding text to a [`StopChecker`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopUpdate {
    /// Text that is now safe to send to the client.
    pub emit: String,
    /// The stop string that matched, when generation must stop now. Text after it is dropped.
    pub stopped: Option<String>,
}

/// Per-request stop-string matcher with hold-back.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stops: Vec<String>,
    include_stop_str_in_output: bool,
    /// Text received but not yet emitted: always a proper prefix of some stop string's start.
    held: String,
    stopped: bool,
}

impl StopChecker {
    /// Creates a checker for `stops`. With `include_stop_str_in_output` the matched stop string
    /// is emitted as the last piece of text; otherwise it is removed. Empty stop strings are
    /// rejected; duplicates are ignored.
    pub fn new<I, S>(stops: I, include_stop_str_in_output: bool) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut unique: Vec<String> = Vec::new();
        for stop in stops {
            let stop = stop.into();
            if stop.is_empty() {
                return Err(TextError::EmptyStopString);
            }
            if !unique.contains(&stop) {
                unique.push(stop);
            }
        }
        Ok(Self {
            stops: unique,
            include_stop_str_in_output,
            held: String::new(),
            stopped: false,
        })
    }

    /// Feeds newly generated text. Returns the text that can be emitted now and, when a stop
    /// string completed, which one. After a stop every further push returns nothing.
    pub fn push(&mut self, new_text: &str) -> StopUpdate {
        if self.stopped {
            return StopUpdate::default();
        }
        if self.stops.is_empty() {
            return StopUpdate {
                emit: new_text.to_string(),
                stopped: None,
            };
        }
        self.held.push_str(new_text);
        if let Some((start, stop_index)) = self.first_match() {
            let stop = self.stops[stop_index].clone();
            let end = if self.include_stop_str_in_output {
                start + stop.len()
            } else {
                start
            };
            let mut emit = std::mem::take(&mut self.held);
            emit.truncate(end);
            self.stopped = true;
            return StopUpdate {
                emit,
                stopped: Some(stop),
            };
        }
        let keep = self.partial_match_len();
        let emit = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        StopUpdate {
            emit,
            stopped: None,
        }
    }

    /// Ends the stream (generation finished for another reason): returns the held-back text,
    /// which turned out not to be a stop string. Empty after a stop.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether a stop string has matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// The stop strings, deduplicated, in the order given.
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// The earliest-completing match in `held`: `(byte offset, index into stops)`.
    fn first_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(i, stop)| self.held.find(stop.as_str()).map(|pos| (pos, i)))
            // Smallest end first; for equal ends the longer stop (smaller start) wins.
            .min_by_key(|&(pos, i)| (pos + self.stops[i].len(), pos))
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_match_len(&self) -> usize {
        self.stops
            .iter()
            .filter_map(|stop| {
                (1..stop.len().min(self.held.len() + 1))
                    .rev()
                    .filter(|&k| stop.is_char_boundary(k))
                    .find(|&k| self.held.ends_with(&stop[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` one by one; returns (everything emitted incl. flush, matched stop).
    fn run(stops: &[&str], include: bool, pieces: &[&str]) -> (String, Option<String>) {
        let mut checker = StopChecker::new(stops.iter().copied(), include).unwrap();
        let mut out = String::new();
        for piece in pieces {
            let update = checker.push(piece);
            out.push_str(&update.emit);
            if update.stopped.is_some() {
                return (out, update.stopped);
            }
        }
        out.push_str(&checker.flush());
        (out, None)
    }

    #[test]
    fn stop_split_across_pieces_is_never_emitted() {
        let mut checker = StopChecker::new(["STOP"], false).unwrap();
        assert_eq!(checker.push("abc S").emit, "abc ");
        assert_eq!(checker.push("T").emit, "");
        assert_eq!(checker.push("O").emit, "");
        let update = checker.push("P and more");
        assert_eq!(update.emit, "");
        assert_eq!(update.stopped.as_deref(), Some("STOP"));
        assert!(checker.is_stopped());
        // Text after a stop is dropped.
        assert_eq!(checker.push("later"), StopUpdate::default());
        assert_eq!(checker.flush(), "");
    }

    #[test]
    fn include_stop_str_in_output() {
        assert_eq!(
            run(&["END"], true, &["foo E", "N", "Dbar"]),
            ("foo END".to_string(), Some("END".to_string()))
        );
        assert_eq!(
            run(&["END"], false, &["foo E", "N", "Dbar"]),
            ("foo ".to_string(), Some("END".to_string()))
        );
    }

    #[test]
    fn stop_at_the_very_start() {
        assert_eq!(
            run(&["\n\n"], false, &["\n", "\nrest"]),
            (String::new(), Some("\n\n".to_string()))
        );
        assert_eq!(
            run(&["Hi"], true, &["Hi there"]),
            ("Hi".to_string(), Some("Hi".to_string()))
        );
    }

    #[test]
    fn held_back_partial_is_released_when_it_does_not_match() {
        let mut checker = StopChecker::new(["</s>"], false).unwrap();
        assert_eq!(checker.push("a <").emit, "a ");
        assert_eq!(checker.push("/").emit, "");
        let update = checker.push("x");
        assert_eq!(update.emit, "</x");
        assert_eq!(update.stopped, None);
        // Held text comes back at the end of the stream.
        assert_eq!(checker.push("y </").emit, "y ");
        assert_eq!(checker.flush(), "</");
    }

    #[test]
    fn multiple_stops_earliest_completion_wins() {
        // "World" completes before "lo Wor..." could; "ab" vs "b": same end, longer wins.
        assert_eq!(
            run(&["xyz", "World"], false, &["Hello Wor", "ld xyz"]),
            ("Hello ".to_string(), Some("World".to_string()))
        );
        assert_eq!(
            run(&["b", "ab"], false, &["cab"]),
            ("c".to_string(), Some("ab".to_string()))
        );
        // A short stop inside a longer candidate completes first.
        assert_eq!(
            run(&["abcd", "bc"], false, &["a", "b", "c", "d"]),
            ("a".to_string(), Some("bc".to_string()))
        );
    }

    #[test]
    fn result_does_not_depend_on_how_text_is_split() {
        let text = "The answer is 42.\nObservation: café ☕ done.\n\nUser: bye";
        let cases: [&[&str]; 3] = [&["Observation:"], &["\n\n", "User:"], &["é ☕", "zzz"]];
        for stops in cases {
            let whole = run(stops, false, &[text]);
            // Every split into three pieces at char boundaries gives the same result.
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
            for (n, &i) in bounds.iter().enumerate() {
                for &j in &bounds[n..] {
                    let pieces = [&text[..i], &text[i..j], &text[j..]];
                    assert_eq!(run(stops, false, &pieces), whole, "split {i},{j}");
                }
            }
        }
    }

    #[test]
    fn multibyte_prefixes_are_held_on_char_boundaries() {
        let mut checker = StopChecker::new(["☕☕"], false).unwrap();
        assert_eq!(checker.push("tea ☕").emit, "tea ");
        assert_eq!(checker.push("!").emit, "☕!");
    }

    #[test]
    fn no_stops_passes_text_through() {
        let mut checker = StopChecker::new(Vec::<String>::new(), false).unwrap();
        assert_eq!(checker.push("anything").emit, "anything");
        assert_eq!(checker.flush(), "");
    }

    #[test]
    fn empty_stop_is_rejected() {
        assert!(matches!(
            StopChecker::new(["ok", ""], false),
            Err(TextError::EmptyStopString)
        ));
    }
}
