//! Rotary position embedding for one forward pass.
//!
//! On a GPU stream MLX's fused `rope` kernel rotates queries and keys. On a
//! CPU stream MLX has no such kernel: `rope` expands into about 25 ops that
//! recompute the angles' cosines and sines at every call, twice per layer.
//! There the cosines and sines are computed once per forward pass, by MLX's
//! own `rope`, and every layer applies them to its queries and keys together
//! with 6 ops of the same float arithmetic, so the values are the same.
//!
//! `rope_scaling` of type `yarn` or `llama3` gives RoPE frequencies of its
//! own ([`Scaled`]), computed as mlx-lm's rope_utils computes them, and
//! YaRN also scales queries and keys before their rotation. Both live in
//! [`Rope::rotate_heads_first`], from which the CPU's tables and the GPU
//! kernels' [`PositionTable`] are made too: their cosines and sines carry
//! the scaled frequencies and the scale (rotating a probe of ones scaled by
//! it gives `scale * cos`, `scale * sin`), so every path rotates alike.

use mlx_rs::fast::{rope, rope_dynamic};
use mlx_rs::ops::indexing::{IndexOp, IntoStrideBy};
use mlx_rs::ops::{broadcast_to, concatenate, stack, zeros_dtype};
use mlx_rs::{Array, Dtype};
use std::sync::Mutex;

use crate::checkpoint::config::{ModelConfig, RopeScaling};
use crate::error::{Error, Result};
use crate::kv::cache::RopeOffset;

/// MLX's rotation of every position from 0 as float32 rows `[len,
/// head_dim]` (cosines, signed sines; see [`Rope::Table`]), made once and
/// grown as steps reach further: one-token steps on a GPU read their rows'
/// positions from it, where building each step's rows took eight nodes.
/// The same rows: MLX's `rope` rotates each position on its own.
pub struct PositionTable {
    /// [`probe`] in float32.
    probe: Array,
    rows: Mutex<Option<(i32, Array, Array)>>,
}

impl PositionTable {
    pub fn new(c: &ModelConfig) -> Result<Self> {
        Ok(PositionTable {
            probe: probe(c.head_dim, c.rope_traditional, Dtype::Float32)?,
            rows: Mutex::new(None),
        })
    }

    pub fn probe(&self) -> &Array {
        &self.probe
    }

    /// `(cos, signed_sin)`, `[len, head_dim]` with `len > last`.
    pub fn rows(&self, c: &ModelConfig, last: i32) -> Result<(Array, Array)> {
        let mut held = self.rows.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((len, cos, sin)) = held.as_ref() {
            if *len > last {
                return Ok((cos.clone(), sin.clone()));
            }
        }
        let len = u32::try_from(last)
            .ok()
            .and_then(|l| (l + 1).max(256).checked_next_power_of_two())
            .and_then(|l| i32::try_from(l).ok())
            .ok_or_else(|| Error::invalid(format!("position {last} out of range")))?;
        let Rope::Table {
            rows: (cos, sin), ..
        } = Rope::new(c, RopeOffset::Scalar(0), 1, len, 1, &self.probe, true)?
        else {
            return Err(Error::Mlx("a RoPE table was asked for".into()));
        };
        let (cos, sin) = (
            cos.reshape(&[len, c.head_dim])?,
            sin.reshape(&[len, c.head_dim])?,
        );
        // Evaluated here, once: steps on other streams read it later.
        mlx_rs::transforms::eval([&cos, &sin])?;
        *held = Some((len, cos.clone(), sin.clone()));
        Ok((cos, sin))
    }
}

/// RoPE frequencies of a `rope_scaling` (see [`RopeScaling`]) and the
/// scale of the rotated inputs, as mlx-lm's rope_utils computes them: in
/// float32, from float32 exponents, with its Python scalars rounded to
/// float32 where MLX would round them.
pub struct Scaled {
    /// `[head_dim / 2]` float32: the periods MLX's rope divides positions by.
    pub freqs: Vec<f32>,
    /// What queries and keys are multiplied by before the rotation (YaRN's
    /// mscale ratio; 1 for none).
    pub input_scale: f64,
}

