//! Constrained decoding: a row's output is kept inside a JSON Schema, a
//! regular expression or a Lark grammar by masking, every step, the tokens
//! that cannot continue it. The grammar engine is llguidance; this module
//! builds its token trie from our tokenizer, compiles a row's constraint
//! and writes its allowed-token set as a bitmask. One row's mask is a walk
//! of the whole 150k-token trie where the grammar allows free text, longer
//! than a GPU decode step; it is computed over disjoint parts of the
//! vocabulary on several threads, each part by its own copy of the parser.

use std::sync::{mpsc, Arc, Mutex};

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::earley::{BiasComputer, SlicedBiasComputer};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory, TokenParser};
use serde_json::Value;

use crate::error::{Error, Result};

/// What a row's output must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConstraintSpec {
    /// A JSON Schema, as JSON text.
    JsonSchema(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

impl ConstraintSpec {
    fn name(&self) -> &'static str {
        match self {
            ConstraintSpec::JsonSchema(_) => "json_schema",
            ConstraintSpec::Regex(_) => "regex",
            ConstraintSpec::Lark(_) => "grammar",
        }
    }

    fn grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            ConstraintSpec::JsonSchema(text) => {
                let schema: Value = serde_json::from_str(text).map_err(|e| {
                    Error::InvalidConstraint(format!("json_schema is not valid JSON: {e}"))
                })?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(Error::InvalidConstraint(format!(
                        "json_schema must be a JSON object (or a boolean), got: {schema}"
                    )));
                }
                TopLevelGrammar::from_json_schema(compact_layout(schema))
            }
            ConstraintSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            ConstraintSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// Without a layout of its own (llguidance's `x-guidance` key), a schema's
/// JSON is written as Python's `json.dumps` writes it: `", "` and `": "`
/// and no other whitespace. Flexible whitespace would let a model pad the
/// output with blank space for as long as its token budget lasts.
fn compact_layout(mut schema: Value) -> Value {
    if schema.is_object() && schema.get("x-guidance").is_none() {
        JsonCompileOptions {
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        }
        .apply_to(&mut schema);
    }
    schema
}

/// The tokenizer as llguidance sees it: every token's bytes in a trie.
/// Special tokens carry llguidance's marker byte, so grammar text can never
/// produce them by accident.
struct TrieEnv {
    trie: TokTrie,
    /// Shared by the parts' environments (a 150k-token tokenizer is tens
    /// of megabytes).
    tokenizer: Arc<tokenizers::Tokenizer>,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's own tokens for `s`, so text the grammar forces is
    /// spelled as the model would see it in a prompt. Bytes that are not
    /// UTF-8, or text the tokenizer would rewrite (its normalizer, or a
    /// special token's name), are spelled byte for byte from the trie.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let ids = self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        });
        if self.trie.decode_raw(&ids) == s {
            ids
        } else {
            self.trie.greedy_tokenize(s)
        }
    }

    // With the tokenizer's own tokenization, llguidance may force tokens:
    // where the grammar allows one spelling only, the mask holds one token
    // and `RowConstraint::forced_tokens` names it.
    fn tokenize_is_canonical(&self) -> bool {
        true
    }
}

/// A tokenizer's compiled grammar machinery, built once per tokenizer
/// (the token trie and the bias slices take a fraction of a second for a
/// 150k vocabulary, per part).
pub struct ConstraintFactory {
    factory: ParserFactory,
    /// One bias computer per part of the vocabulary (the trie's tokens in
    /// byte order, cut into runs of equal count, so a part's walk shares
    /// few prefixes with another's); empty where masks take one thread.
    parts: Vec<Arc<dyn BiasComputer>>,
    /// Threads that compute every part but a row's first (which its caller
    /// computes), kept for the factory's life: starting threads every step
    /// would cost a good share of a mask.
    workers: Option<Arc<PartWorkers>>,
    /// The tokenizer's end-of-sequence ids, as the trie knows them.
    trie_eos: Vec<u32>,
}

/// One part's share of a mask to compute: the part, the tokens it has yet
/// to take, and where to send it back with its share.
struct PartJob {
    part: TokenParser,
    pending: Arc<Vec<u32>>,
    reply: mpsc::Sender<(TokenParser, PartMask)>,
}

/// Threads taking [`PartJob`]s from one queue; they end when the factory
/// (the queue's sender) goes.
struct PartWorkers {
    jobs: mpsc::Sender<PartJob>,
}

