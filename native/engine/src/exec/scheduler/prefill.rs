//! A waiting request's prompt, chunk by chunk, from its cached prefix if
//! any, into a free slot.

use super::*;

impl Scheduler {
    /// Makes `request` the prompt being prefilled, from its cached prefix if any.
    pub(super) fn start_prefill(&mut self, mut request: Request) -> Result<()> {
        request.prefill_started = Some(Instant::now());
        let len = request.prompt.len() as i32;
        let mut cache = KvCache::new(&self.kv_shape(), 1, len)?;
        let mut done = 0;
        if self.config.prefix_cache_bytes > 0 {
            if let Some(hit) = self.prefix.lookup(&request.prompt) {
                cache.load_prefix(&hit.layers)?;
                done = hit.len;
                request.cached_tokens = hit.len;
            }
        }
        self.prefill = Some(Prefill {
            request,
            cache,
            done,
        });
        Ok(())
    }

    /// Starts the next queued prompt when a slot is free, runs one chunk of
    /// the prompt being prefilled, and moves it into its slot when done.
    pub(super) fn prefill_chunk(&mut self) -> Result<Option<Event>> {
        if self.prefill.is_none() {
            if self.free_slot().is_none() {
                return Ok(None);
            }
            let Some(request) = self.next_request() else {
                return Ok(None);
            };
            self.start_prefill(request)?;
        }
        let p = self.prefill.as_mut().expect("a prefill was just set");
        let len = p.request.prompt.len();
        let end = (p.done + self.config.prefill_chunk).min(len);
        let ids = Array::from_slice(&p.request.prompt[p.done..end], &[1, (end - p.done) as i32]);
        let mask = if end - p.done > 1 {
            AttentionMask::Causal
        } else {
            AttentionMask::None
        };
        let last = end == len;
        let logits = self
            .model
            .forward(&ids, &mut p.cache, &mask, last, &self.workers)?;
        p.request.paths.merge(&crate::backend::take());
        p.done = end;
        if !last {
            transforms::eval(p.cache.arrays())?;
            return Ok(None);
        }
        let logits = logits.reshape(&[1, logits.dim(-1)])?;
        let logits = constrain::mask_logits(logits, &mut [Some(&mut p.request)], &mut self.masks)?;
        let token = sample_one(&mut p.request.sampler, &logits)?;
        transforms::eval(p.cache.arrays())?;
        let Prefill { request, cache, .. } = self.prefill.take().expect("the prefill is running");
        let prompt_kv = cache.prefix(len as i32)?;
        self.seat(request, token, prompt_kv, true).map(Some)
    }

    /// Moves a prefilled request into a free slot: its prompt's keys and
    /// values (`prompt_kv`, per layer `[1, kv_heads, len, head_dim]`, also
    /// offered to the prefix cache when `reusable`) and its first token.
    pub(super) fn seat(
        &mut self,
        request: Request,
        token: u32,
        prompt_kv: Vec<(Array, Array)>,
        reusable: bool,
    ) -> Result<Event> {
        let slot = self
            .free_slot()
            .expect("a slot was free when the prefill began");
        self.cache.write_prompt(slot as i32, &prompt_kv)?;
        if reusable && self.config.prefix_cache_bytes > 0 {
            self.prefix.insert(&request.prompt, prompt_kv);
        }
        self.seat_written(slot, request, token)
    }

    /// Seats a request whose prompt's keys and values are in `slot` already.
    pub(super) fn seat_written(
        &mut self,
        slot: usize,
        mut request: Request,
        token: u32,
    ) -> Result<Event> {
        let delta = request.accept(token, self.tokenizer.as_deref())?;
        let len = request.prompt.len() as i32;
        Ok(self.finish_or_keep(slot, request, len, token, delta))
    }

    /// Puts a row into `slot` unless its last token finished it.
    pub(super) fn finish_or_keep(
        &mut self,
        slot: usize,
        request: Request,
        position: i32,
        next: u32,
        delta: RowDelta,
    ) -> Event {
        let id = request.id;
        if delta.finish.is_some() {
            return Event {
                id,
                stats: Some(RequestStats {
                    kv_dtype: self.config.kv_dtype,
                    ..request.stats()
                }),
                delta,
            };
        }
        self.slots[slot] = Some(Running {
            request,
            position,
            next,
        });
        Event {
            id,
            delta,
            stats: None,
        }
    }
}
