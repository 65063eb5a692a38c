//! Seeded fuzzing of what loading parses: config.json values and
//! safetensors headers. Nothing may panic or abort; a checkpoint that cannot
//! hold the model's tensors must be refused.

mod common;

use std::fs;

use common::*;
use emlx_axon_engine::{Dtype, LoadOptions, Model, ModelConfig};
use serde_json::{json, Map, Value};

/// SplitMix64: reproducible without another dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    fn int(&mut self) -> Value {
        let n: i128 = *self.pick(&[
            0,
            1,
            -1,
            2,
            7,
            64,
            128,
            i32::MAX as i128,
            i32::MAX as i128 + 1,
            u32::MAX as i128 + 1,
            i64::MAX as i128,
            i64::MIN as i128,
            u64::MAX as i128,
        ]);
        match n {
            n if n > i64::MAX as i128 => json!(n as u64),
            n => json!(n as i64),
        }
    }

    fn string(&mut self) -> String {
        let len = self.below(12) as usize;
        (0..len)
            .map(|_| *self.pick(&['a', 'z', '.', '_', '0', '9', 'é', '"', '\\', '\u{0}']))
            .collect()
    }

    fn value(&mut self, depth: u32) -> Value {
        match self.below(if depth > 3 { 6 } else { 8 }) {
            0 => Value::Null,
            1 => json!(self.below(2) == 0),
            2 => self.int(),
            3 => json!(*self.pick(&[0.5, -1.5, 1e300, -0.0, 128.0])),
            4 => json!(self.string()),
            5 => json!(*self.pick(&["F32", "BF16", "U32", "F64", "Q4", "", "affine", "qwen3"])),
            6 => Value::Array((0..self.below(4)).map(|_| self.value(depth + 1)).collect()),
            _ => Value::Object(
                (0..self.below(4))
                    .map(|_| (self.string(), self.value(depth + 1)))
                    .collect::<Map<_, _>>(),
            ),
        }
    }
}

fn base_config() -> Value {
    json(fixture("qwen3-4bit-g64").join("config.json"))
}

#[test]
fn config_parsing_never_panics() {
    let base = base_config();
    let keys: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
    let mut rng = Rng(7);
    let (mut ok, mut err) = (0, 0);
    for _ in 0..5000 {
        let mut config = base.clone();
        for _ in 0..=rng.below(3) {
            let key = rng.pick(&keys).clone();
            match rng.below(4) {
                0 => {
                    config.as_object_mut().unwrap().remove(&key);
                }
                1 => {
                    let field = rng.pick(&["bits", "group_size", "mode"]).to_string();
                    let value = rng.value(2);
                    if let Some(q) = config["quantization"].as_object_mut() {
                        q.insert(field, value);
                    }
                }
                _ => config[key] = rng.value(0),
            }
        }
        match ModelConfig::from_json(&config) {
            Ok(_) => ok += 1,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                err += 1;
            }
        }
    }
    // Both outcomes are exercised (a mutated optional key often still parses).
    assert!(ok > 100 && err > 1000, "ok {ok}, err {err}");
}

fn random_header(rng: &mut Rng) -> Vec<u8> {
    match rng.below(3) {
        // Raw bytes.
        0 => (0..rng.below(600)).map(|_| rng.next() as u8).collect(),
        // JSON shaped like a safetensors header.
        1 => {
            let mut header = Map::new();
            for _ in 0..=rng.below(4) {
                let name = rng
                    .pick(&["model.norm.weight", "__metadata__", "x"])
                    .to_string();
                let mut entry = json!({
                    "dtype": rng.value(3),
                    "shape": (0..rng.below(4)).map(|_| rng.int()).collect::<Vec<_>>(),
                    "data_offsets": [rng.int(), rng.int()],
                });
                if rng.below(3) == 0 {
                    entry = rng.value(0);
                }
                header.insert(name, entry);
            }
            serde_json::to_vec(&Value::Object(header)).unwrap()
        }
        // Any JSON.
        _ => serde_json::to_vec(&rng.value(0)).unwrap(),
    }
}

#[test]
fn random_safetensors_headers_are_refused() {
    let dir = scratch_copy("qwen3-4bit-g64", "fuzz");
    fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    let path = dir.join("model.safetensors");
    let options = LoadOptions {
        dtype: Some(Dtype::Float32),
        ..LoadOptions::default()
    };
    let mut rng = Rng(11);
    for case in 0..1000 {
        let header = random_header(&mut rng);
        let length = match rng.below(4) {
            0 => rng.next(),
            _ => header.len() as u64,
        };
        let mut bytes = length.to_le_bytes().to_vec();
        bytes.extend(&header);
        bytes.extend((0..rng.below(2048)).map(|_| rng.next() as u8));
        fs::write(&path, &bytes).unwrap();
        match Model::load(&dir, &options) {
            Ok(_) => panic!("case {case} loaded: {}", String::from_utf8_lossy(&header)),
            Err(e) => assert!(
                ["safetensors", "missing_tensor", "shape_mismatch"].contains(&e.kind()),
                "case {case}: {}: {e}",
                e.kind()
            ),
        }
    }
    fs::remove_dir_all(&dir).unwrap();
}
