//! Continuous batching: rows joining and leaving a running batch, per-row
//! options and seeds, cancellation, the prefix cache and memory release.

mod common;

use std::sync::{Arc, Mutex, MutexGuard};

use common::*;
use emlx_axon_engine::exec::scheduler::{Driver, Occupancy, Output, Pacing};
use emlx_axon_engine::{
    generate, FinishReason, GenerateOptions, Model, RequestId, SamplerConfig, SamplerKind,
    Scheduler, SchedulerConfig,
};

const FIXTURE: &str = "qwen3-4bit-g64";

/// MLX's memory counters are process-wide: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn model() -> Arc<Model> {
    load_f32(FIXTURE)
}

fn greedy(max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        ignore_eos: true,
        sampler: SamplerConfig::default(),
        ..GenerateOptions::default()
    }
}

fn config(slots: usize, prefill_chunk: usize, prefix_cache_bytes: usize) -> SchedulerConfig {
    SchedulerConfig {
        slots,
        capacity: 256,
        prefill_chunk,
        prefix_cache_bytes,
        prefix_min_tokens: 4,
        ..SchedulerConfig::default()
    }
}

fn solo(model: &Arc<Model>, prompt: &[u32], options: GenerateOptions) -> Vec<u32> {
    generate(model.clone(), None, prompt, options).unwrap().ids
}

/// Collected tokens and finish reasons of every request.
#[derive(Default)]
struct Collected {
    ids: std::collections::HashMap<RequestId, Vec<u32>>,
    finish: std::collections::HashMap<RequestId, FinishReason>,
    cached: std::collections::HashMap<RequestId, usize>,
}

impl Collected {
    fn step(&mut self, s: &mut Scheduler, steps: usize) {
        self.take(s.step(steps).unwrap());
    }

    fn take(&mut self, events: Vec<emlx_axon_engine::Event>) {
        for e in events {
            self.ids.entry(e.id).or_default().extend(&e.delta.ids);
            if let Some(f) = e.delta.finish {
                assert!(
                    self.finish.insert(e.id, f).is_none(),
                    "request {} finished twice",
                    e.id
                );
                let stats = e.stats.expect("the last event carries stats");
                assert_eq!(stats.generated_tokens, self.ids[&e.id].len());
                self.cached.insert(e.id, stats.cached_tokens);
            }
        }
    }

    fn drain(&mut self, s: &mut Scheduler) {
        for _ in 0..10_000 {
            if s.is_idle() {
                return;
            }
            self.step(s, 3);
        }
        panic!("the scheduler did not finish");
    }
}

fn prompts() -> Vec<Vec<u32>> {
    let refs = reference(FIXTURE, "");
    let mut p: Vec<Vec<u32>> = refs.iter().map(|r| r.1.clone()).collect();
    p.push(p[0][..3].to_vec());
    p.push([p[1].clone(), p[0].clone()].concat());
    p
}

#[test]
fn rows_joining_at_different_times_equal_their_solo_runs() {
    let _g = serial();
    let model = model();
    let refs = reference(FIXTURE, "");
    let p = prompts();
    let lens = [16, 10, 12, 9];
    let mut s = Scheduler::new(model.clone(), None, config(3, 4, 0)).unwrap();
    let mut c = Collected::default();
    let a = s.admit(p[0].clone(), greedy(lens[0])).unwrap();
    while !c.ids.contains_key(&a) {
        c.step(&mut s, 1);
    }
    c.step(&mut s, 1);
    assert!(c.ids[&a].len() >= 2, "the first row is decoding");
    let b = s.admit(p[1].clone(), greedy(lens[1])).unwrap();
    c.step(&mut s, 2);
    let cc = s.admit(p[2].clone(), greedy(lens[2])).unwrap();
    // A fourth request waits for a slot: it joins when the first row leaves
    // and reuses that row's slot.
    let d = s.admit(p[3].clone(), greedy(lens[3])).unwrap();
    assert_eq!(s.occupancy().slots, 3);
    c.drain(&mut s);
    for (i, id) in [a, b, cc, d].into_iter().enumerate() {
        assert_eq!(
            c.ids[&id],
            solo(&model, &p[i], greedy(lens[i])),
            "request {i} differs from its solo run"
        );
        assert_eq!(c.finish[&id], FinishReason::Length);
    }
    assert_eq!(c.ids[&a], refs[0].2, "the mlx-lm reference");
    assert_eq!(c.ids[&b], refs[1].2[..lens[1]]);
    assert_eq!(
        s.occupancy(),
        Occupancy {
            running: 0,
            slots: 3,
            waiting: 0,
            prefix_entries: 0,
            prefix_bytes: 0
        }
    );
}

