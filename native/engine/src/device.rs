//! MLX devices and streams.

use mlx_rs::{Device, Stream};

use crate::error::Result;

/// Whether libmlx was built with a GPU backend (CUDA or Metal) and has a device.
pub fn gpu_available() -> bool {
    let mut available = false;
    // SAFETY: plain FFI calls on a device handle we create and free here.
    unsafe {
        let gpu = mlx_sys::mlx_device_new_type(mlx_sys::mlx_device_type__MLX_GPU, 0);
        let status = mlx_sys::mlx_device_is_available(&mut available, gpu);
        mlx_sys::mlx_device_free(gpu);
        status == 0 && available
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

impl DeviceKind {
    pub fn default_kind() -> Self {
        if gpu_available() {
            DeviceKind::Gpu
        } else {
            DeviceKind::Cpu
        }
    }

    fn device(self) -> Device {
        match self {
            DeviceKind::Cpu => Device::cpu(),
            DeviceKind::Gpu => Device::gpu(),
        }
    }
}

/// An MLX stream of its own: work submitted to different streams is
/// scheduled independently while sharing the same weights.
#[derive(Clone)]
pub struct MlxStream {
    stream: Stream,
    pub kind: DeviceKind,
}

// SAFETY: an mlx_stream is an immutable (device, index) pair; MLX schedules
// work submitted to it from any thread.
unsafe impl Send for MlxStream {}
unsafe impl Sync for MlxStream {}

impl MlxStream {
    pub fn new(kind: DeviceKind) -> Result<Self> {
        if kind == DeviceKind::Gpu && !gpu_available() {
            return Err(crate::error::Error::invalid(
                "no GPU device: this libmlx was built for CPU only",
            ));
        }
        Ok(MlxStream {
            stream: Stream::new_with_device(&kind.device()),
            kind,
        })
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    pub fn index(&self) -> i32 {
        self.stream.get_index().unwrap_or(-1)
    }
}

pub fn mlx_version() -> String {
    let mut s = unsafe { mlx_sys::mlx_string_new() };
    // SAFETY: mlx_version fills the string, which we copy then free.
    unsafe {
        mlx_sys::mlx_version(&mut s);
        let text = std::ffi::CStr::from_ptr(mlx_sys::mlx_string_data(s))
            .to_string_lossy()
            .into_owned();
        mlx_sys::mlx_string_free(s);
        text
    }
}
