//! The decode layer's one-token attention, every variant that runs here,
//! with float32, float16 and quantized keys and values, against a float64 evaluation
//! of softmax(q . k) @ v over the same values (the float16 ones decoded
//! from their bits), for head widths the vector loads divide and ones
//! they do not.

mod common;

use common::{data, rel_err};
use emlx_axon_kernels::{attend_with, Isa, KeysValues};

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
