//! Keys and values of earlier prompts, reused by later prompts that start
//! with the same tokens (a system prompt, earlier chat turns). A position's
//! keys and values depend only on the tokens up to it, so any common prefix
//! of a stored prompt can be reused. Bounded by a byte budget; the least
//! recently used prompts go first.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

struct Entry {
    tokens: Vec<u32>,
    /// Per layer `[1, kv_heads, tokens, head_dim]`.
    layers: Vec<(Array, Array)>,
    bytes: usize,
    used: u64,
}

pub struct PrefixCache {
    entries: Vec<Entry>,
    budget: usize,
    bytes: usize,
    clock: u64,
    /// Shorter shared prefixes are not worth a lookup's copy.
    min_tokens: usize,
}

/// A reusable prefix: its length and its keys and values.
pub struct Hit {
    pub len: usize,
    pub layers: Vec<(Array, Array)>,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixCache {
    pub fn new(budget: usize, min_tokens: usize) -> Self {
        PrefixCache {
            entries: vec![],
            budget,
            bytes: 0,
            clock: 0,
            min_tokens: min_tokens.max(1),
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest stored prefix of `prompt`, leaving at least its last token
    /// to run (its logits give the first generated token).
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Hit> {
        let limit = prompt.len().saturating_sub(1);
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_prefix(&e.tokens, prompt).min(limit)))
            .max_by_key(|&(_, len)| len)?;
        if len < self.min_tokens {
            return None;
        }
        self.clock += 1;
        let entry = &mut self.entries[best];
        entry.used = self.clock;
        let n = len as i32;
        let layers = entry
            .layers
            .iter()
            .map(|(k, v)| (k.index((.., .., ..n, ..)), v.index((.., .., ..n, ..))))
            .collect();
        Some(Hit { len, layers })
    }

    /// Stores a prompt's keys and values (already evaluated), replacing the
    /// entries it extends, then evicts down to the budget.
    pub fn insert(&mut self, tokens: &[u32], layers: Vec<(Array, Array)>) {
        if tokens.len() < self.min_tokens {
            return;
        }
        let bytes: usize = layers.iter().map(|(k, v)| k.nbytes() + v.nbytes()).sum();
        if bytes > self.budget {
            return;
        }
        self.clock += 1;
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.tokens.starts_with(tokens))
        {
            e.used = self.clock;
            return;
        }
        let mut freed = 0;
        self.entries.retain(|e| {
            let covered = tokens.starts_with(&e.tokens);
            if covered {
                freed += e.bytes;
            }
            !covered
        });
        self.bytes -= freed;
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
            layers,
            bytes,
            used: self.clock,
        });
        self.bytes += bytes;
        while self.bytes > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.bytes -= self.entries.swap_remove(oldest).bytes;
        }
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::common_prefix;

    #[test]
    fn common_prefix_counts_shared_leading_tokens() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(common_prefix(&[5], &[1]), 0);
    }
}
