//! The batch's grammar-constrained rows: their parser states, the additive
//! logit bias their masks become, and the tokens their grammars force.
//!
//! A forced token (the only one a grammar allows) is taken without
//! computing a mask (fast-forward). A single row runs ahead: it takes every
//! forced token after its sampled one, unsampled, and all of them go
//! through the model in one forward pass. In a batch, where rows must stay
//! aligned in the cache, and where steps are replayed on a GPU (one token a
//! step), a row takes one forced token per step, its mask that token alone.
//!
//! Masks are bits, 32 tokens a word: on a GPU our sampling kernels read
//! them; elsewhere they become an additive bias on the logits.

use std::time::Instant;

use mlx_rs::Array;

use super::rows::Row;
use super::{FinishReason, GenerateOptions, RowDelta};
use crate::error::{Error, Result};
use crate::text::constraint::RowConstraint;
use crate::text::tokenizer::Tokenizer;

/// What a row's token is checked against when it is taken.
pub(super) struct Rules<'a> {
    pub options: &'a GenerateOptions,
    pub eos: &'a [u32],
    pub tokenizer: Option<&'a Tokenizer>,
}

pub(super) struct Constraints {
    rows: Vec<Option<RowConstraint>>,
    fast_forward: bool,
    /// A single constrained row takes its forced tokens one a step, as
    /// batch rows do, instead of running ahead (steps replayed on a GPU,
    /// whose masks go to the device).
    in_step: bool,
    /// Each row's token for the coming step when its grammar forces it
    /// (unless a single row runs ahead).
    next_forced: Vec<Option<u32>>,
    /// The coming step's masks: `ceil(vocab / 32)` words a row (see
    /// [`RowConstraint::write_mask`]), reused.
    masks: Vec<u32>,
    /// Host time spent on masks and forced tokens.
    pub ms: f64,
    /// Forced tokens each row took.
    pub forced: Vec<usize>,
}

impl Constraints {
    /// Compiles every row's constraint (before any model work, so a bad
    /// grammar fails fast).
    pub fn new(
        tokenizer: Option<&Tokenizer>,
        options: &GenerateOptions,
        batch: usize,
    ) -> Result<Self> {
        let rows = (0..batch)
            .map(
                |i| match options.rows.get(i).and_then(|r| r.constraint.as_ref()) {
                    Some(spec) => {
                        let tokenizer = tokenizer.ok_or_else(|| {
                            Error::InvalidConstraint(
                                "constrained decoding needs a tokenizer".into(),
                            )
                        })?;
                        RowConstraint::new(&*tokenizer.constraint_factory()?, spec).map(Some)
                    }
                    None => Ok(None),
                },
            )
            .collect::<Result<Vec<_>>>()?;
        Ok(Constraints {
            rows,
            fast_forward: options.fast_forward,
            in_step: false,
            next_forced: vec![None; batch],
            masks: vec![],
            ms: 0.0,
            forced: vec![0; batch],
        })
    }

    /// Whether no row is constrained.
    pub fn none(&self) -> bool {
        self.rows.iter().all(Option::is_none)
    }

    /// Whether one row, constrained, runs ahead through its forced tokens.
    pub fn runs_ahead(&self) -> bool {
        !self.in_step && self.fast_forward && self.rows.len() == 1 && self.rows[0].is_some()
    }

    /// Before the first step: a single row takes its forced tokens one a
    /// step (`false`), or runs ahead where fast-forward allows (`true`).
    pub fn set_runs_ahead(&mut self, ahead: bool) {
        self.in_step = !ahead;
    }

    /// Whether some unfinished row is constrained.
    pub fn active(&self, rows: &[Row]) -> bool {
        self.rows
            .iter()
            .zip(rows)
            .any(|(c, r)| c.is_some() && r.finish.is_none())
    }

    /// Before the first step: a batch row's forced first token; a single
    /// row's forced tokens, taken now (they are fed after the prompt).
    pub fn start(
        &mut self,
        rows: &mut [Row],
        rules: &Rules,
        delta: &mut RowDelta,
    ) -> Result<Vec<u32>> {
        if self.runs_ahead() {
            return self.run_ahead(0, &mut rows[0], rules, delta);
        }
        for i in 0..rows.len() {
            self.plan_forced(i)?;
        }
        Ok(vec![])
    }

    /// Row `i` takes the step's `token`, and its grammar after it. Returns
    /// the forced tokens a single row took after it, which the model has
    /// yet to see.
    pub fn take(
        &mut self,
        i: usize,
        token: u32,
        row: &mut Row,
        rules: &Rules,
        delta: &mut RowDelta,
    ) -> Result<Vec<u32>> {
        if row.finish.is_some() {
            return Ok(vec![]);
        }
        let Some(c) = self.rows[i].as_mut() else {
            row.accept(token, rules.options, rules.eos, rules.tokenizer, delta)?;
            return Ok(vec![]);
        };
        if c.is_complete() {
            // Its mask allowed nothing: the row ends before this token.
            return row
                .end(FinishReason::Stop, rules.tokenizer, delta)
                .map(|_| vec![]);
        }
        if self.next_forced[i].take().is_some() {
            self.forced[i] += 1;
        }
        row.accept(token, rules.options, rules.eos, rules.tokenizer, delta)?;
        if row.finish.is_none() && c.consume(token)? {
            row.end(FinishReason::Stop, rules.tokenizer, delta)?;
        }
        if row.finish.is_some() {
            return Ok(vec![]);
        }
        if self.runs_ahead() {
            return self.run_ahead(i, row, rules, delta);
        }
        self.plan_forced(i)?;
        Ok(vec![])
    }