#[test]
fn each_row_keeps_its_own_sampler_seed_and_stop_conditions() {
    let _g = serial();
    let model = model();
    let p = prompts();
    let sampled = |kind, seed| GenerateOptions {
        max_new_tokens: 12,
        ignore_eos: true,
        sampler: SamplerConfig {
            kind,
            temperature: 0.8,
            top_p: 0.9,
            top_k: 20,
            min_p: 0.02,
            seed: Some(seed),
            ..SamplerConfig::default()
        },
        ..GenerateOptions::default()
    };
    let plain = solo(&model, &p[1], greedy(12));
    // Stops at the first occurrence of the token it names as EOS.
    let eos_row = GenerateOptions {
        max_new_tokens: 12,
        eos_token_ids: Some(vec![plain[4]]),
        ..GenerateOptions::default()
    };
    let options = [
        sampled(SamplerKind::TopPGpu, 7),
        sampled(SamplerKind::TopPCpu, 11),
        eos_row.clone(),
        sampled(SamplerKind::TopPGpu, 99),
    ];
    let inputs = [&p[0], &p[0], &p[1], &p[2]];
    let mut s = Scheduler::new(model.clone(), None, config(4, 8, 0)).unwrap();
    let mut c = Collected::default();
    let mut ids = vec![];
    for (prompt, o) in inputs.iter().zip(&options) {
        ids.push(s.admit((*prompt).clone(), o.clone()).unwrap());
        c.step(&mut s, 1);
    }
    c.drain(&mut s);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            c.ids[id],
            solo(&model, inputs[i], options[i].clone()),
            "request {i} differs from its solo run"
        );
    }
    let stop_at = plain.iter().position(|&t| t == plain[4]).unwrap();
    assert_eq!(c.ids[&ids[2]], plain[..=stop_at]);
    assert_eq!(c.finish[&ids[2]], FinishReason::Eos);
    // Same seed and prompt, different sampler paths: independent streams.
    assert_ne!(c.ids[&ids[0]], c.ids[&ids[3]]);
}

#[test]
fn stop_strings_end_a_row_and_hold_back_their_text() {
    let _g = serial();
    let model = model();
    let tokenizer = tokenizer(FIXTURE);
    let p = prompts();
    let full = generate(model.clone(), Some(tokenizer.clone()), &p[0], greedy(16)).unwrap();
    let words: Vec<&str> = full.text.split_whitespace().collect();
    let stop = words
        .get(2)
        .copied()
        .filter(|w| !w.is_empty())
        .unwrap_or("the")
        .to_string();
    let o = GenerateOptions {
        stop: vec![stop.clone()],
        ..greedy(16)
    };
    let expected = generate(model.clone(), Some(tokenizer.clone()), &p[0], o.clone()).unwrap();
    let mut s = Scheduler::new(model.clone(), Some(tokenizer), config(2, 8, 0)).unwrap();
    let other = s.admit(p[1].clone(), greedy(16)).unwrap();
    let id = s.admit(p[0].clone(), o).unwrap();
    let mut text = String::new();
    let mut finish = None;
    let mut other_ids = vec![];
    while !s.is_idle() {
        for e in s.step(2).unwrap() {
            if e.id == id {
                text.push_str(&e.delta.text);
                finish = e.delta.finish.or(finish);
            } else {
                assert_eq!(e.id, other);
                other_ids.extend(e.delta.ids);
            }
        }
    }
    assert_eq!(text, expected.text);
    assert_eq!(finish, Some(expected.finish));
    assert!(!text.contains(&stop));
    assert_eq!(other_ids, solo(&model, &p[1], greedy(16)));
}

