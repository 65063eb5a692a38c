//! The compiled decode step gives the eager step's tokens: padded batch
//! rows, seeded sampling, a scheduler whose rows join and leave, and steps
//! that cross from one bucket of attended keys to the next. On a CPU the
//! step runs compiled only when asked (`EMLX_AXON_COMPILED_DECODE=1`); this
//! binary holds a single test, as it switches that variable.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::*;
use emlx_axon_engine::{
    Dtype, Event, GenerateOptions, Generation, LoadOptions, Model, SamplerConfig, SamplerKind,
    Scheduler, SchedulerConfig,
};

const FIXTURE: &str = "qwen3-4bit-g64";

fn seeded() -> SamplerConfig {
    SamplerConfig {
        kind: SamplerKind::TopPGpu,
        temperature: 0.8,
        top_p: 0.9,
        seed: Some(11),
        ..SamplerConfig::default()
    }
}

/// Every output of the scenarios, and whether each ran compiled.
fn run_all(model: &Arc<Model>, prompts: &[Vec<u32>]) -> (Vec<Vec<u32>>, Vec<bool>) {
    let mut out = vec![];
    let mut compiled = vec![];
    let mut generate = |prompts: &[Vec<u32>], o: GenerateOptions| {
        let mut g = Generation::start(model.clone(), None, None, prompts, o).unwrap();
        compiled.push(g.runs_compiled());
        while !g.is_done() {
            g.next(3).unwrap();
        }
        out.extend(g.generated());
    };
    // Rows of different lengths (left padding), greedy and seeded.
    generate(prompts, options(12, SamplerConfig::default()));
    generate(&prompts[..1], options(12, seeded()));
    // Past 256 positions: the attended keys move to the next bucket.
    let long: Vec<u32> = prompts[0].iter().cycle().take(250).copied().collect();
    generate(&[long], options(12, SamplerConfig::default()));

    let config = SchedulerConfig {
        slots: 4,
        capacity: 320,
        prefill_chunk: 64,
        prefix_cache_bytes: 0,
        prefix_min_tokens: 4,
    };
    let mut s = Scheduler::new(model.clone(), None, config).unwrap();
    compiled.push(s.runs_compiled());
    let mut ids: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut order = vec![];
    let mut collect = |events: Vec<Event>| {
        for e in events {
            ids.entry(e.id).or_default().extend(e.delta.ids);
        }
    };
    order.push(
        s.admit(prompts[0].clone(), options(20, SamplerConfig::default()))
            .unwrap(),
    );
    collect(s.step(2).unwrap());
    order.push(s.admit(prompts[1].clone(), options(6, seeded())).unwrap());
    collect(s.step(2).unwrap());
    order.push(
        s.admit(
            prompts[2 % prompts.len()].clone(),
            options(9, SamplerConfig::default()),
        )
        .unwrap(),
    );
    while !s.is_idle() {
        collect(s.step(3).unwrap());
    }
    out.extend(order.iter().map(|id| ids[id].clone()));
    (out, compiled)
}

#[test]
fn compiled_steps_give_the_eager_steps_tokens() {
    let model = load(
        FIXTURE,
        &LoadOptions {
            dtype: Some(Dtype::Float32),
            cpu_parallel: Some(false),
            ..LoadOptions::default()
        },
    );
    let prompts: Vec<Vec<u32>> = reference(FIXTURE, "").into_iter().map(|r| r.1).collect();
    assert!(prompts.len() >= 2 && prompts[0].len() != prompts[1].len());

    std::env::set_var("EMLX_AXON_COMPILED_DECODE", "0");
    let (eager, flags) = run_all(&model, &prompts);
    assert!(flags.iter().all(|&c| !c), "the eager run ran compiled");
    std::env::set_var("EMLX_AXON_COMPILED_DECODE", "1");
    let (compiled, flags) = run_all(&model, &prompts);
    std::env::remove_var("EMLX_AXON_COMPILED_DECODE");
    assert!(flags.iter().all(|&c| c), "the compiled run ran eager");
    assert_eq!(eager.len(), compiled.len());
    for (i, (e, c)) in eager.iter().zip(&compiled).enumerate() {
        assert!(!e.is_empty(), "output {i} is empty");
        assert_eq!(e, c, "output {i}: compiled steps gave other tokens");
    }
}
