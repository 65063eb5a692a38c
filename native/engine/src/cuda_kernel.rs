//! A CUDA kernel of our own as one node of an MLX graph: MLX's
//! `cuda_kernel`, which compiles the source at first use (NVRTC, cached on
//! disk) and launches it inside MLX's command graph like its own kernels.
//!
//! The source is a kernel body; MLX writes the signature from the input and
//! output names (`const T* name` for inputs, with `name_strides` when the
//! body mentions it, and `T* name` for outputs) and turns template
//! arguments into constants. The grid is given in threads, as MLX's
//! `metal_kernel` takes it; MLX divides it by the block size.

use std::ffi::CString;

use mlx_rs::{Array, Dtype, Stream};

use crate::error::{Error, Result};

pub struct CudaKernel(mlx_sys::mlx_fast_cuda_kernel);

// SAFETY: the kernel object is immutable after creation and MLX builds its
// module under its own lock.
unsafe impl Send for CudaKernel {}
unsafe impl Sync for CudaKernel {}

impl Drop for CudaKernel {
    fn drop(&mut self) {
        // SAFETY: the handle was made by `mlx_fast_cuda_kernel_new` and is
        // freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) };
    }
}

/// A compile-time constant of the kernel.
#[derive(Clone, Copy)]
pub enum Template {
    Dtype(Dtype),
    Int(i32),
    Bool(bool),
}

fn c_string(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid("a kernel string holds a NUL byte"))
}

impl CudaKernel {
    /// `name` must differ for every distinct `source`: MLX caches compiled
    /// modules by name (and template arguments).
    pub fn new(name: &str, inputs: &[&str], outputs: &[&str], source: &str) -> Result<Self> {
        crate::device::install_error_handler();
        let names = |list: &[&str]| list.iter().map(|s| c_string(s)).collect::<Result<Vec<_>>>();
        let (inputs, outputs) = (names(inputs)?, names(outputs)?);
        let (name, source, header) = (c_string(name)?, c_string(source)?, c_string("")?);
        // SAFETY: plain FFI; MLX copies every string before returning.
        unsafe {
            let mut ip: Vec<_> = inputs.iter().map(|s| s.as_ptr()).collect();
            let mut op: Vec<_> = outputs.iter().map(|s| s.as_ptr()).collect();
            let iv = mlx_sys::mlx_vector_string_new_data(ip.as_mut_ptr(), ip.len());
            let ov = mlx_sys::mlx_vector_string_new_data(op.as_mut_ptr(), op.len());
            // Inputs are read through their strides where the source asks
            // for them, so MLX copies nothing.
            let kernel = mlx_sys::mlx_fast_cuda_kernel_new(
                name.as_ptr(),
                iv,
                ov,
                source.as_ptr(),
                header.as_ptr(),
                false,
                0,
            );
            mlx_sys::mlx_vector_string_free(iv);
            mlx_sys::mlx_vector_string_free(ov);
            if kernel.ctx.is_null() {
                return Err(Error::Mlx("MLX could not create a CUDA kernel".into()));
            }
            Ok(CudaKernel(kernel))
        }
    }

    /// The kernel's node over `inputs` on the current stream, with one
    /// output per `(shape, dtype)`; `grid` counts threads.
    pub fn apply(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        grid: (i32, i32, i32),
        threads: (i32, i32, i32),
        templates: &[(&str, Template)],
    ) -> Result<Vec<Array>> {
        let stream = Stream::thread_local_or_default();
        let names = templates
            .iter()
            .map(|(n, _)| c_string(n))
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: FFI on live handles; the output vector is read back before
        // it is freed and each array handle is taken over by an `Array`.
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            let mut status = 0;
            for (shape, dtype) in outputs {
                status |= mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    config,
                    shape.as_ptr(),
                    shape.len(),
                    (*dtype).into(),
                );
            }
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, grid.0, grid.1, grid.2);
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(
                config, threads.0, threads.1, threads.2,
            );
            for (name, (_, value)) in names.iter().zip(templates) {
                let n = name.as_ptr();
                status |= match *value {
                    Template::Dtype(d) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                            config,
                            n,
                            d.into(),
                        )
                    }
                    Template::Int(i) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(config, n, i)
                    }
                    Template::Bool(b) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_bool(config, n, b)
                    }
                };
            }
            let handles: Vec<_> = inputs.iter().map(|a| a.as_ptr()).collect();
            let inputs = mlx_sys::mlx_vector_array_new_data(handles.as_ptr(), handles.len());
            let mut results = mlx_sys::mlx_vector_array_new();
            if status == 0 {
                status = mlx_sys::mlx_fast_cuda_kernel_apply(
                    &mut results,
                    self.0,
                    inputs,
                    config,
                    stream.as_ptr(),
                );
            }
            let mut out = Vec::with_capacity(outputs.len());
            if status == 0 && mlx_sys::mlx_vector_array_size(results) == outputs.len() {
                for i in 0..outputs.len() {
                    let mut a = mlx_sys::mlx_array_new();
                    if mlx_sys::mlx_vector_array_get(&mut a, results, i) == 0 {
                        out.push(Array::from_ptr(a));
                    } else {
                        mlx_sys::mlx_array_free(a);
                    }
                }
            }
            mlx_sys::mlx_vector_array_free(inputs);
            mlx_sys::mlx_vector_array_free(results);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            if out.len() != outputs.len() {
                return Err(Error::Mlx(
                    "a CUDA kernel of ours could not be applied".into(),
                ));
            }
            Ok(out)
        }
    }
}

/// Largest difference between `a` and `b`, in float32 (NaN where either
/// holds one).
pub(crate) fn max_diff(a: &Array, b: &Array) -> Result<f32> {
    let d = a
        .as_dtype(Dtype::Float32)?
        .subtract(&b.as_dtype(Dtype::Float32)?)?
        .abs()?
        .max(None)?;
    d.eval()?;
    Ok(d.as_slice::<f32>()[0])
}

/// A kernel's check against MLX's ops: `got` within `tolerance` of `want`
/// everywhere (NaN fails too).
pub(crate) fn within(what: &str, got: &Array, want: &Array, tolerance: f32) -> Result<()> {
    let worst = max_diff(got, want)?;
    if worst.is_nan() || worst > tolerance {
        return Err(Error::Mlx(format!(
            "the {what} differs from MLX's ops by {worst}"
        )));
    }
    Ok(())
}