#[test]
fn cancelling_mid_prefill_and_mid_decode_frees_the_slot_and_memory() {
    let _g = serial();
    let model = model();
    let p = prompts();
    let mut s = Scheduler::new(model.clone(), None, config(2, 2, 0)).unwrap();
    // Warm up the kernels and allocator with a step of each shape this
    // test runs (one row, two rows): a compiled step keeps a trace of each.
    let mut c = Collected::default();
    s.admit(p[0].clone(), greedy(4)).unwrap();
    s.admit(p[1].clone(), greedy(8)).unwrap();
    c.drain(&mut s);
    let baseline = settled_active_memory();

    // Mid-prefill: a 2-token chunk of a longer prompt has run.
    let long = s.admit(p[3].clone(), greedy(8)).unwrap();
    c.step(&mut s, 1);
    assert_eq!(s.occupancy().waiting, 1);
    assert!(!c.ids.contains_key(&long));
    assert!(s.cancel(long));
    assert!(s.is_idle());
    assert!(!s.cancel(long), "a request is cancelled once");

    // Mid-decode, while another row keeps going (the shorter prompt, a's,
    // is prefilled first).
    let a = s.admit(p[1].clone(), greedy(40)).unwrap();
    let b = s.admit(p[0].clone(), greedy(12)).unwrap();
    while !c.ids.contains_key(&b) {
        c.step(&mut s, 1);
    }
    assert_eq!(s.occupancy().running, 2);
    assert!(s.cancel(a));
    assert_eq!(s.occupancy().running, 1);
    // The freed slot takes a new request, whose tokens equal its solo run.
    let d = s.admit(p[2].clone(), greedy(10)).unwrap();
    c.drain(&mut s);
    assert!(!c.finish.contains_key(&a));
    assert_eq!(c.ids[&b], solo(&model, &p[0], greedy(12)));
    assert_eq!(c.ids[&d], solo(&model, &p[2], greedy(10)));

    // A leaked cache holds at least one token's keys of one layer, so the
    // check is for growth of that size. MLX's stream thread releases a
    // step's temporaries after its results have been read (on the CPU as on
    // a GPU), so either reading may still include a few of them: the
    // baseline can read higher, and the end a few scalars higher.
    let after = settled_active_memory();
    let c = &model.config;
    let key_row = (c.num_kv_heads * c.head_dim) as usize * std::mem::size_of::<f32>();
    assert!(
        after < baseline + key_row,
        "MLX active memory grew from {baseline} to {after} bytes"
    );
    drop(s);
}

/// MLX's active memory once nothing is being freed any more, as far as
/// polling can tell: the reuse cache cleared and two readings a few
/// milliseconds apart equal.
fn settled_active_memory() -> usize {
    let read = || {
        emlx_axon_engine::runtime::memory::clear_cache().unwrap();
        emlx_axon_engine::runtime::memory::info().unwrap().active
    };
    let mut last = read();
    for _ in 0..100 {
        std::thread::sleep(std::time::Duration::from_millis(10));
        let now = read();
        if now == last {
            break;
        }
        last = now;
    }
    last
}

#[test]
fn prefix_cache_hits_give_the_cold_run_tokens() {
    let _g = serial();
    let model = model();
    let p = prompts();
    // Two prompts sharing a system-prompt-like prefix.
    let shared = p[3].clone();
    let first = [shared.clone(), p[2].clone()].concat();
    let second = [shared.clone(), p[0][..5].to_vec()].concat();
    let mut s = Scheduler::new(model.clone(), None, config(2, 8, 64 << 20)).unwrap();
    let mut c = Collected::default();
    let a = s.admit(first.clone(), greedy(8)).unwrap();
    c.drain(&mut s);
    assert_eq!(c.cached[&a], 0);
    assert_eq!(s.occupancy().prefix_entries, 1);
    let b = s.admit(second.clone(), greedy(8)).unwrap();
    // The same prompt again reuses all but its last token.
    let again = s.admit(first.clone(), greedy(8)).unwrap();
    c.drain(&mut s);
    // The longest common prefix: the shared part and `second`'s first
    // three tokens, which `first` also has.
    assert_eq!(c.cached[&b], shared.len() + 3);
    assert_eq!(c.cached[&again], first.len() - 1);
    assert_eq!(c.ids[&b], solo(&model, &second, greedy(8)));
    assert_eq!(c.ids[&again], c.ids[&a]);

    // Budget: room for one prompt evicts the least recently used.
    let one = s.occupancy().prefix_bytes / 2 + 1;
    let mut small = Scheduler::new(model.clone(), None, config(1, 64, one * 2)).unwrap();
    let mut c = Collected::default();
    small.admit(first.clone(), greedy(1)).unwrap();
    c.drain(&mut small);
    small.admit(p[1].clone(), greedy(1)).unwrap();
    c.drain(&mut small);
    assert!(small.occupancy().prefix_bytes <= one * 2);
    assert!(small.occupancy().prefix_entries >= 1);
}

