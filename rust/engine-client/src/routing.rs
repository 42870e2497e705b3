//! Which engine a new request goes to, when several engines (data-parallel ranks) serve one model.
//!
//! Two inputs decide it (docs/parallel.md, "Routing"):
//! - **Load.** Per serving engine: the requests the front end has in flight there (sent and not
//!   finished: the engine's running plus waiting ones, including those still on the wire) and the
//!   KV-cache usage it last reported. An engine whose cache is nearly full would queue or preempt
//!   a new request, so it only takes one when every engine is that full. Among the rest the one
//!   with the fewest requests in flight wins; ties go to the lower KV usage, then round the engines
//!   (so that an idle server still spreads sequential requests).
//! - **Prefix affinity.** Each request's prompt is cut into blocks of the engines' block size and
//!   hashed as a chain (block `k`'s hash covers blocks `0..=k`, like the engines' prefix cache). A
//!   bounded index remembers which engine last took each chain hash. A request whose longest known
//!   prefix lives on a serving engine goes there — that engine's prefix cache likely still holds
//!   those blocks — unless that engine is overloaded: more than `imbalance_abs` requests and more
//!   than `imbalance_ratio` times the least loaded engine's count in flight, or its cache nearly
//!   full while another's is not. Then the least loaded engine takes it, and the index points the
//!   prefix there from now on.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

/// What the router knows of one serving engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineLoad {
    /// Requests sent to the engine and not finished.
    pub in_flight: usize,
    /// Fraction of its KV blocks in use, as it last reported (0 before its first report).
    pub kv_cache_usage: f64,
}

/// The thresholds of the routing decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoutingPolicy {
    /// KV usage at or above which an engine counts as full.
    pub kv_full: f64,
    /// The prefix's engine is overloaded only with more than this many requests in flight beyond
    /// the least loaded one's...
    pub imbalance_abs: usize,
    /// ...and more than this many times the least loaded one's count.
    pub imbalance_ratio: f64,
}

impl Default for RoutingPolicy {
    /// 95 % KV usage is full; the prefix's engine yields past 8 requests and 1.5x the least loaded.
    fn default() -> Self {
        Self {
            kv_full: 0.95,
            imbalance_abs: 8,
            imbalance_ratio: 1.5,
        }
    }
}

impl RoutingPolicy {
    fn is_full(&self, load: &EngineLoad) -> bool {
        load.kv_cache_usage >= self.kv_full
    }

    /// The least loaded engine among `loads` (`None` entries do not serve), trying engines from
    /// `start` on so that equal loads take turns. `None` when no engine serves.
    pub fn least_loaded(&self, loads: &[Option<EngineLoad>], start: usize) -> Option<usize> {
        let n = loads.len();
        (0..n)
            .map(|k| (start + k) % n.max(1))
            .filter_map(|i| loads[i].map(|load| (i, load)))
            .min_by(|(_, a), (_, b)| {
                (self.is_full(a), a.in_flight)
                    .cmp(&(self.is_full(b), b.in_flight))
                    .then(a.kv_cache_usage.total_cmp(&b.kv_cache_usage))
            })
            .map(|(i, _)| i)
    }

    /// True when `affine` should give the request up to `least`.
    fn overloaded(&self, affine: &EngineLoad, least: &EngineLoad) -> bool {
        if self.is_full(affine) && !self.is_full(least) {
            return true;
        }
        let excess = affine.in_flight.saturating_sub(least.in_flight);
        excess > self.imbalance_abs
            && affine.in_flight as f64 > self.imbalance_ratio * least.in_flight as f64
    }

    /// The engine for a request whose prefix lives on `affine` (if known): `affine` while it
    /// serves and is not overloaded, else the least loaded engine.
    pub fn choose(
        &self,
        loads: &[Option<EngineLoad>],
        affine: Option<usize>,
        start: usize,
    ) -> Option<usize> {
        let least = self.least_loaded(loads, start)?;
        let Some((engine, load)) = affine.and_then(|i| Some((i, (*loads.get(i)?)?))) else {
            return Some(least);
        };
        let least_load = loads[least].expect("least_loaded returns a serving engine");
        if self.overloaded(&load, &least_load) {
            Some(least)
        } else {
            Some(engine)
        }
    }
}

