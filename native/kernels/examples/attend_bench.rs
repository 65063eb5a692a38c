//! Throughput of the decode layer's one-token attention as a step reads it:
//! every key head of every layer its own keys and values in memory, float32,
//! float16, 8-bit and 4-bit caches (groups of 64), 1 and 2 threads (each
//! thread its share of the heads).
//!
//! cargo run --release -p emlx_axon_kernels --example attend_bench -- [--context N]
//!     [--layers L] [--reps R] [--isa scalar|avx2|avx512]
//!
//! Defaults are the Qwen3-0.6B shape (8 key heads of 128, 2 query heads per
//! key head, 28 layers) after 2,048 tokens. Prints, per cache dtype and
//! thread count, the milliseconds one step's attention takes and the GB/s of
//! keys and values read.

use std::time::Instant;

use emlx_axon_kernels::{attend_with, Isa, KeysValues};

const HD: usize = 128;
const G: usize = 2;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .map(|i| {
            args.get(i + 1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} takes a number"))
        })
        .unwrap_or(default)
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Float16 bits of magnitudes 2^-5 to 2^-1, either sign, from `x`'s
/// bits: values to read, no more.
fn as_half(x: f32) -> u16 {
    let bits = x.to_bits();
    let exponent = 10 + (bits >> 10) % 5;
    ((bits >> 16) & 0x8000 | exponent << 10 | bits & 0x3ff) as u16
}

enum Cache {
    F32(Vec<f32>, Vec<f32>),
    F16(Vec<u16>, Vec<u16>),
    /// `bits` bits in groups of 64: keys' and values' words, scales and biases.
    Quantized(i32, [(Vec<u32>, Vec<f32>, Vec<f32>); 2]),
}

const QUANT_GROUP: usize = 64;

impl Cache {
    fn head(&self, h: usize, len: usize) -> KeysValues<'_> {
        let r = h * len..(h + 1) * len;
        match self {
            Cache::F32(k, v) => KeysValues::F32(&k[r.clone()], &v[r]),
            Cache::F16(k, v) => KeysValues::F16(&k[r.clone()], &v[r]),
            Cache::Quantized(bits, [k, v]) => {
                let words = len * *bits as usize / 32;
                let (w, p) = (
                    h * words..(h + 1) * words,
                    r.start / QUANT_GROUP..r.end / QUANT_GROUP,
                );
                KeysValues::Quantized {
                    keys: (&k.0[w.clone()], &k.1[p.clone()], &k.2[p.clone()]),
                    values: (&v.0[w], &v.1[p.clone()], &v.2[p]),
                    bits: *bits,
                    group_size: QUANT_GROUP as i32,
                }
            }
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Cache::F32(k, v) => (k.len() + v.len()) * 4,
            Cache::F16(k, v) => (k.len() + v.len()) * 2,
            Cache::Quantized(_, c) => c
                .iter()
                .map(|(w, s, b)| (w.len() + s.len() + b.len()) * 4)
                .sum(),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let context = arg(&args, "--context", 2048);
    let layers = arg(&args, "--layers", 28);
    let reps = arg(&args, "--reps", 5);
    let heads = layers * 8;
    let len = context * HD;
    let q: Vec<f32> = values(G * HD, 1).iter().map(|x| x * 0.09).collect();
    let k = values(heads * len, 2);
    let v = values(heads * len, 3);
    let half = |x: &[f32]| x.iter().map(|&a| as_half(a)).collect::<Vec<u16>>();
    let f16 = Cache::F16(half(&k), half(&v));
    let quantized = |x: &[f32], bits: usize, seed| {
        let groups = x.len() / QUANT_GROUP;
        let words = values(x.len() * bits / 32, seed)
            .iter()
            .map(|w| (w.to_bits() ^ (w.to_bits() >> 7)).wrapping_mul(2_654_435_761))
            .collect();
        let scales = values(groups, seed + 1).iter().map(|s| s * 0.01).collect();
        (words, scales, values(groups, seed + 2))
    };
    let q8 = Cache::Quantized(8, [quantized(&k, 8, 4), quantized(&v, 8, 7)]);
    let q4 = Cache::Quantized(4, [quantized(&k, 4, 4), quantized(&v, 4, 7)]);
    let caches = [
        ("float32", Cache::F32(k, v)),
        ("float16", f16),
        ("8-bit", q8),
        ("4-bit", q4),
    ];
    let isa = match args
        .iter()
        .position(|a| a == "--isa")
        .map(|i| args.get(i + 1))
    {
        None => Isa::selected(),
        Some(name) => *Isa::ALL
            .iter()
            .find(|i| Some(&i.name().to_string()) == name)
            .expect("--isa takes scalar, avx2 or avx512"),
    };
    for (name, cache) in &caches {
        for threads in [1usize, 2] {
            let mut times = Vec::new();
            for _ in 0..reps {
                let t = Instant::now();
                std::thread::scope(|s| {
                    for part in 0..threads {
                        let (cache, q) = (&cache, &q);
                        s.spawn(move || {
                            let mut out = vec![0f32; G * HD];
                            for h in (part..heads).step_by(threads) {
                                attend_with(isa, q, cache.head(h, len), HD, &mut out)
                                    .expect("attend");
                            }
                        });
                    }
                });
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            let best = times.iter().copied().fold(f64::INFINITY, f64::min);
            let list: Vec<String> = times.iter().map(|t| format!("{t:.2}")).collect();
            println!(
                "{} {name} context {context} threads {threads}: best {best:.2} ms ({:.1} GB/s), all [{}]",
                isa.name(),
                cache.bytes() as f64 / best / 1e6,
                list.join(", ")
            );
        }
    }
}