#[test]
fn bad_requests_are_refused() {
    let _g = serial();
    let model = model();
    let mut s = Scheduler::new(model.clone(), None, config(1, 8, 0)).unwrap();
    assert!(s.admit(vec![], greedy(4)).is_err());
    assert!(s.admit(vec![u32::MAX], greedy(4)).is_err());
    assert!(s.admit(vec![1], greedy(0)).is_err());
    assert!(
        s.admit(vec![1; 300], greedy(4)).is_err(),
        "longer than a slot"
    );
    let stop = GenerateOptions {
        stop: vec!["x".into()],
        ..greedy(4)
    };
    assert!(
        s.admit(vec![1], stop).is_err(),
        "stop strings need a tokenizer"
    );
    assert!(Scheduler::new(model.clone(), None, config(0, 8, 0)).is_err());
    assert!(s.is_idle());
}

#[test]
fn rows_leaving_inside_a_multi_step_call_do_not_disturb_the_others() {
    let _g = serial();
    let model = model();
    let p = prompts();
    let sampled = |seed| GenerateOptions {
        max_new_tokens: 11,
        ignore_eos: true,
        sampler: SamplerConfig {
            kind: SamplerKind::TopPGpu,
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(seed),
            ..SamplerConfig::default()
        },
        ..GenerateOptions::default()
    };
    let plain = solo(&model, &p[2], greedy(12));
    let eos_row = GenerateOptions {
        max_new_tokens: 12,
        eos_token_ids: Some(vec![plain[3]]),
        ..GenerateOptions::default()
    };
    let max_len_row = GenerateOptions {
        max_len: p[1].len() + 5,
        ..greedy(30)
    };
    // Rows end at different steps inside one call, so later steps run
    // fewer slots; the rows queued after them take the freed low slots
    // while a row in a higher slot keeps decoding.
    let requests = [
        (p[0].clone(), greedy(2)),
        (p[1].clone(), greedy(30)),
        (p[2].clone(), sampled(5)),
        (p[2].clone(), eos_row),
        (p[1].clone(), max_len_row),
        (p[3].clone(), greedy(7)),
        (p[0].clone(), sampled(6)),
        (p[2].clone(), greedy(1)),
    ];
    let mut s = Scheduler::new(model.clone(), None, config(5, 64, 0)).unwrap();
    let mut c = Collected::default();
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|(prompt, o)| s.admit(prompt.clone(), o.clone()).unwrap())
        .collect();
    for _ in 0..10_000 {
        if s.is_idle() {
            break;
        }
        c.step(&mut s, 7);
    }
    assert!(s.is_idle());
    for (i, ((prompt, o), id)) in requests.iter().zip(&ids).enumerate() {
        assert_eq!(
            c.ids[id],
            solo(&model, prompt, o.clone()),
            "request {i} differs from its solo run"
        );
    }
    assert_eq!(c.finish[&ids[3]], FinishReason::Eos);
    assert_eq!(c.finish[&ids[4]], FinishReason::MaxLen);
    assert_eq!(c.ids[&ids[4]].len(), 5);
}

/// Requests in the order their first tokens came.
fn first_token_order(s: &mut Scheduler) -> Vec<RequestId> {
    let mut order = vec![];
    while !s.is_idle() {
        for e in s.step(1).unwrap() {
            if !e.delta.ids.is_empty() && !order.contains(&e.id) {
                order.push(e.id);
            }
        }
    }
    order
}

