//! The decode layer's one-token attention, every variant that runs here,
//! with float32, float16 and quantized keys and values, against a float64 evaluation
//! of softmax(q . k) @ v over the same values (the float16 ones decoded
//! from their bits), for head widths the vector loads divide and ones
//! they do not. Then a prompt chunk's causal attention the same way, and
//! its MLX node against MLX's own attention on slices of a cache's buffers.

mod common;

use common::{data, on_cpu, rel_err};
use emlx_axon_kernels::{
    attend_with, prompt_attention, prompt_attention_with, Isa, KeysValues, PromptShape,
};
use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::random::{key, normal};
use mlx_rs::{Array, Dtype};

/// `x` as IEEE half bits, rounded to nearest (normal values; smaller ones
/// flush to zero, which the kernels then read as zero).
fn to_half(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign;
    }
    let man = bits & 0x7f_ffff;
    let rounded = ((exp as u32) << 10 | (man >> 13)) + ((man >> 12) & 1);
    sign | rounded as u16
}

/// A half's value (normal, zero or subnormal: all `to_half` makes).
fn from_half(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let man = (h & 0x3ff) as f64;
    sign * if exp == 0 {
        man * 2f64.powi(-24)
    } else {
        (1.0 + man / 1024.0) * 2f64.powi(exp - 15)
    }
}

fn reference(q: &[f32], k: &[f64], v: &[f64], hd: usize) -> Vec<f32> {
    let n = k.len() / hd;
    q.chunks(hd)
        .flat_map(|qg| {
            let scores: Vec<f64> = k
                .chunks(hd)
                .map(|kj| qg.iter().zip(kj).map(|(&a, &b)| a as f64 * b).sum())
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = e.iter().sum();
            (0..hd)
                .map(|d| (0..n).map(|j| e[j] / total * v[j * hd + d]).sum::<f64>() as f32)
                .collect::<Vec<f32>>()
        })
        .collect()
}

#[test]
fn every_variant_matches_a_float64_evaluation_for_both_cache_dtypes() {
    let mut ran = 0;
    for (hd, g, n) in [(128, 2, 300), (64, 4, 17), (40, 1, 9), (12, 3, 5)] {
        let q: Vec<f32> = data(g * hd, hd as u64).iter().map(|x| x * 0.5).collect();
        let k = data(n * hd, 7 + n as u64);
        let v = data(n * hd, 11 + n as u64);
        let (kh, vh): (Vec<u16>, Vec<u16>) = (
            k.iter().map(|&x| to_half(x)).collect(),
            v.iter().map(|&x| to_half(x)).collect(),
        );
        let wide = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let half = |x: &[u16]| x.iter().map(|&h| from_half(h)).collect::<Vec<_>>();
        let expected_f32 = reference(&q, &wide(&k), &wide(&v), hd);
        let expected_f16 = reference(&q, &half(&kh), &half(&vh), hd);
        // The float16 values are not the float32 ones: the cases differ.
        assert!(rel_err(&expected_f16, &expected_f32) > 1e-5);
        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
            for (kv, expected) in [
                (KeysValues::F32(&k, &v), &expected_f32),
                (KeysValues::F16(&kh, &vh), &expected_f16),
            ] {
                let f16 = matches!(kv, KeysValues::F16(..));
                let mut out = vec![0f32; g * hd];
                attend_with(isa, &q, kv, hd, &mut out).unwrap();
                let err = rel_err(&out, expected);
                assert!(
                    err < 2e-6,
                    "{} hd={hd} g={g} n={n} f16={f16}: {err}",
                    isa.name()
                );
                ran += 1;
            }
        }
    }
    assert!(ran >= 8);
}