/// Remembers which engine took each prompt prefix, as chain hashes of whole blocks, up to a
/// bounded number of entries (two generations: a lookup refreshes an entry of the older one;
/// when the newer one fills up, the older one is dropped).
#[derive(Debug)]
pub struct PrefixIndex {
    block_size: usize,
    max_blocks: usize,
    generation_capacity: usize,
    current: HashMap<u64, usize>,
    previous: HashMap<u64, usize>,
}

impl PrefixIndex {
    /// An index over blocks of `block_size` tokens that hashes at most `max_blocks` blocks of a
    /// prompt and holds about `capacity` entries.
    pub fn new(block_size: usize, max_blocks: usize, capacity: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            max_blocks,
            generation_capacity: (capacity / 2).max(1),
            current: HashMap::new(),
            previous: HashMap::new(),
        }
    }

    /// Chain hashes of the prompt's whole blocks, first block first (a partial last block is not
    /// hashed: an engine's prefix cache only reuses whole blocks).
    pub fn block_hashes(&self, prompt: &[u32]) -> Vec<u64> {
        let mut parent = 0u64;
        prompt
            .chunks_exact(self.block_size)
            .take(self.max_blocks)
            .map(|block| {
                let mut hasher = DefaultHasher::new();
                parent.hash(&mut hasher);
                block.hash(&mut hasher);
                parent = hasher.finish();
                parent
            })
            .collect()
    }

    /// The engine that took the longest of these prefixes, if any is remembered.
    pub fn lookup(&mut self, hashes: &[u64]) -> Option<usize> {
        hashes.iter().rev().find_map(|h| {
            if let Some(&engine) = self.current.get(h) {
                return Some(engine);
            }
            let engine = self.previous.remove(h)?;
            self.insert(*h, engine);
            Some(engine)
        })
    }

    /// Remembers that `engine` now holds every one of these prefixes.
    pub fn record(&mut self, hashes: &[u64], engine: usize) {
        for &h in hashes {
            self.insert(h, engine);
        }
    }

    /// Forgets every prefix of `engine` (it died: its cache is gone).
    pub fn forget_engine(&mut self, engine: usize) {
        self.current.retain(|_, e| *e != engine);
        self.previous.retain(|_, e| *e != engine);
    }

    /// Entries held now (both generations).
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn insert(&mut self, hash: u64, engine: usize) {
        if self.current.len() >= self.generation_capacity && !self.current.contains_key(&hash) {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(hash, engine);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(in_flight: usize, kv: f64) -> Option<EngineLoad> {
        Some(EngineLoad {
            in_flight,
            kv_cache_usage: kv,
        })
    }

    #[test]
    fn fewest_in_flight_wins_then_kv_usage_then_turns() {
        let p = RoutingPolicy::default();
        assert_eq!(p.least_loaded(&[load(3, 0.1), load(1, 0.9)], 0), Some(1));
        assert_eq!(p.least_loaded(&[load(2, 0.5), load(2, 0.2)], 0), Some(1));
        // Equal loads: the engine at `start` first, so an idle server alternates.
        let idle = [load(0, 0.0), load(0, 0.0), load(0, 0.0)];
        assert_eq!(p.least_loaded(&idle, 0), Some(0));
        assert_eq!(p.least_loaded(&idle, 1), Some(1));
        assert_eq!(p.least_loaded(&idle, 5), Some(2));
    }

    #[test]
    fn engines_that_do_not_serve_are_skipped() {
        let p = RoutingPolicy::default();
        assert_eq!(p.least_loaded(&[None, load(50, 0.5)], 0), Some(1));
        assert_eq!(p.least_loaded(&[None, None], 0), None);
        assert_eq!(p.least_loaded(&[], 0), None);
        assert_eq!(p.choose(&[None, load(5, 0.0)], Some(0), 0), Some(1));
    }

    #[test]
    fn a_full_cache_takes_requests_only_when_all_are_full() {
        let p = RoutingPolicy::default();
        assert_eq!(p.least_loaded(&[load(1, 0.97), load(9, 0.3)], 0), Some(1));
        assert_eq!(p.least_loaded(&[load(1, 0.97), load(9, 0.99)], 0), Some(0));
        // The prefix's engine yields when full and another is not, whatever the counts.
        assert_eq!(
            p.choose(&[load(1, 0.96), load(3, 0.2)], Some(0), 0),
            Some(1)
        );
    }

    #[test]
    fn prefix_engine_kept_until_clearly_overloaded() {
        let p = RoutingPolicy::default();
        // Within the absolute margin: stay.
        assert_eq!(
            p.choose(&[load(10, 0.1), load(2, 0.1)], Some(0), 1),
            Some(0)
        );
        // Past it, but not 1.5x the least loaded: stay.
        assert_eq!(
            p.choose(&[load(40, 0.1), load(30, 0.1)], Some(0), 1),
            Some(0)
        );
        // Past both: the least loaded takes it.
        assert_eq!(
            p.choose(&[load(11, 0.1), load(2, 0.1)], Some(0), 0),
            Some(1)
        );
        assert_eq!(
            p.choose(&[load(50, 0.1), load(30, 0.1)], Some(0), 0),
            Some(1)
        );
        // No known prefix, or an index past the engines: least loaded.
        assert_eq!(p.choose(&[load(3, 0.1), load(2, 0.1)], None, 0), Some(1));
        assert_eq!(p.choose(&[load(3, 0.1), load(2, 0.1)], Some(7), 0), Some(1));
    }

    #[test]
    fn longest_known_prefix_is_found() {
        let mut index = PrefixIndex::new(4, 64, 1000);
        let turn1: Vec<u32> = (0..10).collect(); // two whole blocks, a partial third
        let h1 = index.block_hashes(&turn1);
        assert_eq!(h1.len(), 2);
        index.record(&h1, 1);
        // The next turn of the conversation extends the prompt: same first blocks.
        let turn2: Vec<u32> = (0..30).collect();
        let h2 = index.block_hashes(&turn2);
        assert_eq!(&h2[..2], &h1[..]);
        assert_eq!(index.lookup(&h2), Some(1));
        // Another conversation that shares only the first block, remembered on engine 0, is found
        // there: the longest match wins.
        let other: Vec<u32> = (0..4).chain(100..108).collect();
        let h3 = index.block_hashes(&other);
        assert_eq!(h3[0], h1[0]);
        assert_ne!(h3[1], h1[1]);
        index.record(&h3, 0);
        assert_eq!(index.lookup(&h2), Some(1));
        assert_eq!(index.lookup(&h3), Some(0));
        // Shorter than a block: nothing to match.
        assert!(index.block_hashes(&[1, 2, 3]).is_empty());
        assert_eq!(index.lookup(&[]), None);
    }

    #[test]
    fn same_block_at_another_position_is_another_prefix() {
        let index = PrefixIndex::new(2, 64, 100);
        let a = index.block_hashes(&[1, 2, 1, 2]);
        assert_ne!(a[0], a[1]);
        assert_ne!(index.block_hashes(&[9, 9, 1, 2])[1], a[1]);
    }

    #[test]
    fn index_stays_bounded_and_forgets_dead_engines() {
        let mut index = PrefixIndex::new(1, 10_000, 100);
        let prompt: Vec<u32> = (0..1000).collect();
        let hashes = index.block_hashes(&prompt);
        index.record(&hashes, 0);
        assert!(index.len() <= 100, "{}", index.len());
        // The newest entries are kept.
        assert_eq!(index.lookup(&hashes), Some(0));
        index.forget_engine(0);
        assert!(index.is_empty());
        assert_eq!(index.lookup(&hashes), None);
    }

    #[test]
    fn max_blocks_caps_the_hashing() {
        let index = PrefixIndex::new(16, 4, 100);
        assert_eq!(index.block_hashes(&vec![7; 16 * 10]).len(), 4);
    }
}