#[test]
fn the_shortest_waiting_prompt_is_prefilled_first_and_long_ones_are_not_starved() {
    let _g = serial();
    let model = model();
    let p = prompts();
    let (short, long) = (&p[2], &p[3]);
    assert!(short.len() < long.len());
    let mut s = Scheduler::new(model.clone(), None, config(1, 64, 0)).unwrap();
    let first_long = s.admit(long.clone(), greedy(2)).unwrap();
    let second_long = s.admit(long.clone(), greedy(2)).unwrap();
    let late_short = s.admit(short.clone(), greedy(2)).unwrap();
    assert_eq!(
        first_token_order(&mut s),
        [late_short, first_long, second_long]
    );

    // A long prompt passed over by 8 shorter ones goes next.
    let waiting = s.admit(long.clone(), greedy(2)).unwrap();
    let shorts: Vec<RequestId> = (0..10)
        .map(|_| s.admit(short.clone(), greedy(2)).unwrap())
        .collect();
    let order = first_token_order(&mut s);
    let mut expected = shorts[..8].to_vec();
    expected.push(waiting);
    expected.extend(&shorts[8..]);
    assert_eq!(order, expected);
}

#[test]
fn short_prompts_waiting_together_are_prefilled_in_one_pass_and_equal_their_solo_runs() {
    let _g = serial();
    let model = model();
    let p = prompts();
    // A chunk of four rows of the longest of these prompts (18 tokens).
    let mut s = Scheduler::new(model.clone(), None, config(4, 4 * 18, 0)).unwrap();
    let seeded = GenerateOptions {
        sampler: SamplerConfig {
            kind: SamplerKind::TopPGpu,
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(5),
            ..SamplerConfig::default()
        },
        ..greedy(7)
    };
    let requests = [
        (p[0].clone(), greedy(9)),
        (p[1].clone(), greedy(6)),
        (p[2].clone(), greedy(8)),
        (p[1].clone(), seeded),
    ];
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|(prompt, o)| s.admit(prompt.clone(), o.clone()).unwrap())
        .collect();
    // One step: every prompt's first token (one after another, a step
    // would give one).
    let mut c = Collected::default();
    c.step(&mut s, 1);
    for id in &ids {
        assert!(
            c.ids.contains_key(id),
            "request {id} has no first token yet"
        );
    }
    c.drain(&mut s);
    for (id, (prompt, o)) in ids.iter().zip(&requests) {
        assert_eq!(c.ids[id], solo(&model, prompt, o.clone()), "request {id}");
    }
}

#[test]
fn a_step_budget_ends_a_call_after_the_step_running_when_it_passes() {
    let _g = serial();
    let model = model();
    let p = prompts();
    let mut s = Scheduler::new(model.clone(), None, config(2, 64, 0)).unwrap();
    let id = s.admit(p[0].clone(), greedy(20)).unwrap();
    let tokens = |events: Vec<emlx_axon_engine::Event>| tokens_of(id, &events);
    let spent = Some(std::time::Duration::from_nanos(1));
    // The prompt's token (a call seating a lone row returns at once).
    assert_eq!(tokens(s.step_within(64, spent).unwrap()), 1);
    // One decode step: the budget is gone.
    assert_eq!(tokens(s.step_within(64, spent).unwrap()), 1);
    assert_eq!(tokens(s.step_within(64, spent).unwrap()), 1);
    // Without a budget, up to the step count: the rest at once.
    assert_eq!(tokens(s.step_within(64, None).unwrap()), 17);
    assert!(s.is_idle());
}

fn tokens_of(id: RequestId, events: &[emlx_axon_engine::Event]) -> usize {
    events
        .iter()
        .filter(|e| e.id == id)
        .map(|e| e.delta.ids.len())
        .sum()
}