/// MLX's affine quantization of `x` (rows of `group` values): `bits`-bit
/// values packed little-end first into words, a scale and a bias per group;
/// and the values it stands for (`scale * q + bias`, in float64).
fn quantize(x: &[f32], bits: i32, group: usize) -> (Vec<u32>, Vec<f32>, Vec<f32>, Vec<f64>) {
    let levels = ((1u32 << bits) - 1) as f32;
    let per_word = 32 / bits as usize;
    let mut words = vec![0u32; x.len() / per_word];
    let (mut scales, mut biases, mut values) = (vec![], vec![], vec![]);
    for (g, xs) in x.chunks(group).enumerate() {
        let (lo, hi) = xs
            .iter()
            .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
        let scale = ((hi - lo) / levels).max(1e-7);
        scales.push(scale);
        biases.push(lo);
        for (e, &v) in xs.iter().enumerate() {
            let q = ((v - lo) / scale).round().clamp(0.0, levels) as u32;
            let i = g * group + e;
            words[i / per_word] |= q << (bits as usize * (i % per_word));
            values.push(scale as f64 * q as f64 + lo as f64);
        }
    }
    (words, scales, biases, values)
}

/// Quantized keys and values (8 and 4 bits, groups of 16 to 128, one to
/// ten query heads a key head),
/// every variant against the float64 evaluation over the values they stand
/// for, which differ from the float32 ones they were made from.
#[test]
fn every_variant_matches_a_float64_evaluation_of_quantized_keys_and_values() {
    let mut ran = 0;
    for (hd, g, n, group) in [
        (128, 2, 300, 64),
        (64, 4, 17, 32),
        (32, 1, 9, 16),
        (128, 8, 40, 128),
    ] {
        let q: Vec<f32> = data(g * hd, hd as u64).iter().map(|x| x * 0.5).collect();
        let k = data(n * hd, 7 + n as u64);
        let v = data(n * hd, 11 + n as u64);
        for bits in [8, 4] {
            let (kw, ks, kb, kx) = quantize(&k, bits, group);
            let (vw, vs, vb, vx) = quantize(&v, bits, group);
            let expected = reference(&q, &kx, &vx, hd);
            let wide = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<_>>();
            let unquantized = reference(&q, &wide(&k), &wide(&v), hd);
            assert!(rel_err(&expected, &unquantized) > 1e-4, "bits={bits}");
            for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
                let kv = KeysValues::Quantized {
                    keys: (&kw, &ks, &kb),
                    values: (&vw, &vs, &vb),
                    bits,
                    group_size: group as i32,
                };
                let mut out = vec![0f32; g * hd];
                attend_with(isa, &q, kv, hd, &mut out).unwrap();
                // The vector variants sum scale * (q . integers) and
                // bias * (the sum of q) per group, which partly cancel:
                // a little more rounding than the values' own products.
                let err = rel_err(&out, &expected);
                assert!(
                    err < 2e-5,
                    "{} hd={hd} g={g} n={n} bits={bits} group={group}: {err}",
                    isa.name()
                );
                ran += 1;
            }
        }
    }
    assert!(ran >= 8);
}

#[test]
fn bad_buffers_are_an_error() {
    let q = vec![0f32; 8];
    let k = vec![0f32; 12];
    let mut out = vec![0f32; 8];
    let err = attend_with(Isa::Scalar, &q, KeysValues::F32(&k, &k[..8]), 4, &mut out).unwrap_err();
    assert!(err.to_string().contains("attend"), "{err}");
    // A group that does not divide the heads, and scales for too few groups.
    let words = [0u32; 4];
    let params = [0f32; 2];
    for (group, params) in [(3, &params[..]), (8, &params[..1])] {
        let kv = KeysValues::Quantized {
            keys: (&words, params, params),
            values: (&words, params, params),
            bits: 8,
            group_size: group,
        };
        let err = attend_with(Isa::Scalar, &q, kv, 4, &mut out).unwrap_err();
        assert!(err.to_string().contains("quantized"), "{err}");
    }
}