impl Scaled {
    /// The scaling of `c`'s RoPE, `None` for MLX's rope from its base.
    pub fn of(c: &ModelConfig) -> Option<Scaled> {
        let dims = c.head_dim;
        let half = (dims / 2) as usize;
        let base = c.rope_theta;
        // base ** (arange(0, dims, 2) / dims), all float32.
        let powers = || -> Vec<f32> {
            (0..half)
                .map(|i| base.powf((2 * i) as f32 / dims as f32))
                .collect()
        };
        match c.rope_scaling {
            RopeScaling::None => None,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = (old / low_freq_factor) as f32;
                let high_wavelen = (old / high_freq_factor) as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let spread = (high_freq_factor - low_freq_factor) as f32;
                let freqs = powers()
                    .into_iter()
                    .map(|f| {
                        let wavelen = two_pi * f;
                        let f = if wavelen > low_wavelen {
                            f * factor as f32
                        } else {
                            f
                        };
                        if wavelen > high_wavelen && wavelen < low_wavelen {
                            let smooth = (old as f32 / wavelen - low_freq_factor as f32) / spread;
                            f / ((1.0 - smooth) / factor as f32 + smooth)
                        } else {
                            f
                        }
                    })
                    .collect();
                Some(Scaled {
                    freqs,
                    input_scale: 1.0,
                })
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
            } => {
                let base = base as f64;
                // The dimension at which a wavelength turns `rotations` times
                // over the original context.
                let correction_dim = |rotations: f64| {
                    dims as f64 * (old / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * base.ln())
                };
                let low = correction_dim(beta_fast).floor().max(0.0);
                let high = correction_dim(beta_slow).ceil().min((dims - 1) as f64);
                let high = if low == high { high + 0.001 } else { high };
                let get_mscale = |m: f64| {
                    if factor <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * factor.ln() + 1.0
                    }
                };
                let freqs = powers()
                    .into_iter()
                    .enumerate()
                    .map(|(i, extra)| {
                        let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                        let mask = 1.0 - ramp;
                        let inter = factor as f32 * extra;
                        (inter * extra) / (inter * mask + extra * (1.0 - mask))
                    })
                    .collect();
                Some(Scaled {
                    freqs,
                    input_scale: get_mscale(mscale) / get_mscale(mscale_all_dim),
                })
            }
        }
    }
}

/// A scaled RoPE as MLX's `rope` takes it, made once per forward pass (not
/// per layer): the frequencies as an array, and the input scale.
pub struct Scaling {
    freqs: Array,
    input_scale: f32,
}

impl Scaling {
    fn of(c: &ModelConfig) -> Option<Scaling> {
        Scaled::of(c).map(|s| Scaling {
            freqs: Array::from_slice(&s.freqs, &[s.freqs.len() as i32]),
            input_scale: s.input_scale as f32,
        })
    }

    /// `x` times the input scale, in `x`'s dtype (as mlx-lm multiplies by a
    /// Python float), or `x` itself for a scale of 1.
    fn scale_input(&self, x: &Array) -> Result<Array> {
        if self.input_scale == 1.0 {
            return Ok(x.clone());
        }
        let s = Array::from_f32(self.input_scale).as_dtype(x.dtype())?;
        Ok(x.multiply(&s)?)
    }
}

/// The rotation of one forward pass's positions.
pub enum Rope {
    /// MLX's `rope` per call (its fused kernel on a GPU), with the model's
    /// scaling if any.
    Fused {
        offset: RopeOffset,
        scaling: Option<Scaling>,
    },
    /// Per-position factors for `[B, L, heads, head_dim]` arrays, broadcast
    /// over `heads` query-plus-key heads: `x * cos + swapped(x) * signed_sin`.
    Table {
        cos: Array,
        signed_sin: Array,
        traditional: bool,
        /// `cos` and `signed_sin` before the broadcast, `[rows, L, head_dim]`:
        /// what our CPU kernel reads.
        rows: (Array, Array),
    },
}