#[test]
fn a_call_that_seats_the_only_waiting_request_returns_early() {
    let _g = serial();
    let model = model();
    let p = prompts();
    let mut s = Scheduler::new(model.clone(), None, config(3, 64, 0)).unwrap();
    let first = s.admit(p[0].clone(), greedy(20)).unwrap();
    // Seated alone with nobody else waiting: the prompt's token only, so
    // that a request arriving meanwhile joins at the same step.
    assert_eq!(tokens_of(first, &s.step(64).unwrap()), 1);
    let second = s.admit(p[1].clone(), greedy(20)).unwrap();
    // The first has taken no step yet: the second's token only.
    let events = s.step(64).unwrap();
    assert_eq!(tokens_of(first, &events), 0);
    assert_eq!(tokens_of(second, &events), 1);
    // Nobody seated: a whole call, to the end of both answers.
    let events = s.step(64).unwrap();
    assert_eq!(tokens_of(first, &events), 19);
    assert_eq!(tokens_of(second, &events), 19);
    assert!(s.is_idle());

    // Seated beside a row that has taken steps: the prompt's token and one
    // step, as long as nobody else waits.
    let first = s.admit(p[0].clone(), greedy(20)).unwrap();
    s.step(64).unwrap();
    s.step_within(1, None).unwrap();
    let second = s.admit(p[1].clone(), greedy(20)).unwrap();
    let events = s.step(64).unwrap();
    assert_eq!(tokens_of(first, &events), 1);
    assert_eq!(tokens_of(second, &events), 2);
    s.step(64).unwrap();
    assert!(s.is_idle());

    // Two prompts of one length, the second arriving after the first was
    // seated, run at one position: the same tokens as their solo runs.
    let same = p[0][p[0].len() - 3..].to_vec();
    let other = p[1][p[1].len() - 3..].to_vec();
    let a = s.admit(same.clone(), greedy(6)).unwrap();
    let mut c = Collected::default();
    c.step(&mut s, 64);
    let b = s.admit(other.clone(), greedy(6)).unwrap();
    c.drain(&mut s);
    assert_eq!(c.ids[&a], solo(&model, &same, greedy(6)));
    assert_eq!(c.ids[&b], solo(&model, &other, greedy(6)));

    // More waiting than a prefill pass takes (a chunk of 3 tokens): calls
    // seat them one by one with no step, until every slot is taken.
    let third = p[2][p[2].len() - 3..].to_vec();
    let mut s = Scheduler::new(model.clone(), None, config(3, 3, 0)).unwrap();
    let prompts = [same, other, third];
    let ids: Vec<RequestId> = prompts
        .iter()
        .map(|q| s.admit(q.clone(), greedy(6)).unwrap())
        .collect();
    let mut c = Collected::default();
    for seated in 1..=3 {
        c.step(&mut s, 64);
        let got: usize = c.ids.values().map(Vec::len).sum();
        assert_eq!(got, seated, "call {seated}: one prompt's token, no step");
    }
    c.drain(&mut s);
    for (id, q) in ids.iter().zip(&prompts) {
        assert_eq!(c.ids[id], solo(&model, q, greedy(6)), "request {id}");
    }

    // With a request still waiting (one slot), seating is no reason to stop.
    let mut s = Scheduler::new(model, None, config(1, 64, 0)).unwrap();
    let first = s.admit(p[0].clone(), greedy(20)).unwrap();
    let second = s.admit(p[1].clone(), greedy(20)).unwrap();
    let events = s.step(64).unwrap();
    // (The shorter prompt is seated first, whichever it is.)
    let mut got = [tokens_of(first, &events), tokens_of(second, &events)];
    got.sort();
    assert_eq!(got, [0, 20]);
}

#[test]
fn requests_ending_at_their_first_token_do_not_hold_a_seated_row_back() {
    let _g = serial();
    let model = model();
    let p = prompts();
    // One prompt per prefill pass; one-token requests take no slot, so
    // slots stay free while they wait.
    let mut s = Scheduler::new(model.clone(), None, config(2, 3, 0)).unwrap();
    let cut = |q: &Vec<u32>| q[q.len() - 3..].to_vec();
    let row = s.admit(cut(&p[0]), greedy(8)).unwrap();
    for q in p.iter().cycle().skip(1).take(6) {
        s.admit(cut(q), greedy(1)).unwrap();
    }
    let mut c = Collected::default();
    for _ in 0..3 {
        c.step(&mut s, 64);
    }
    // At most `slots` calls return before a step: the third one decodes.
    assert!(
        c.ids[&row].len() > 1,
        "the seated row waited for the one-token requests"
    );
    c.drain(&mut s);
    assert_eq!(c.ids[&row], solo(&model, &cut(&p[0]), greedy(8)));
}