impl PartWorkers {
    fn start(threads: usize) -> Result<Self> {
        let (jobs, queue) = mpsc::channel::<PartJob>();
        let queue = Arc::new(Mutex::new(queue));
        for _ in 0..threads {
            let queue = queue.clone();
            std::thread::Builder::new()
                .name("emlx-mask".into())
                .spawn(move || loop {
                    let job = match queue.lock() {
                        Ok(queue) => queue.recv(),
                        Err(_) => return,
                    };
                    let Ok(mut job) = job else { return };
                    let mask = part_mask(&mut job.part, &job.pending[..]);
                    // A row that stopped waiting drops its receiver.
                    let _ = job.reply.send((job.part, mask));
                })
                .map_err(|e| Error::Unsupported(format!("starting mask threads: {e}")))?;
        }
        Ok(PartWorkers { jobs })
    }

    /// Queues `job`; false if the threads are gone.
    fn send(&self, job: PartJob) -> bool {
        self.jobs.send(job).is_ok()
    }
}

// The factory is never changed after it is built (parsers are created from
// it by shared reference), so a panic cannot leave it half-updated for the
// NIF's panic guard to expose.
impl std::panic::RefUnwindSafe for ConstraintFactory {}
impl std::panic::UnwindSafe for ConstraintFactory {}

/// Parts a row's mask is computed in: `EMLX_AXON_MASK_THREADS`, else half
/// the cores (the others run the step the mask overlaps), at most eight
/// (past that, the parts' repeated walks near the trie's root cost more
/// than the threads win).
pub fn default_mask_parts() -> usize {
    crate::switches::mask_threads().unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, 8))
    })
}

impl ConstraintFactory {
    pub fn new(tokenizer: &tokenizers::Tokenizer, eos: &[u32]) -> Result<Self> {
        Self::with_parts(tokenizer, eos, default_mask_parts())
    }

    /// As [`new`](Self::new), with masks computed in `parts` parts (1: by
    /// one parser on the calling thread).
    pub fn with_parts(
        tokenizer: &tokenizers::Tokenizer,
        eos: &[u32],
        parts: usize,
    ) -> Result<Self> {
        let json = tokenizer
            .to_string(false)
            .map_err(|e| Error::Tokenizer(format!("serializing the tokenizer: {e}")))?;
        let json: Value = serde_json::from_str(&json)
            .map_err(|e| Error::Tokenizer(format!("serializing the tokenizer: {e}")))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| {
            Error::Unsupported(format!("constrained decoding with this tokenizer: {e}"))
        })?;
        let vocab = words.len().max(tokenizer.get_vocab_size(true));
        words.resize(vocab, vec![]);
        let trie_eos: Vec<u32> = eos
            .iter()
            .copied()
            .filter(|&e| (e as usize) < vocab)
            .collect();
        let info = TokRxInfo::new(vocab as u32, trie_eos.first().copied().unwrap_or(0));
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&trie_eos);
        let tokenizer = Arc::new(tokenizer.clone());
        let env: TokEnv = Arc::new(TrieEnv {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(unsupported)?;
        factory.quiet();
        let (parts, workers) = if parts > 1 {
            (
                part_computers(&env, &tokenizer, parts)?,
                Some(Arc::new(PartWorkers::start(parts - 1)?)),
            )
        } else {
            (vec![], None)
        };
        Ok(ConstraintFactory {
            factory,
            parts,
            workers,
            trie_eos,
        })
    }
}

fn unsupported(e: impl std::fmt::Display) -> Error {
    Error::Unsupported(format!("constrained decoding: {e}"))
}

/// Bias computers over `parts` disjoint runs of the trie's tokens in byte
/// order, built on several threads.
fn part_computers(
    env: &TokEnv,
    tokenizer: &Arc<tokenizers::Tokenizer>,
    parts: usize,
) -> Result<Vec<Arc<dyn BiasComputer>>> {
    let trie = env.tok_trie();
    let mut ids: Vec<u32> = (0..trie.vocab_size() as u32)
        .filter(|&i| !trie.token(i).is_empty())
        .collect();
    ids.sort_unstable_by(|&a, &b| trie.token(a).cmp(trie.token(b)));
    let slices = SlicedBiasComputer::general_slices();
    let mut jobs: Vec<_> = ids
        .chunks(ids.len().div_ceil(parts).max(1))
        .map(|run| (run, None::<Arc<dyn BiasComputer>>))
        .collect();
    crate::runtime::each_on_threads(&mut jobs, |(run, computer)| {
        let mut set = trie.alloc_token_set();
        for &id in run.iter() {
            set.allow_token(id);
        }
        let part: TokEnv = Arc::new(TrieEnv {
            trie: trie.filter(&set),
            tokenizer: tokenizer.clone(),
        });
        *computer = Some(Arc::new(
            SlicedBiasComputer::new(&part, &slices).map_err(unsupported)?,
        ));
        Ok(())
    })?;
    Ok(jobs
        .into_iter()
        .filter_map(|(_, computer)| computer)
        .collect())
}