/// `[1, 1, 1, head_dim]`: what MLX's rope turns into the cosines and sines of
/// each position (ones where it reads the first element of each rotated
/// pair, zeros where it reads the second: `1 * cos - 0 * sin = cos`,
/// `1 * sin + 0 * cos = sin`).
pub fn probe(head_dim: i32, traditional: bool, dtype: Dtype) -> Result<Array> {
    let half = (head_dim / 2) as usize;
    let values: Vec<f32> = if traditional {
        (0..head_dim).map(|i| ((i + 1) % 2) as f32).collect()
    } else {
        (0..head_dim as usize)
            .map(|i| (i < half) as u8 as f32)
            .collect()
    };
    Ok(Array::from_slice(&values, &[1, 1, 1, head_dim]).as_dtype(dtype)?)
}

impl Rope {
    /// The rotation for `len` new positions of `batch` rows starting at
    /// `offset`: a table when `table` (for a CPU stream), else MLX's rope;
    /// `heads` is the number of query plus key heads rotated together,
    /// `probe` what [`probe`] made for this model.
    pub fn new(
        c: &ModelConfig,
        offset: RopeOffset,
        batch: i32,
        len: i32,
        heads: i32,
        probe: &Array,
        table: bool,
    ) -> Result<Self> {
        if !table {
            return Ok(Rope::fused(c, offset));
        }
        let hd = c.head_dim;
        let rows = match &offset {
            RopeOffset::Scalar(_) => 1,
            RopeOffset::PerRow(_) => batch,
        };
        // A buffer of its own, not a broadcast: MLX's CUDA rope gives its
        // output its input's strides, so every row of a broadcast input
        // would get the last row's rotation.
        let ones = zeros_dtype(&[rows, 1, len, hd], probe.dtype())?.add(probe)?;
        // [rows, 1, len, hd] -> [rows, len, 1, hd]
        let table = Rope::fused(c, offset)
            .rotate_heads_first(c, &ones)?
            .transpose_axes(&[0, 2, 1, 3])?;
        let half = hd / 2;
        let (cos, signed_sin) = if c.rope_traditional {
            let cos = table.index((.., .., .., (0..).stride_by(2)));
            let sin = table.index((.., .., .., (1..).stride_by(2)));
            let pairs = |a: &Array, b: &Array| -> Result<Array> {
                Ok(stack(&[a, b], -1)?.reshape(&[rows, len, 1, hd])?)
            };
            (pairs(&cos, &cos)?, pairs(&sin.negative()?, &sin)?)
        } else {
            let cos = table.index((.., .., .., ..half));
            let sin = table.index((.., .., .., half..));
            (
                concatenate(&[&cos, &cos], -1)?,
                concatenate(&[&sin.negative()?, &sin], -1)?,
            )
        };
        // Broadcast once here, so that no layer adds a broadcast of its own.
        let shape = [batch, len, heads, hd];
        Ok(Rope::Table {
            cos: broadcast_to(&cos, &shape)?,
            signed_sin: broadcast_to(&signed_sin, &shape)?,
            traditional: c.rope_traditional,
            rows: (
                cos.reshape(&[rows, len, hd])?,
                signed_sin.reshape(&[rows, len, hd])?,
            ),
        })
    }

    /// MLX's rope at `offset` for `c`, its scaling (see [`Scaled`]) made here.
    pub fn fused(c: &ModelConfig, offset: RopeOffset) -> Rope {
        Rope::Fused {
            offset,
            scaling: Scaling::of(c),
        }
    }

