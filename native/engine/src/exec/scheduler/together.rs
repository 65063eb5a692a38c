//! Short waiting prompts prefilled together: one forward pass for several
//! requests instead of one each, when slots are free for all of them.
//!
//! Prompts are padded on the right, so every row's tokens sit at positions
//! `0..len` and a causal mask keeps each real token's attention on its own
//! row's earlier tokens: each row's keys, values and last logits are those
//! of its prompt run alone. The padding's own outputs are never read.

use std::time::Instant;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{transforms, Array};

use super::{constrain, push, sample_one_lazy, Event, Request, Scheduler};
use crate::error::Result;
use crate::kv::cache::KvCache;
use crate::model::AttentionMask;

impl Scheduler {
    /// Takes the waiting requests to prefill next while a slot is free for
    /// each, none has a cached prefix, and the padded group stays within one
    /// prefill chunk (so a call's prefill work is bounded as the chunked path
    /// bounds it, and running rows keep their pace). With
    /// two or more, prefills them together and returns their events; with
    /// one, starts its prefill alone; with none, does nothing. `false`: the
    /// usual chunked prefill has the step.
    pub(super) fn prefill_together(&mut self, events: &mut Vec<Event>) -> Result<bool> {
        if self.prefill.is_some() {
            return Ok(false);
        }
        let free = self.slots.iter().filter(|s| s.is_none()).count();
        let mut group: Vec<Request> = vec![];
        let mut longest = 0;
        while group.len() < free {
            let Some(i) = self.next_index() else { break };
            let prompt = &self.queue[i].prompt;
            let padded = (group.len() + 1) * longest.max(prompt.len());
            let cached = self.config.prefix_cache_bytes > 0 && self.prefix.lookup(prompt).is_some();
            if padded > self.config.prefill_chunk || cached {
                break;
            }
            longest = longest.max(prompt.len());
            group.push(self.take_queued(i));
        }
        match group.len() {
            0 => Ok(false),
            1 => {
                let request = group.pop().expect("one request");
                self.start_prefill(request)?;
                Ok(false)
            }
            _ => {
                for event in self.prefill_group(group)? {
                    push(events, event);
                }
                Ok(true)
            }
        }
    }

    fn prefill_group(&mut self, mut group: Vec<Request>) -> Result<Vec<Event>> {
        let n = group.len();
        let longest = group.iter().map(|r| r.prompt.len()).max().unwrap_or(1);
        let mut ids = Vec::with_capacity(n * longest);
        for r in &mut group {
            r.prefill_started = Some(Instant::now());
            ids.extend(&r.prompt);
            ids.extend(std::iter::repeat_n(0u32, longest - r.prompt.len()));
        }
        let ids = Array::from_slice(&ids, &[n as i32, longest as i32]);
        let last: Vec<i32> = group.iter().map(|r| r.prompt.len() as i32 - 1).collect();
        let mut cache = KvCache::new(&self.kv_shape(), n as i32, longest as i32)?;
        let mask = if longest > 1 {
            AttentionMask::Causal
        } else {
            AttentionMask::None
        };
        let at = Array::from_slice(&last, &[n as i32]);
        let logits = self
            .model
            .forward_at(&ids, &mut cache, &mask, &at, &self.workers)?;
        let ran = crate::backend::take();
        for r in group.iter_mut() {
            r.paths.merge(&ran);
        }
        let logits = logits.reshape(&[n as i32, logits.dim(-1)])?;
        let mut rows: Vec<Option<&mut Request>> = group.iter_mut().map(Some).collect();
        let logits = constrain::mask_logits(logits, &mut rows, &mut self.masks)?;
        // Drawn lazily and read back together with the cache: one wait on
        // the device for the group, not one per row.
        let mut drawn = Vec::with_capacity(n);
        for (i, r) in group.iter_mut().enumerate() {
            let i = i as i32;
            drawn.push(sample_one_lazy(
                &mut r.sampler,
                &logits.index((i..i + 1, ..)),
            )?);
        }
        transforms::eval(drawn.iter().chain(cache.arrays()))?;
        let tokens: Vec<u32> = drawn.iter().map(|t| t.as_slice::<u32>()[0]).collect();
        let kv = cache.prefix(longest as i32)?;
        let mut events = Vec::with_capacity(n);
        // The rows take the lowest free slots. Where those follow one
        // another (an idle batch's do), the group's keys and values go in
        // with one write a layer, not one a row and layer; a row's padding
        // lands past its end, which its mask hides until it writes there.
        let free: Vec<usize> = (0..self.slots.len())
            .filter(|&s| self.slots[s].is_none())
            .take(n)
            .collect();
        if free.len() == n && free.windows(2).all(|w| w[1] == w[0] + 1) {
            self.cache.write_prompt(free[0] as i32, &kv)?;
            for ((request, token), slot) in group.into_iter().zip(tokens).zip(free) {
                events.push(self.seat_written(slot, request, token)?);
            }
            return Ok(events);
        }
        for (i, (request, token)) in group.into_iter().zip(tokens).enumerate() {
            let (i, len) = (i as i32, request.prompt.len() as i32);
            let row: Vec<(Array, Array)> = kv
                .iter()
                .map(|(k, v)| {
                    (
                        k.index((i..i + 1, .., ..len, ..)),
                        v.index((i..i + 1, .., ..len, ..)),
                    )
                })
                .collect();
            // Not kept in the prefix cache: a row is a view of the group's
            // buffer, which it would hold whole.
            events.push(self.seat(request, token, row, false)?);
        }
        Ok(events)
    }
}
