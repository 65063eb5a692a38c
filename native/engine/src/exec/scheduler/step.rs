//! The running batch's decode steps: each forward pass queued, sampled and
//! read back, the next queued before this one is read.

use super::*;

impl Scheduler {
    /// Up to `max_steps` decode steps. With device samplers the next step
    /// is queued, its inputs being this step's tokens still on the device,
    /// before this step's tokens are read back (`async_eval`), so the host
    /// never stalls the device. A row that finishes in a step is dropped
    /// from the step queued after it: that step's token for it is never
    /// read, and its key and value land past the row's end in a free slot,
    /// where a row joining later writes its prompt over them or never reads.
    pub(super) fn decode(
        &mut self,
        max_steps: usize,
        deadline: Option<Instant>,
        mut driven: Option<&mut Driven>,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        let mut left = max_steps;
        let mut pending: Option<Queued> = None;
        // Another step may start: the first always does, later ones only
        // before the deadline, and for a driven scheduler only while no
        // command waits and no waiting request could take a freed slot.
        let more = |left: usize, yielding: bool| {
            left > 0
                && (left == max_steps || (!yielding && deadline.is_none_or(|d| Instant::now() < d)))
        };
        loop {
            let yielding = driven.as_ref().is_some_and(|d| d.interrupted())
                || (driven.is_some() && self.seat_waiting());
            let current = match pending.take() {
                Some(queued) => queued,
                None => {
                    if !more(left, yielding) || self.slots.iter().all(Option::is_none) {
                        break;
                    }
                    left -= 1;
                    self.queue_step(None)?
                }
            };
            let running = || self.slots.iter().flatten();
            let ahead = more(left, yielding)
                && running().all(|r| r.request.sampler.on_device())
                && !running().all(Running::last_step);
            // A constrained row's mask depends on the token this step is
            // about to read, and its grammar must take that token first: so
            // only the next forward pass is queued ahead (its inputs are
            // this step's tokens, still on the device). Its sampling waits
            // for the tokens, and the masks are computed on the host while
            // the device runs that forward pass.
            let mut forward = None;
            if ahead {
                left -= 1;
                if constrain::any_constrained(running().map(|r| &r.request)) {
                    let f = self.queue_forward(Some(&current))?;
                    transforms::async_eval([&f.logits])?;
                    forward = Some(f);
                } else {
                    pending = Some(self.queue_step(Some(&current))?);
                }
            }
            for event in self.read_step(current)? {
                push(events, event);
            }
            if let Some(d) = driven.as_mut() {
                let occupancy = self.occupancy();
                d.flush(events, occupancy);
            }
            if let Some(f) = forward {
                if self.slots.iter().any(Option::is_some) {
                    pending = Some(self.sample_step(f)?);
                }
            }
        }
        Ok(())
    }

    /// Queues one token for every running row; see [`queue_forward`](Self::queue_forward).
    fn queue_step(&mut self, after: Option<&Queued>) -> Result<Queued> {
        let forward = self.queue_forward(after)?;
        self.sample_step(forward)
    }