    /// Rotates `x`, laid out `[B, heads, L, head_dim]`, with MLX's `rope`
    /// (only for [`Rope::Fused`]).
    /// A scaled RoPE (see [`Scaled`]) scales `x` and rotates it by its own
    /// frequencies.
    pub fn rotate_heads_first(&self, c: &ModelConfig, x: &Array) -> Result<Array> {
        let Rope::Fused { offset, scaling } = self else {
            return Err(crate::error::Error::invalid(
                "a RoPE table rotates [B, L, heads, head_dim] arrays",
            ));
        };
        let (x, base, freqs) = match scaling {
            Some(s) => (s.scale_input(x)?, None, Some(&s.freqs)),
            None => (x.clone(), Some(c.rope_theta), None),
        };
        Ok(match offset {
            RopeOffset::Scalar(offset) => rope(
                &x,
                c.head_dim,
                c.rope_traditional,
                base,
                c.rope_scale,
                *offset,
                freqs,
            )?,
            RopeOffset::PerRow(offsets) => rope_dynamic(
                &x,
                c.head_dim,
                c.rope_traditional,
                base,
                c.rope_scale,
                offsets,
                freqs,
            )?,
        })
    }

    /// Rotates `x`, laid out `[B, L, heads, head_dim]` with the table's shape
    /// (only for [`Rope::Table`]). MLX's rope computes `x1 * cos - x2 * sin`
    /// and `x1 * sin + x2 * cos` for each pair `(x1, x2)`; here the first is
    /// `x1 * cos + x2 * (-sin)` and the second `x2 * cos + x1 * sin`, equal
    /// in floating point (negation is exact, addition commutes).
    pub fn rotate_heads_last(&self, x: &Array) -> Result<Array> {
        let Rope::Table {
            cos,
            signed_sin,
            traditional,
            ..
        } = self
        else {
            return Err(crate::error::Error::invalid(
                "MLX's rope rotates [B, heads, L, head_dim] arrays",
            ));
        };
        let shape = x.shape().to_vec();
        let d = shape[3];
        let swapped = if *traditional {
            let pairs = x.reshape(&[shape[0], shape[1], shape[2], d / 2, 2])?;
            concatenate(
                &[
                    pairs.index((.., .., .., .., 1..2)),
                    pairs.index((.., .., .., .., 0..1)),
                ],
                -1,
            )?
            .reshape(&shape)?
        } else {
            let half = d / 2;
            concatenate(
                &[x.index((.., .., .., half..)), x.index((.., .., .., ..half))],
                -1,
            )?
        };
        Ok(x.multiply(cos)?.add(swapped.multiply(signed_sin)?)?)
    }

