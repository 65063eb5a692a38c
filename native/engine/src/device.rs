//! MLX devices and streams.

use std::sync::{Arc, Mutex};

use mlx_rs::{Device, Stream};
use once_cell::sync::Lazy;

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

/// An MLX stream usable from any thread. MLX streams are otherwise bound to
/// the thread that made them, while BEAM dirty schedulers and test threads
/// hop between threads. MLX does not synchronize such streams, so every
/// submission takes the stream's gate (`run`); work queued on one keeps
/// running after the gate is released.
#[derive(Clone)]
pub struct MlxStream {
    stream: Stream,
    gate: Arc<Mutex<()>>,
    pub kind: DeviceKind,
}

// SAFETY: the handle is an immutable (device, index) pair registered globally
// by MLX, and submissions to it are serialized by `gate`.
unsafe impl Send for MlxStream {}
unsafe impl Sync for MlxStream {}

impl MlxStream {
    pub fn new(kind: DeviceKind) -> Result<Self> {
        if kind == DeviceKind::Gpu && !gpu_available() {
            return Err(crate::error::Error::invalid(
                "no GPU device: this libmlx was built for CPU only",
            ));
        }
        let device_type = match kind {
            DeviceKind::Cpu => mlx_sys::mlx_device_type__MLX_CPU,
            DeviceKind::Gpu => mlx_sys::mlx_device_type__MLX_GPU,
        };
        // mlx-rs cannot wrap a raw stream, so point a fresh handle's shared
        // state at the new stream.
        let stream = Stream::new_with_device(&kind.device());
        // SAFETY: plain FFI on handles we own; `raw` shares `stream`'s state.
        unsafe {
            let device = mlx_sys::mlx_device_new_type(device_type, 0);
            let fresh = mlx_sys::mlx_stream_new_thread_unsafe(device);
            let mut raw = stream.as_ptr();
            let status = mlx_sys::mlx_stream_set(&mut raw, fresh);
            mlx_sys::mlx_stream_free(fresh);
            mlx_sys::mlx_device_free(device);
            if status != 0 {
                return Err(crate::error::Error::Mlx("could not create a stream".into()));
            }
        }
        Ok(MlxStream {
            stream,
            gate: Arc::new(Mutex::new(())),
            kind,
        })
    }

    pub fn index(&self) -> i32 {
        self.stream.get_index().unwrap_or(-1)
    }

    /// Runs `f` with this stream as the default for MLX ops, holding the gate.
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        let _gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        mlx_rs::with_stream(&self.stream, f)
    }

    /// Runs `f` on this stream without the gate, for a caller that holds it
    /// exclusively (a leased worker).
    pub(crate) fn run_leased<T>(&self, f: impl FnOnce() -> T) -> T {
        mlx_rs::with_stream(&self.stream, f)
    }
}

/// Streams are never destroyed by MLX (each CPU stream owns a thread), so
/// generations lease them from this pool and give them back when dropped.
static POOL: Lazy<Mutex<Vec<MlxStream>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// A stream held exclusively until dropped.
pub struct Lease(Option<MlxStream>);

impl Lease {
    pub fn new(kind: DeviceKind) -> Result<Self> {
        let pooled = {
            let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
            pool.iter()
                .position(|s| s.kind == kind)
                .map(|i| pool.swap_remove(i))
        };
        Ok(Lease(Some(match pooled {
            Some(s) => s,
            None => MlxStream::new(kind)?,
        })))
    }

    pub fn stream(&self) -> &MlxStream {
        self.0
            .as_ref()
            .expect("a lease holds its stream until dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            POOL.lock().unwrap_or_else(|p| p.into_inner()).push(s);
        }
    }
}

/// How many CPU worker streams a projection is split across:
/// `EMLX_AXON_CPU_THREADS`, else the number of cores (1 turns splitting off).
pub fn cpu_parallelism() -> usize {
    std::env::var("EMLX_AXON_CPU_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, 16)
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