    /// Feeds every running row's next token over the first slots (a power
    /// of two of them, so a step takes one of few shapes). `after`: the step
    /// still in flight whose tokens this one takes as inputs.
    fn queue_forward(&mut self, after: Option<&Queued>) -> Result<Forward> {
        let top = self
            .slots
            .iter()
            .rposition(Option::is_some)
            .expect("a step has running rows")
            + 1;
        let n = top.next_power_of_two().min(self.slots.len());
        let last = self.cache.capacity() - 1;
        let shift = i32::from(after.is_some());
        let position = |r: &Running| (r.position + shift).min(last);
        // A free slot takes the furthest row's position (what it writes is
        // never read), so that rows at one position make a step without a mask.
        let furthest = self.slots[..n].iter().flatten().map(position).max();
        let positions: Vec<i32> = self.slots[..n]
            .iter()
            .map(|s| s.as_ref().map_or(furthest.unwrap_or(0), position))
            .collect();
        let rows = n as i32;
        let ids = match after {
            Some(q) => {
                debug_assert!(q.rows >= rows, "rows only leave between steps");
                q.tokens.index(..rows).reshape(&[rows, 1])?
            }
            None => {
                let tokens: Vec<u32> = self.slots[..n]
                    .iter()
                    .map(|s| s.as_ref().map_or(0, |r| r.next))
                    .collect();
                Array::from_slice(&tokens, &[rows, 1])
            }
        };
        self.cache.set_positions(&positions)?;
        let mask = match self.cache.key_ranges()? {
            Some(mask) => AttentionMask::Ranges(mask),
            None => AttentionMask::None,
        };
        let logits = self
            .model
            .forward(&ids, &mut self.cache, &mask, false, &self.workers)?;
        let ran = crate::backend::take();
        for running in self.slots[..n].iter_mut().flatten() {
            running.request.paths.merge(&ran);
        }
        Ok(Forward {
            logits: logits.reshape(&[rows, logits.dim(-1)])?,
            rows,
            ids: self.slots[..n]
                .iter()
                .map(|s| s.as_ref().map(|r| r.request.id))
                .collect(),
        })
    }

    /// Samples a forward pass's logits, each running row with its own
    /// sampler after its constraint's mask, and queues the tokens. Rows
    /// that left since the pass was queued get a token nobody reads.
    fn sample_step(&mut self, forward: Forward) -> Result<Queued> {
        let Forward { logits, rows, ids } = forward;
        let n = rows as usize;
        let mut requests: Vec<Option<&mut Request>> = self.slots[..n]
            .iter_mut()
            .map(|s| s.as_mut().map(|r| &mut r.request))
            .collect();
        let constrained = constrain::write_masks(&logits, &mut requests, &mut self.masks)?;
        let running = || self.slots[..n].iter().flatten();
        // Greedy rows take the argmax, the others their samplers' draws;
        // on a GPU the masks go to our kernels as bits, elsewhere (or where
        // the kernels decline) they are added to the logits.
        let greedy_rows: Vec<bool> = self.slots[..n]
            .iter()
            .map(|s| {
                s.as_ref()
                    .is_none_or(|r| r.request.options.sampler.is_greedy())
            })
            .collect();
        if constrained && !crate::runtime::device::on_cpu_stream() {
            let mask = crate::exec::mask_array(&self.masks, n);
            let samplers: Vec<Option<&Sampler>> = self.slots[..n]
                .iter()
                .zip(&greedy_rows)
                .map(|(s, greedy)| s.as_ref().filter(|_| !greedy).map(|r| &r.request.sampler))
                .collect();
            if let Some(tokens) = masked_tokens(&logits, &mask, &greedy_rows, &samplers)? {
                transforms::async_eval([&tokens])?;
                return Ok(Queued { rows, ids, tokens });
            }
        }
        let logits = if constrained {
            constrain::add_masks(logits, &self.masks)?
        } else {
            logits
        };
        // Greedy rows share one argmax; the others draw with their own sampler.
        let any_greedy = running().any(|r| r.request.options.sampler.is_greedy());
        let all_greedy = running().all(|r| r.request.options.sampler.is_greedy());
        let greedy = if any_greedy {
            Some(crate::sample::greedy(&logits)?)
        } else {
            None
        };
        // Each slot's sampler where its row samples (`None`: greedy or
        // empty), when one does; those rows in one kernel call where they
        // can be.
        let samplers: Option<Vec<Option<&Sampler>>> = (!all_greedy).then(|| {
            self.slots[..n]
                .iter()
                .map(|s| {
                    s.as_ref()
                        .filter(|r| !r.request.options.sampler.is_greedy())
                        .map(|r| &r.request.sampler)
                })
                .collect()
        });
        let batched = match &samplers {
            Some(samplers) => crate::sample::sample_rows(samplers, &logits, None)?,
            None => None,
        };
        let tokens = match (greedy, batched) {
            (Some(g), _) if all_greedy => g,
            (None, Some(sampled)) => sampled,
            (Some(g), Some(sampled)) => {
                mlx_rs::ops::select(Array::from_slice(&greedy_rows, &[rows]), &g, &sampled)?
            }
            (greedy, None) => {
                let mut parts = Vec::with_capacity(n);
                for (i, slot) in self.slots[..n].iter_mut().enumerate() {
                    let i = i as i32;
                    parts.push(match (slot, &greedy) {
                        (Some(r), _) if !r.request.options.sampler.is_greedy() => {
                            let row = logits.index((i..i + 1, ..));
                            sample_one_lazy(&mut r.request.sampler, &row)?
                        }
                        (_, Some(g)) => g.index(i..i + 1),
                        (_, None) => Array::from_slice(&[0u32], &[1]),
                    });
                }
                concatenate(&parts, 0)?
            }
        };
        transforms::async_eval([&tokens])?;
        Ok(Queued { rows, ids, tokens })
    }

