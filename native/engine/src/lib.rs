pub fn smoke() -> Result<Vec<f32>, mlx_rs::error::Exception> {
    let a = mlx_rs::Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
    let b = mlx_rs::ops::matmul(&a, &a)?;
    b.eval()?;
    Ok(b.as_slice::<f32>().to_vec())
}
#[test]
fn t() { println!("{:?}", smoke()); }