#[test]
fn equal_length_rows_step_without_a_mask_and_equal_their_solo_runs() {
    let _g = serial();
    let model = model();
    // Three different prompts of one length: the rows keep one position,
    // also after the shortest answer leaves a free slot among them.
    let len = prompts().iter().map(Vec::len).min().unwrap();
    let p: Vec<Vec<u32>> = prompts()
        .iter()
        .filter(|p| p.len() > len)
        .take(3)
        .map(|p| p[p.len() - len..].to_vec())
        .collect();
    assert_eq!(p.len(), 3, "the fixture has three prompts to cut");
    let mut s = Scheduler::new(model.clone(), None, config(4, 4 * 18, 0)).unwrap();
    let requests = [
        (p[0].clone(), greedy(12)),
        (p[1].clone(), greedy(4)),
        (p[2].clone(), greedy(9)),
    ];
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|(prompt, o)| s.admit(prompt.clone(), o.clone()).unwrap())
        .collect();
    let mut c = Collected::default();
    c.drain(&mut s);
    for (id, (prompt, o)) in ids.iter().zip(&requests) {
        assert_eq!(c.ids[id], solo(&model, prompt, o.clone()), "request {id}");
    }
}

/// What a driver's sink received, by request, after what `c` holds.
fn driven_outputs(
    outputs: &std::sync::mpsc::Receiver<Output>,
    ids: &[RequestId],
    mut c: Collected,
) -> (Collected, std::collections::HashMap<RequestId, usize>) {
    let mut deliveries = std::collections::HashMap::new();
    while !ids.iter().all(|id| c.finish.contains_key(id)) {
        let output = outputs
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the driver went silent with requests running");
        let Output::Events { events, .. } = output else {
            panic!("a driven step failed")
        };
        for e in &events {
            *deliveries.entry(e.id).or_insert(0) += 1;
        }
        c.take(events);
    }
    (c, deliveries)
}

/// A driver of 2 slots whose outputs come to the receiver.
fn driver(model: &Arc<Model>) -> (Driver, std::sync::mpsc::Receiver<Output>) {
    let s = Scheduler::new(model.clone(), None, config(2, 4, 0)).unwrap();
    let (tx, outputs) = std::sync::mpsc::channel();
    let pacing = Pacing {
        max_steps: 4,
        budget: Some(std::time::Duration::from_millis(20)),
    };
    let driver = Driver::spawn(s, pacing, move |o| tx.send(o).is_ok()).unwrap();
    (driver, outputs)
}

/// One short request through a driver started and stopped for it.
fn drive_once(model: &Arc<Model>, prompt: &[u32]) {
    let (driver, outputs) = driver(model);
    let id = driver
        .intake()
        .admit(prompt.to_vec(), greedy(3), None)
        .unwrap();
    driven_outputs(&outputs, &[id], Collected::default());
    driver.stop();
}