    /// Reads a queued step's tokens back and hands them to the rows that
    /// are still running.
    fn read_step(&mut self, step: Queued) -> Result<Vec<Event>> {
        step.tokens.eval()?;
        let tokens = step.tokens.as_slice::<u32>();
        crate::sample::check_drawn(tokens)?;
        let mut events = vec![];
        for (i, id) in step.ids.iter().enumerate() {
            let Some(id) = *id else { continue };
            // Gone: finished in the step before, which was read after this
            // one was queued.
            if self.slots[i].as_ref().is_none_or(|r| r.request.id != id) {
                continue;
            }
            let token = tokens[i];
            let mut running = self.slots[i].take().expect("checked just above");
            let delta = running.request.accept(token, self.tokenizer.as_deref())?;
            let position = running.position + 1;
            events.push(self.finish_or_keep(i, running.request, position, token, delta));
        }
        Ok(events)
    }
}

/// Each row's token among those its mask allows (`[rows, ceil(V / 32)]`
/// bits), by our CUDA kernels: the masked argmax for `greedy` rows, one
/// masked sampling kernel call for the others (`samplers`, `None` for
/// greedy rows). `None` where the kernels do not take the step (the
/// reasons noted).
fn masked_tokens(
    logits: &Array,
    mask: &Array,
    greedy: &[bool],
    samplers: &[Option<&Sampler>],
) -> Result<Option<Array>> {
    let argmax = if greedy.iter().any(|&g| g) {
        match crate::backend::cuda::layer::argmax(logits, Some(mask))? {
            Some(ids) => Some(ids),
            None => return Ok(None),
        }
    } else {
        None
    };
    let drawn = if greedy.iter().all(|&g| g) {
        None
    } else {
        match crate::sample::sample_rows(samplers, logits, Some(mask))? {
            Some(ids) => Some(ids),
            None => return Ok(None),
        }
    };
    Ok(match (argmax, drawn) {
        (Some(a), Some(d)) => Some(mlx_rs::ops::select(
            Array::from_slice(greedy, &[greedy.len() as i32]),
            &a,
            &d,
        )?),
        (a, d) => a.or(d),
    })
}

/// A decode step's forward pass, queued, not yet sampled.
struct Forward {
    /// `[rows, V]`.
    logits: Array,
    /// Slots run: `0..rows`.
    rows: i32,
    /// The request in each slot run when the pass was queued.
    ids: Vec<Option<RequestId>>,
}

/// A decode step queued on the device, not yet read back.
struct Queued {
    /// Slots run: `0..rows`.
    rows: i32,
    /// The request in each slot run when the step was queued.
    ids: Vec<Option<RequestId>>,
    /// The sampled tokens `[rows]` uint32 (anything for free slots).
    tokens: Array,
}

impl Running {
    /// Whether the row's next token surely ends it (length limits).
    fn last_step(&self) -> bool {
        let o = &self.request.options;
        self.request.row.generated.len() + 1 >= o.max_new_tokens
            || self.position as usize + 2 >= o.max_len
    }
}