/// One row's constraint: the parser state after the tokens it has taken.
pub struct RowConstraint {
    /// Takes the tokens and names the forced ones; computes the mask where
    /// the row has no parts.
    matcher: Matcher,
    /// Copies of the parser, one per part of the vocabulary, each
    /// computing the mask over its part; they take the row's tokens when
    /// the next mask is asked for.
    parts: Vec<TokenParser>,
    workers: Option<Arc<PartWorkers>>,
    /// Tokens taken since the parts last computed a mask.
    pending: Vec<u32>,
    trie_eos: Vec<u32>,
    /// Nothing but the end of the output can follow.
    complete: bool,
}

/// One part's share of a mask.
enum PartMask {
    Tokens(SimpleVob),
    /// The grammar allows none of this part's tokens.
    Empty,
    /// The part failed where the whole parser may not: the mask is left to
    /// the whole parser.
    Failed,
}

impl RowConstraint {
    /// Compiles `spec`; a bad schema, regex or grammar is an
    /// `InvalidArgument` naming what llguidance rejected.
    pub fn new(factory: &ConstraintFactory, spec: &ConstraintSpec) -> Result<Self> {
        let mut parser = factory
            .factory
            .create_parser(spec.grammar()?)
            .map_err(|e| Error::InvalidConstraint(format!("invalid {}: {e}", spec.name())))?;
        parser.start_without_prompt();
        let parts = factory
            .parts
            .iter()
            .map(|computer| {
                let mut part = parser.deep_clone();
                part.bias_computer = computer.clone();
                part
            })
            .collect();
        let mut matcher = Matcher::new(Ok(parser));
        // Some errors surface only when the grammar first runs.
        let first = matcher.compute_mask();
        if let Some(e) = matcher.get_error().or(first.err().map(|e| e.to_string())) {
            return Err(Error::InvalidConstraint(format!(
                "invalid {}: {e}",
                spec.name()
            )));
        }
        Ok(RowConstraint {
            matcher,
            parts,
            workers: factory.workers.clone(),
            pending: vec![],
            trie_eos: factory.trie_eos.clone(),
            complete: false,
        })
    }

    /// The parts the row's masks are computed in (0: by the whole parser).
    pub fn mask_parts(&self) -> usize {
        self.parts.len()
    }

    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// Takes the row's sampled `token`; true when the output is complete.
    pub fn consume(&mut self, token: u32) -> Result<bool> {
        self.matcher
            .consume_token(token)
            .map_err(|e| Error::Constraint(e.to_string()))?;
        if !self.parts.is_empty() {
            self.pending.push(token);
        }
        if self.matcher.is_stopped() {
            self.complete = true;
        }
        Ok(self.complete)
    }

    /// The tokens the grammar forces next, in order: where only one text
    /// can follow, its tokenization (without a last token that a longer
    /// token could replace once more text is known). Empty when the next
    /// token is a choice or the output is complete. Stops before an
    /// end-of-sequence token: ending is left to the mask and the sampler.
    /// A row that takes these tokens one at a time, each through
    /// [`consume`](Self::consume), follows exactly the path its masks would
    /// force, since a forced step's mask is the first of them alone.
    pub fn forced_tokens(&mut self) -> Result<Vec<u32>> {
        if self.complete || self.matcher.is_stopped() {
            return Ok(vec![]);
        }
        let mut tokens = self.matcher.compute_ff_tokens();
        if let Some(e) = self.matcher.get_error() {
            return Err(Error::Constraint(e));
        }
        if let Some(end) = tokens.iter().position(|t| self.trie_eos.contains(t)) {
            tokens.truncate(end);
        }
        Ok(tokens)
    }