    /// A single row takes its grammar's forced tokens one at a time, as its
    /// masks would force them, until a choice, the end or its limits.
    fn run_ahead(
        &mut self,
        i: usize,
        row: &mut Row,
        rules: &Rules,
        delta: &mut RowDelta,
    ) -> Result<Vec<u32>> {
        let started = Instant::now();
        let mut taken = vec![];
        if let Some(c) = self.rows[i].as_mut() {
            while row.finish.is_none() {
                let Some(&token) = c.forced_tokens()?.first() else {
                    break;
                };
                row.accept(token, rules.options, rules.eos, rules.tokenizer, delta)?;
                taken.push(token);
                if row.finish.is_none() && c.consume(token)? {
                    row.end(FinishReason::Stop, rules.tokenizer, delta)?;
                }
            }
        }
        self.forced[i] += taken.len();
        self.ms += started.elapsed().as_secs_f64() * 1e3;
        Ok(taken)
    }

    /// A batch row's forced token for the coming step, if any.
    fn plan_forced(&mut self, i: usize) -> Result<()> {
        if !self.fast_forward {
            return Ok(());
        }
        if let Some(c) = self.rows[i].as_mut() {
            let started = Instant::now();
            self.next_forced[i] = c.forced_tokens()?.first().copied();
            self.ms += started.elapsed().as_secs_f64() * 1e3;
        }
        Ok(())
    }

    /// Computes every row's mask for the coming step: a constrained row's
    /// grammar mask, or its forced token alone (no mask to compute: the
    /// samplers can take nothing else, and a one-token row is what they
    /// handle fastest); every token for the other rows, and for a row whose
    /// grammar allows nothing (it ends before taking this step's token).
    /// Read them with [`mask`](Self::mask) or [`bias`](Self::bias).
    pub fn prepare(
        &mut self,
        rows: &[Row],
        eos: &[u32],
        ignore_eos: bool,
        vocab: usize,
    ) -> Result<()> {
        let started = Instant::now();
        let words = vocab.div_ceil(32);
        self.masks.clear();
        self.masks.resize(rows.len() * words, u32::MAX);
        let mut grammar_rows = vec![];
        for (((out, c), row), forced) in self
            .masks
            .chunks_mut(words.max(1))
            .zip(&mut self.rows)
            .zip(rows)
            .zip(&self.next_forced)
        {
            let (Some(c), None) = (c, row.finish) else {
                continue;
            };
            match *forced {
                Some(token) if (token as usize) < vocab => {
                    out.fill(0);
                    out[token as usize / 32] = 1 << (token % 32);
                }
                Some(_) => {}
                None => grammar_rows.push((out, c)),
            }
        }
        // Rows' grammars are independent: several are computed at once.
        crate::runtime::each_on_threads(&mut grammar_rows, |(out, c)| {
            crate::exec::write_row_mask(c, eos, ignore_eos, vocab, out)
        })?;
        // Bits past the vocabulary stay set: the kernels read none of them.
        self.ms += started.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// The prepared masks, `[B, ceil(vocab / 32)]` uint32.
    pub fn mask(&self) -> Array {
        crate::exec::mask_array(&self.masks, self.rows.len())
    }

    /// The prepared masks' words, a row after another.
    pub fn mask_words(&self) -> &[u32] {
        &self.masks
    }

    /// The prepared masks as a `[B, vocab]` float32 additive bias: 0 where a
    /// token is allowed, -inf elsewhere.
    pub fn bias(&mut self, vocab: usize) -> Result<Array> {
        let started = Instant::now();
        let bias =
            crate::exec::mask_bias(&self.masks, self.rows.len(), vocab, mlx_rs::Dtype::Float32)?;
        self.ms += started.elapsed().as_secs_f64() * 1e3;
        Ok(bias)
    }

    /// The step's tokens `[B]` (uint32) with each forced row's token in
    /// place of its sample.
    pub fn force(&self, sampled: Array) -> Result<Array> {
        if self.next_forced.iter().all(Option::is_none) {
            return Ok(sampled);
        }
        let forced: Vec<bool> = self.next_forced.iter().map(Option::is_some).collect();
        let ids: Vec<u32> = self.next_forced.iter().map(|f| f.unwrap_or(0)).collect();
        let n = ids.len() as i32;
        Ok(mlx_rs::ops::select(
            Array::from_slice(&forced, &[n]),
            Array::from_slice(&ids, &[n]),
            &sampled,
        )?)
    }
}