/// The float64 evaluation of a prompt chunk's attention: row (b, h, g, i)
/// of `q` `[B, nkv, G * L, hd]` against the first `S - L + i + 1` keys of
/// key head (b, h).
fn prompt_reference(q: &[f32], k: &[f64], v: &[f64], s: PromptShape) -> Vec<f32> {
    let (l, hd) = (s.queries, s.head_dim);
    let head = s.keys * hd;
    q.chunks(s.group * l * hd)
        .enumerate()
        .flat_map(|(h, qh)| {
            let (k, v) = (&k[h * head..][..head], &v[h * head..][..head]);
            qh.chunks(hd)
                .enumerate()
                .flat_map(|(r, row)| {
                    let seen = (s.keys - l + r % l + 1) * hd;
                    reference(row, &k[..seen], &v[..seen], hd)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every variant, float32 and float16 caches: one query, a query per key,
/// chunks after cached positions, query blocks the chunk does not divide,
/// and head widths the vectors do not divide.
#[test]
fn prompt_attention_matches_a_float64_evaluation_in_every_variant() {
    let mut ran = 0;
    for (batch, kv_heads, group, queries, keys, head_dim) in [
        (1, 1, 1, 1, 1, 16),
        (1, 2, 2, 5, 9, 16),
        (2, 2, 3, 37, 40, 40),
        (1, 2, 2, 300, 300, 64),
        (1, 1, 2, 130, 1200, 128),
    ] {
        let shape = PromptShape {
            batch,
            kv_heads,
            group,
            queries,
            keys,
            head_dim,
        };
        let (rows, cache) = (shape.query_values(), shape.cache_values());
        let scale = (head_dim as f32).powf(-0.5) * 2.0;
        let q: Vec<f32> = data(rows, 3).iter().map(|x| x * scale).collect();
        let (k, v) = (data(cache, 4), data(cache, 5));
        let (kh, vh): (Vec<u16>, Vec<u16>) = (
            k.iter().map(|&x| to_half(x)).collect(),
            v.iter().map(|&x| to_half(x)).collect(),
        );
        let wide = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let half = |x: &[u16]| x.iter().map(|&h| from_half(h)).collect::<Vec<_>>();
        let expected_f32 = prompt_reference(&q, &wide(&k), &wide(&v), shape);
        let expected_f16 = prompt_reference(&q, &half(&kh), &half(&vh), shape);
        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
            for (kv, expected) in [
                (KeysValues::F32(&k, &v), &expected_f32),
                (KeysValues::F16(&kh, &vh), &expected_f16),
            ] {
                let f16 = matches!(kv, KeysValues::F16(..));
                let mut out = vec![f32::NAN; rows];
                prompt_attention_with(isa, &q, kv, shape, &mut out).unwrap();
                let err = rel_err(&out, expected);
                assert!(err < 1e-5, "{} {shape:?} f16={f16}: {err}", isa.name());
                ran += 1;
            }
        }
    }
    assert!(ran >= 10);
}

/// MLX's attention with its causal mask (aligned to the last key) over
/// `q` `[B, nkv, G * L, hd]` as `[B, nkv * G, L, hd]` heads.
fn mlx_attention(q: &Array, keys: &Array, values: &Array, queries: i32) -> Array {
    let (b, nkv, hd) = (q.dim(0), q.dim(1), q.dim(3));
    let heads = q
        .reshape(&[b, nkv * (q.dim(2) / queries), queries, hd])
        .unwrap();
    let (keys, values) = (
        keys.as_dtype(Dtype::Float32).unwrap(),
        values.as_dtype(Dtype::Float32).unwrap(),
    );
    let out = scaled_dot_product_attention(
        &heads,
        &keys,
        &values,
        1.0,
        ScaledDotProductAttentionMask::Causal,
        None,
    )
    .unwrap();
    out.reshape(q.shape()).unwrap()
}

/// The MLX node over keys and values as a cache holds them: a slice of its
/// buffers read in place (float32 and float16), and a transposed view,
/// which is copied first; each against MLX's own attention.
#[test]
fn prompt_attention_node_matches_mlx_on_a_cache_s_slices() {
    on_cpu(|| {
        let (nkv, group, queries, filled, capacity, hd) = (2, 3, 8, 40, 64, 32);
        let buffer = |seed| {
            normal::<f32>(&[1, nkv, capacity, hd][..], None, None, &key(seed).unwrap()).unwrap()
        };
        let q = normal::<f32>(
            &[1, nkv, group * queries, hd][..],
            None,
            0.3,
            &key(3).unwrap(),
        )
        .unwrap();
        let (kb, vb) = (buffer(1), buffer(2));
        let slice = |b: &Array| b.index((.., .., ..filled, ..));
        let transposed = |b: &Array| {
            slice(b)
                .transpose_axes(&[0, 2, 1, 3])
                .unwrap()
                .as_dtype(Dtype::Float32)
                .unwrap()
                .transpose_axes(&[0, 2, 1, 3])
                .unwrap()
        };
        let half = |b: &Array| b.as_dtype(Dtype::Float16).unwrap();
        let cases = [
            ("float32 slice", slice(&kb), slice(&vb)),
            ("float16 slice", slice(&half(&kb)), slice(&half(&vb))),
            ("transposed view", transposed(&kb), transposed(&vb)),
        ];
        for (what, keys, values) in cases {
            let ours = prompt_attention(&q, &keys, &values, queries)
                .unwrap()
                .expect("a CPU float32 query over a float32 or float16 cache is ours");
            let theirs = mlx_attention(&q, &keys, &values, queries);
            assert_eq!(ours.shape(), theirs.shape());
            let err = rel_err(ours.as_slice(), theirs.as_slice());
            assert!(err < 1e-5, "{what}: {err}");
        }
        // Each query sees its own keys: the last query's output is not the
        // first's.
        let ours = prompt_attention(&q, &slice(&kb), &slice(&vb), queries)
            .unwrap()
            .unwrap();
        let rows: Vec<&[f32]> = ours.as_slice::<f32>().chunks(hd as usize).collect();
        let at = |i: usize| -> Vec<f32> {
            (0..(nkv * group) as usize)
                .flat_map(|h| rows[h * queries as usize + i].to_vec())
                .collect()
        };
        assert!(rel_err(&at(0), &at(queries as usize - 1)) > 1e-3);
    })
}

#[test]
fn prompt_attention_declines_what_it_does_not_take() {
    on_cpu(|| {
        let q = normal::<f32>(&[1, 2, 8, 16][..], None, None, &key(1).unwrap()).unwrap();
        let kv = normal::<f32>(&[1, 2, 6, 16][..], None, None, &key(2).unwrap()).unwrap();
        let none =
            |q: &Array, k: &Array, queries| prompt_attention(q, k, k, queries).unwrap().is_none();
        assert!(!none(&q, &kv, 4));
        // 8 rows are not groups of 3 queries; more queries than keys; none.
        assert!(none(&q, &kv, 3));
        assert!(none(&q, &kv, 8));
        assert!(none(&q, &kv, 0));
        // A float16 query, bfloat16 keys, another head width, other heads.
        assert!(none(&q.as_dtype(Dtype::Float16).unwrap(), &kv, 4));
        assert!(none(&q, &kv.as_dtype(Dtype::Bfloat16).unwrap(), 4));
        assert!(none(&q, &kv.index((.., .., .., ..8)), 4));
        assert!(none(&q, &kv.index((.., ..1, .., ..)), 4));
        let shape = PromptShape {
            batch: 1,
            kv_heads: 1,
            group: 1,
            queries: 4,
            keys: 3,
            head_dim: 8,
        };
        let mut out = vec![0.0; 32];
        let (q, k) = (vec![0.0; 32], vec![0.0; 24]);
        let err = prompt_attention_with(Isa::Scalar, &q, KeysValues::F32(&k, &k), shape, &mut out);
        assert!(err.is_err(), "more queries than keys");
        let shape = PromptShape { keys: 4, ..shape };
        let err = prompt_attention_with(Isa::Scalar, &q, KeysValues::F32(&k, &k), shape, &mut out);
        assert!(err.is_err(), "24 keys for a shape of 32");
    })
}