    /// Writes the tokens the row may take next into `out`, a bitmask over
    /// the model's `vocab` tokens (bit `i % 32` of word `i / 32`, at least
    /// `ceil(vocab / 32)` words). The end-of-sequence tokens allowed are the
    /// generation's `eos` (none with `ignore_eos`) whenever the grammar could
    /// end here. Returns false, and marks the row complete, when no token
    /// may follow.
    pub fn write_mask(
        &mut self,
        eos: &[u32],
        ignore_eos: bool,
        vocab: usize,
        out: &mut [u32],
    ) -> Result<bool> {
        let mask = match self.parts_mask() {
            Some(mask) => mask,
            None => self
                .matcher
                .compute_mask()
                .map_err(|e| Error::Constraint(e.to_string()))?,
        };
        let words = vocab.div_ceil(32).min(out.len());
        out.fill(0);
        let grammar = mask.as_slice();
        let n = grammar.len().min(words);
        out[..n].copy_from_slice(&grammar[..n]);
        let set = |out: &mut [u32], token: u32, on: bool| {
            if (token as usize) < vocab {
                let (w, b) = (token as usize / 32, token % 32);
                if let Some(word) = out.get_mut(w) {
                    *word = if on {
                        *word | 1 << b
                    } else {
                        *word & !(1 << b)
                    };
                }
            }
        };
        let can_end = self.trie_eos.iter().any(|&e| mask.is_allowed(e));
        for &e in &self.trie_eos {
            set(out, e, false);
        }
        if can_end && !ignore_eos {
            for &e in eos {
                set(out, e, true);
            }
        }
        // Nothing past the model's vocabulary.
        if !vocab.is_multiple_of(32) && words > 0 && words == vocab.div_ceil(32) {
            out[words - 1] &= (1u32 << (vocab % 32)) - 1;
        }
        let allowed = out[..words].iter().any(|&w| w != 0);
        if !allowed {
            self.complete = true;
        }
        Ok(allowed)
    }

    /// The mask as the union of the parts' masks, the first part computed
    /// here and the others on the factory's threads at the same time;
    /// `None` where the whole parser must compute it: the row has no parts,
    /// no part allows a token (the whole parser then says why), or a part
    /// failed (the row then goes on without parts).
    fn parts_mask(&mut self) -> Option<SimpleVob> {
        let workers = self.workers.clone()?;
        if self.parts.is_empty() {
            return None;
        }
        let pending = Arc::new(std::mem::take(&mut self.pending));
        let mut parts = std::mem::take(&mut self.parts);
        // Each part carries its own bias computer: their order is free.
        let others = parts.split_off(1);
        let sent = others.len();
        let (reply, replies) = mpsc::channel();
        for part in others {
            let job = PartJob {
                part,
                pending: pending.clone(),
                reply: reply.clone(),
            };
            if !workers.send(job) {
                return None;
            }
        }
        drop(reply);
        let mut masks = vec![part_mask(&mut parts[0], &pending)];
        for _ in 0..sent {
            // A thread that panicked outside the part's own guard drops its
            // job's sender: its part is lost, and the row goes on without.
            let Ok((part, mask)) = replies.recv() else {
                return None;
            };
            parts.push(part);
            masks.push(mask);
        }
        let mut union: Option<SimpleVob> = None;
        for mask in masks {
            match mask {
                PartMask::Tokens(part) => match union.as_mut() {
                    Some(union) => union.or(&part),
                    None => union = Some(part),
                },
                PartMask::Empty => {}
                // The parts stay taken: the row goes on without them.
                PartMask::Failed => return None,
            }
        }
        self.parts = parts;
        union
    }
}

/// `part` takes `pending` and computes its share of the mask. A part whose
/// tokens are all disallowed is restored to its state before the
/// computation: the parser stops itself on an empty mask, but the grammar
/// goes on in the other parts.
fn part_mask(part: &mut TokenParser, pending: &[u32]) -> PartMask {
    let run = std::panic::AssertUnwindSafe(|| {
        for &token in pending {
            match part.consume_token(token) {
                Ok(0) => {}
                _ => return PartMask::Failed,
            }
        }
        if part.check_stop().is_err() {
            return PartMask::Failed;
        }
        let before = part.clone();
        match part.compute_mask() {
            Ok(mask) => PartMask::Tokens(mask),
            Err(_) if part.stop_reason() == StopReason::NoExtensionBias => {
                *part = before;
                PartMask::Empty
            }
            Err(_) => PartMask::Failed,
        }
    });
    std::panic::catch_unwind(run).unwrap_or(PartMask::Failed)
}

/// `out[i]` 0 where bit `i % 32` of `bits[i / 32]` is set, -inf elsewhere.
pub fn bias_of_mask(bits: &[u32], out: &mut [f32]) {
    for (chunk, &word) in out.chunks_mut(32).zip(bits) {
        for (b, x) in chunk.iter_mut().enumerate() {
            *x = if word >> b & 1 == 1 {
                0.0
            } else {
                f32::NEG_INFINITY
            };
        }
    }
}