    /// [`Rope::rotate_heads_last`] of `x` normalized by `norm` (per-head
    /// weight `[heads, head_dim]` and eps, as [`crate::nn::layers::RmsNorm`]
    /// computes it) or as it is, in one node of our CPU kernels: `None`
    /// where they do not take it (another dtype, a GPU stream, MLX's rope).
    pub fn rotate_normed(&self, x: &Array, norm: Option<(&Array, f32)>) -> Result<Option<Array>> {
        let Rope::Table {
            traditional,
            rows: (cos, signed_sin),
            ..
        } = self
        else {
            return Ok(None);
        };
        emlx_axon_kernels::norm_rope(x, norm, cos, signed_sin, *traditional)
            .map_err(|e| crate::error::Error::Mlx(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::config::Arch;
    use crate::runtime::device::{DeviceKind, Lease};

    fn config(traditional: bool) -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen2,
            hidden_size: 64,
            num_layers: 1,
            intermediate_size: 64,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scale: 0.5,
            rope_scaling: RopeScaling::None,
            rope_traditional: traditional,
            tie_word_embeddings: true,
            vocab_size: 32,
            max_position_embeddings: 128,
            eos_token_ids: vec![],
            quantization: None,
            moe: None,
        }
    }

    /// The table rotates exactly as MLX's rope does, both pair layouts, one
    /// offset for all rows and one per row.
    #[test]
    fn the_table_rotates_exactly_as_mlx_rope() {
        let lease = Lease::new(DeviceKind::Cpu).unwrap();
        lease.stream().run(|| {
            let (b, l, heads) = (2, 3, 6);
            let x = mlx_rs::random::normal::<f32>(&[b, l, heads, 16], None, None, None).unwrap();
            for traditional in [false, true] {
                let c = config(traditional);
                let probe = probe(c.head_dim, traditional, Dtype::Float32).unwrap();
                let offsets = || {
                    [
                        RopeOffset::Scalar(5),
                        RopeOffset::PerRow(Array::from_slice(&[3i32, 9], &[2])),
                    ]
                };
                for (fused, table) in offsets().into_iter().zip(offsets()) {
                    let expected = Rope::fused(&c, fused)
                        .rotate_heads_first(&c, &x.transpose_axes(&[0, 2, 1, 3]).unwrap())
                        .unwrap()
                        .transpose_axes(&[0, 2, 1, 3])
                        .unwrap();
                    let got = Rope::new(&c, table, b, l, heads, &probe, true)
                        .unwrap()
                        .rotate_heads_last(&x)
                        .unwrap();
                    assert_eq!(got.shape(), expected.shape());
                    let flat = |a: &Array| a.reshape(&[-1]).unwrap().as_slice::<f32>().to_vec();
                    assert!(flat(&got) == flat(&expected), "traditional={traditional}");
                }
            }
        });
    }

    /// With YaRN's frequencies and input scale, the table (and so every
    /// path reading one) rotates as MLX's rope of the scaled input does, to
    /// float32 rounding (the table multiplies by `scale * cos`).
    #[test]
    fn scaled_tables_rotate_as_mlx_rope_of_the_scaled_input() {
        let lease = Lease::new(DeviceKind::Cpu).unwrap();
        lease.stream().run(|| {
            let (b, l, heads) = (2, 40, 6);
            let x = mlx_rs::random::normal::<f32>(&[b, l, heads, 16], None, None, None).unwrap();
            for traditional in [false, true] {
                let c = ModelConfig {
                    rope_scale: 1.0,
                    rope_scaling: RopeScaling::Yarn {
                        factor: 4.0,
                        original_max_position_embeddings: 64.0,
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                        mscale: 1.0,
                        mscale_all_dim: 0.0,
                    },
                    ..config(traditional)
                };
                let scaled = Scaled::of(&c).unwrap();
                assert!((scaled.input_scale - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
                let probe = probe(c.head_dim, traditional, Dtype::Float32).unwrap();
                let offset = || RopeOffset::PerRow(Array::from_slice(&[3i32, 90], &[2]));
                let expected = Rope::fused(&c, offset())
                    .rotate_heads_first(&c, &x.transpose_axes(&[0, 2, 1, 3]).unwrap())
                    .unwrap()
                    .transpose_axes(&[0, 2, 1, 3])
                    .unwrap();
                let got = Rope::new(&c, offset(), b, l, heads, &probe, true)
                    .unwrap()
                    .rotate_heads_last(&x)
                    .unwrap();
                let flat = |a: &Array| a.reshape(&[-1]).unwrap().as_slice::<f32>().to_vec();
                let worst = crate::nn::layers::tests::relative_error(&flat(&got), &flat(&expected));
                assert!(worst < 1e-6, "traditional={traditional}: {worst}");
                // Unscaled, the rotation differs: the scaling was applied.
                let plain = Rope::fused(&config(traditional), offset())
                    .rotate_heads_first(
                        &config(traditional),
                        &x.transpose_axes(&[0, 2, 1, 3]).unwrap(),
                    )
                    .unwrap()
                    .transpose_axes(&[0, 2, 1, 3])
                    .unwrap();
                let apart =
                    crate::nn::layers::tests::relative_error(&flat(&plain), &flat(&expected));
                assert!(apart > 1e-2, "traditional={traditional}: {apart}");
            }
        });
    }
}