#[test]
fn a_driven_scheduler_streams_every_step_and_equals_solo_runs() {
    let _g = serial();
    let model = model();
    let p = prompts();
    let (driver, outputs) = driver(&model);
    let seeded = GenerateOptions {
        sampler: SamplerConfig {
            kind: SamplerKind::TopPGpu,
            temperature: 0.8,
            top_p: 0.9,
            top_k: 20,
            seed: Some(5),
            ..SamplerConfig::default()
        },
        ..greedy(12)
    };
    let a = driver
        .intake()
        .admit(p[0].clone(), greedy(20), None)
        .unwrap();
    // Wait until the first row decodes, then add two more: one waits for
    // a slot and takes the first one freed.
    let Output::Events { events, .. } = outputs.recv().unwrap() else {
        panic!("a driven step failed")
    };
    assert_eq!(events[0].id, a);
    let b = driver
        .intake()
        .admit(p[1].clone(), seeded.clone(), None)
        .unwrap();
    let cc = driver
        .intake()
        .admit(p[2].clone(), greedy(9), None)
        .unwrap();
    let mut first = Collected::default();
    first.ids.insert(a, events[0].delta.ids.clone());
    let (c, deliveries) = driven_outputs(&outputs, &[a, b, cc], first);
    assert_eq!(c.ids[&a], solo(&model, &p[0], greedy(20)));
    assert_eq!(c.ids[&b], solo(&model, &p[1], seeded));
    assert_eq!(c.ids[&cc], solo(&model, &p[2], greedy(9)));
    // Tokens reach the sink a step at a time, not a call's worth at once
    // (a prompt's first token and the step after it may come together).
    assert!(
        deliveries[&cc] >= 8,
        "9 tokens in {} outputs",
        deliveries[&cc]
    );
    assert_eq!(driver.occupancy().unwrap().running, 0);
    driver.stop();
}

#[test]
fn a_driven_row_is_cancelled_within_a_step_and_stopping_frees_the_cache() {
    let _g = serial();
    let model = model();
    let p = prompts();
    // A thread's first work on a GPU leaves a small buffer of its stream's
    // behind: a driver run first warms the pooled thread the next one takes.
    drive_once(&model, &p[1]);
    let baseline = settled_active_memory();
    let (driver, outputs) = driver(&model);
    let long = driver
        .intake()
        .admit(p[0].clone(), greedy(200), None)
        .unwrap();
    let mut seen = 0;
    while seen < 5 {
        if let Output::Events { events, .. } = outputs.recv().unwrap() {
            seen += events.iter().filter(|e| e.id == long).count();
        }
    }
    driver.cancel(vec![long]).unwrap();
    // The step in flight and the one queued behind it may still report.
    let mut after = 0;
    while let Ok(Output::Events { events, .. }) =
        outputs.recv_timeout(std::time::Duration::from_millis(500))
    {
        assert!(events.iter().all(|e| e.delta.finish.is_none()));
        after += events.len();
    }
    assert!(after <= 2, "{after} outputs after the cancellation");
    assert_eq!(driver.occupancy().unwrap().running, 0);
    // The next request takes the freed slot.
    let short = driver
        .intake()
        .admit(p[1].clone(), greedy(6), None)
        .unwrap();
    let (c, _) = driven_outputs(&outputs, &[short], Collected::default());
    assert_eq!(c.ids[&short], solo(&model, &p[1], greedy(6)));
    driver.stop();
    let end = settled_active_memory();
    let c = &model.config;
    let key_row = (c.num_kv_heads * c.head_dim) as usize * std::mem::size_of::<f32>();
    assert!(
        end < baseline + key_row,
        "MLX active memory grew from {baseline} to {end} bytes"
    );
}

#[test]
fn a_driver_whose_sink_is_gone_stops_and_refuses_requests() {
    let _g = serial();
    let model = model();
    let p = prompts();
    let (driver, outputs) = driver(&model);
    drop(outputs);
    driver
        .intake()
        .admit(p[0].clone(), greedy(50), None)
        .unwrap();
    // The first output finds the sink closed and the thread ends.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let refused = loop {
        match driver.intake().admit(p[1].clone(), greedy(4), None) {
            Err(e) => break e,
            Ok(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            Ok(_) => panic!("the driver kept running without a sink"),
        }
    };
    assert_eq!(refused.kind(), "released");
    // A bad request is the caller's error at once, checked on its thread.
    let e = driver.intake().admit(vec![], greedy(4), None).unwrap_err();
    assert_eq!(e.kind(), "invalid_argument");
    driver.stop();
}

/// Threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn drivers_started_again_and_again_reuse_their_threads() {
    let _g = serial();
    let model = model();
    let p = prompts();
    drive_once(&model, &p[1]);
    let before = threads();
    for _ in 0..4 {
        drive_once(&model, &p[1]);
    }
    // MLX gives each thread that runs work a stream of its own, and on the
    // CPU a thread behind it, and frees neither.
    assert_eq!(threads(), before, "threads grew over 4 drivers");
}
