//! EMLX_AXON_CPU_ACTIVATIONS=int8 makes the primitive run the int8 product of
//! the selected variant for the products `int8_takes` names (prompt batches,
//! and one row where the variant has a matrix-vector form for it): its
//! outputs are exactly `qmm_int8_with`'s, for float32 and bfloat16 scales,
//! and within the activation rounding bound of MLX's float32 product. Other
//! decode batches keep the float32 product (`qmm_with`'s outputs).
//! (Its own test binary: the setting is read once per process.)

mod common;

use common::{case, check_against_mlx, on_cpu};
use emlx_axon_kernels::{int8_takes, qmm_int8_with, qmm_with, quantized_linear, Activations, Isa};
use mlx_rs::{Array, Dtype};

fn int8_selected() {
    std::env::set_var("EMLX_AXON_CPU_ACTIVATIONS", "int8");
    assert_eq!(Activations::selected(), Activations::Int8);
}

#[test]
fn the_primitive_runs_the_selected_variants_int8_product() {
    on_cpu(|| {
        int8_selected();
        for (bits, group) in [(4, 64), (4, 32), (4, 128), (8, 64)] {
            for m in [1usize, 7, 8, 17, 128] {
                for bf16 in [false, true] {
                    let c = case(50 + m as u64, m, 301, 1152, bits, group, bf16);
                    let what = format!("bits={bits} group={group} m={m} bf16={bf16}");
                    // A batched, lazily computed input, [1, m, k], as a model passes.
                    let x =
                        c.x.reshape(&[1, m as i32, 1152])
                            .unwrap()
                            .multiply(Array::from_f32(1.0))
                            .unwrap();
                    let (s, b) = if bf16 {
                        (
                            c.scales.as_dtype(Dtype::Bfloat16).unwrap(),
                            c.biases.as_dtype(Dtype::Bfloat16).unwrap(),
                        )
                    } else {
                        (c.scales.clone(), c.biases.clone())
                    };
                    let y = quantized_linear(&x, &c.w, &s, &b, group, bits)
                        .unwrap()
                        .expect("a CPU float32 product is ours");
                    assert_eq!(y.shape(), &[1, m as i32, 301]);
                    y.eval().unwrap();
                    let ours = y.as_slice::<f32>();

                    let mut direct = vec![0f32; m * 301];
                    let xs = c.x.as_slice::<f32>();
                    let int8 = int8_takes(m, 1152, bits);
                    if !int8 {
                        // The scales are bfloat16 values either way: the
                        // float32 product reads them alike.
                        qmm_with(Isa::selected(), 0, xs, &c.matrix(), &mut direct).unwrap();
                    } else if bf16 {
                        let (s16, b16) = c.bf16_params();
                        let matrix = emlx_axon_kernels::QuantizedMatrix {
                            w: c.w.as_slice::<u32>(),
                            scales: &s16[..],
                            biases: &b16[..],
                            rows: 301,
                            cols: 1152,
                            bits,
                            group_size: group,
                        };
                        qmm_int8_with(Isa::selected(), 0, xs, &matrix, &mut direct).unwrap();
                    } else {
                        qmm_int8_with(Isa::selected(), 0, xs, &c.matrix(), &mut direct).unwrap();
                    }
                    assert!(
                        ours.iter()
                            .zip(&direct)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: the primitive's outputs are not the {} product's",
                        if int8 { "int8" } else { "float32" }
                    );
                    check_against_mlx(&c, ours, &what);
                }
            }
        }
    })
}
