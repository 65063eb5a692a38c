//! MLX devices and streams.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};

use mlx_rs::{Array, Device, Stream};
use once_cell::sync::Lazy;

use crate::error::Result;

extern "C" {
    /// mlx-rs's MLX error handler: it keeps the message for the failing call
    /// to return as an error. mlx-rs installs it lazily, before its own ops.
    fn default_mlx_error_handler(msg: *const std::os::raw::c_char, data: *mut std::ffi::c_void);
}

static PREPARED: std::sync::Once = std::sync::Once::new();

/// Prepares MLX before any raw MLX-C call: installs MLX's error handler
/// (until one is installed, MLX-C's default handler prints the error and
/// calls `exit`, which would end the whole process, for the NIF the BEAM
/// node, on the first failing call) and sizes MLX's CUDA command graphs
/// ([`size_command_graphs`]).
pub fn prepare_mlx() {
    PREPARED.call_once(|| {
        size_command_graphs();
        // SAFETY: registers a handler that only copies the message it gets.
        unsafe {
            mlx_sys::mlx_set_error_handler(
                Some(default_mlx_error_handler),
                std::ptr::null_mut(),
                None,
            )
        };
    });
}

/// Nodes MLX's CUDA backend puts in one command graph before launching it
/// (`MLX_MAX_OPS_PER_BUFFER`; MLX's own default on an H100 or H200 is 100).
/// A one-token step of the fused layers is about 145 nodes (five a layer):
/// as one graph rather than two, MLX queued a step of Qwen3-0.6B's shape in
/// 0.59-0.62 ms instead of 0.79-0.87 on an NVIDIA H200, where a step's pace
/// is set by the host (bench/RESULTS-gpu.md; whole decodes did not separate
/// the two settings, their trials swinging more). Multi-token forwards
/// commit every few layers themselves (see [`crate::model`]), so their
/// graphs stay small. The variable is set from the process's first thread
/// to prepare MLX, before MLX reads it.
const OPS_PER_GRAPH: &str = "300";

/// Sets MLX's graph size for CUDA unless the user chose one. MLX reads it
/// when it makes a stream's command encoder, so this runs before any MLX
/// call; Metal (whose command buffers the same setting sizes) keeps MLX's.
fn size_command_graphs() {
    const KEY: &str = "MLX_MAX_OPS_PER_BUFFER";
    if !cfg!(feature = "metal") && std::env::var_os(KEY).is_none() {
        std::env::set_var(KEY, OPS_PER_GRAPH);
    }
}

static GPU_RUNTIME: std::sync::Once = std::sync::Once::new();

/// Starts MLX's device runtime before the first stream of our own is made
/// on the GPU. MLX's CUDA backend initializes the CUDA runtime when its
/// scheduler starts (so that the runtime is torn down last at exit), but a
/// stream made with `mlx_stream_new_thread_unsafe` first creates the static
/// table of its command encoders and only then touches CUDA. The runtime,
/// started inside, then registers its exit teardown after that table's: at
/// exit it is gone when the table's encoders synchronize their streams,
/// which throws from a destructor and aborts a process that was exiting
/// normally ("cudaStreamSynchronize failed: driver shutting down"). Reading
/// MLX's memory figures creates its allocator, which starts the scheduler
/// (and the CUDA runtime) first. On a CPU-only libmlx it only reads a number.
fn start_gpu_runtime_first() {
    GPU_RUNTIME.call_once(|| {
        let mut bytes = 0usize;
        // SAFETY: the getter writes the one usize it is given.
        unsafe { mlx_sys::mlx_get_active_memory(&mut bytes) };
    });
}

/// Makes every one of `arrays` (evaluated first if need be) readable from
/// the host in place, now, on the calling thread. For a model's weights,
/// before the model is shared between threads.
///
/// MLX's CUDA backend keeps what a GPU kernel computed in device memory and
/// moves a buffer to unified memory the first time anything reads it from
/// the host: a CPU stream's op, or our own CPU kernels. That move replaces
/// the buffer's pointer and frees the device copy without any lock. For an
/// array shared between threads, such as a model weight computed at load
/// (a cast, a quantization, a stacked projection), two CPU streams reading
/// it at once both copy it and both free the same device memory, and a GPU
/// stream can queue a kernel on the pointer being freed: wrong tokens,
/// crashes, and illegal memory accesses later in unrelated work. Moved once
/// here, before any sharing, such a buffer stays put (a move of a buffer
/// already in unified memory does nothing), and GPU kernels read unified
/// memory as they read the checkpoint's own tensors, which MLX places there
/// when it copies them in. On the CPU every buffer is host memory already.
pub fn share_with_host(arrays: &[&Array]) -> Result<()> {
    prepare_mlx();
    mlx_rs::transforms::eval(arrays.iter().copied())?;
    for array in arrays {
        // SAFETY: `array` is evaluated, so it has a buffer; asking for its
        // data pointer is what moves the buffer, and nothing reads it here.
        let data = unsafe { mlx_sys::mlx_array_data_uint8(array.as_ptr()) };
        if data.is_null() && array.size() > 0 {
            return Err(crate::error::Error::Mlx(
                "MLX could not make a weight readable from the host".into(),
            ));
        }
    }
    Ok(())
}

/// Runs `f` with MLX's CPU stream as the default: for the small arrays a
/// model derives at load (norm weights side by side, scales in the compute
/// dtype), which on a GPU stream would each be a kernel reading unified
/// memory, with its first-use cost, inside the load.
pub fn on_host<T>(f: impl FnOnce() -> T) -> T {
    mlx_rs::with_stream(&mlx_rs::Stream::cpu(), f)
}

/// Whether libmlx was built with a GPU backend (CUDA or Metal) and has a device.
pub fn gpu_available() -> bool {
    prepare_mlx();
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

/// CPU streams made at once, before any of them runs work. MLX (0.32)
/// keeps the CPU streams usable from any thread in one map that evaluation
/// reads without a lock (`mlx/backend/cpu/encoder.cpp`); adding one while
/// another thread evaluates on another can make that evaluation fail with
/// "There is no Stream(cpu, N) in current thread" (seen in about 1 run in
/// 40 of a test with 4 threads starting generations together). The engine
/// uses at most the pool's streams and a few of its own.
const CPU_STREAM_RESERVE: usize = 2 * MAX_STREAMS_PER_DEVICE + 8;

static CPU_RESERVE: Lazy<Mutex<Option<Vec<MlxStream>>>> = Lazy::new(|| Mutex::new(None));

impl MlxStream {
    pub fn new(kind: DeviceKind) -> Result<Self> {
        if kind == DeviceKind::Gpu {
            return Self::make(kind);
        }
        let mut reserve = CPU_RESERVE.lock().unwrap_or_else(|p| p.into_inner());
        if reserve.is_none() {
            let made = (0..CPU_STREAM_RESERVE)
                .map(|_| Self::make(kind))
                .collect::<Result<Vec<_>>>()?;
            *reserve = Some(made);
        }
        match reserve.as_mut().and_then(Vec::pop) {
            Some(stream) => Ok(stream),
            // Past the reserve (not reached by the engine's own use).
            None => Self::make(kind),
        }
    }

    fn make(kind: DeviceKind) -> Result<Self> {
        prepare_mlx();
        if kind == DeviceKind::Gpu {
            start_gpu_runtime_first();
        }
        let device_type = match kind {
            DeviceKind::Cpu => mlx_sys::mlx_device_type__MLX_CPU,
            DeviceKind::Gpu => mlx_sys::mlx_device_type__MLX_GPU,
        };
        // SAFETY: plain FFI on handles we own. A failed creation reports
        // through MLX's error handler and leaves `fresh` empty, which
        // `mlx_stream_get_index` then refuses.
        let fresh = unsafe {
            let device = mlx_sys::mlx_device_new_type(device_type, 0);
            let fresh = mlx_sys::mlx_stream_new_thread_unsafe(device);
            mlx_sys::mlx_device_free(device);
            let mut index = -1;
            if mlx_sys::mlx_stream_get_index(&mut index, fresh) != 0 {
                mlx_sys::mlx_stream_free(fresh);
                return Err(match kind {
                    DeviceKind::Gpu if !gpu_available() => crate::error::Error::invalid(
                        "no GPU device: this libmlx was built for CPU only",
                    ),
                    _ => crate::error::Error::Mlx("could not create a stream".into()),
                });
            }
            fresh
        };
        // mlx-rs cannot wrap a raw stream, so point a fresh handle's shared
        // state at the new stream.
        let stream = Stream::new_with_device(&kind.device());
        // SAFETY: `raw` shares `stream`'s state; `fresh` is ours to free.
        unsafe {
            let mut raw = stream.as_ptr();
            let status = mlx_sys::mlx_stream_set(&mut raw, fresh);
            mlx_sys::mlx_stream_free(fresh);
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

    /// Runs `f` on `stream` when there is one (see [`run`](Self::run)),
    /// else on the calling thread's default stream.
    pub fn run_on<T>(stream: Option<&MlxStream>, f: impl FnOnce() -> T) -> T {
        match stream {
            Some(s) => s.run(f),
            None => f(),
        }
    }

    /// Runs `f` on this stream without the gate, for a caller that holds it
    /// exclusively (a worker lease).
    pub(crate) fn run_leased<T>(&self, f: impl FnOnce() -> T) -> T {
        mlx_rs::with_stream(&self.stream, f)
    }
}

/// At most this many MLX streams of each use (see `Use`) exist per device.
/// MLX never destroys a stream (and each CPU stream owns a scheduler
/// thread), so streams are pooled and a released one is handed out again.
pub const MAX_STREAMS_PER_DEVICE: usize = 32;

/// What a pooled stream is for; the two never mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// A caller's stream (`EMLXAxon.Stream`): all of a generation's work on
    /// it, evaluation included, runs inside `MlxStream::run`, so past the
    /// bound holders can share one.
    Caller,
    /// A worker stream for split projections: its graph is evaluated from
    /// the generation's own stream, outside this stream's gate, so it is
    /// never shared.
    Worker,
}

struct Pooled {
    stream: MlxStream,
    holders: usize,
    usage: Use,
}

static POOL: Lazy<Mutex<Vec<Pooled>>> = Lazy::new(|| Mutex::new(Vec::new()));

fn pool() -> std::sync::MutexGuard<'static, Vec<Pooled>> {
    POOL.lock().unwrap_or_else(|p| p.into_inner())
}

/// How many MLX streams of `kind` the pool has made, held or idle.
pub fn pooled_streams(kind: DeviceKind) -> usize {
    pool().iter().filter(|p| p.stream.kind == kind).count()
}

/// A stream from the pool, held until dropped.
pub struct Lease(MlxStream);

impl Lease {
    /// A caller's stream: an idle one if any, else a new one, else (at
    /// `MAX_STREAMS_PER_DEVICE`) the least-held one, shared.
    pub fn new(kind: DeviceKind) -> Result<Self> {
        Self::take(kind, Use::Caller).map(|lease| lease.expect("caller streams are shared"))
    }

    /// A worker stream held alone: an idle one if any, else a new one, else
    /// (at `MAX_STREAMS_PER_DEVICE`) none.
    pub fn worker(kind: DeviceKind) -> Result<Option<Self>> {
        Self::take(kind, Use::Worker)
    }

    /// `count` worker streams, or none when the pool cannot spare them all
    /// (a projection split needs one per part; without, it runs whole).
    pub fn workers(kind: DeviceKind, count: usize) -> Result<Vec<Self>> {
        Ok((0..count)
            .map(|_| Self::worker(kind))
            .collect::<Result<Option<Vec<_>>>>()?
            .unwrap_or_default())
    }

    fn take(kind: DeviceKind, usage: Use) -> Result<Option<Self>> {
        let mut pool = pool();
        let mine =
            || (0..pool.len()).filter(|&i| pool[i].stream.kind == kind && pool[i].usage == usage);
        let made = mine().count();
        let least_held = mine().min_by_key(|&i| pool[i].holders);
        let index = match least_held {
            Some(i) if pool[i].holders == 0 => i,
            Some(i) if made >= MAX_STREAMS_PER_DEVICE && usage == Use::Caller => i,
            _ if made >= MAX_STREAMS_PER_DEVICE => return Ok(None),
            _ => {
                pool.push(Pooled {
                    stream: MlxStream::new(kind)?,
                    holders: 0,
                    usage,
                });
                pool.len() - 1
            }
        };
        pool[index].holders += 1;
        Ok(Some(Lease(pool[index].stream.clone())))
    }

    pub fn stream(&self) -> &MlxStream {
        &self.0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut pool = pool();
        if let Some(p) = pool
            .iter_mut()
            .find(|p| Arc::ptr_eq(&p.stream.gate, &self.0.gate))
        {
            p.holders = p.holders.saturating_sub(1);
        }
    }
}

/// MLX's CUDA backend compiles a kernel (NVRTC) on the thread that first
/// evaluates it. Compiling the CUTLASS-based ones takes more stack than a
/// BEAM dirty scheduler thread has (320 KiB by default), and overflowing it
/// kills the VM. `on_large_stack` runs work on a companion of the calling
/// thread with this much stack (reserved, not committed).
pub const LARGE_STACK_BYTES: usize = 64 << 20;

type Job = Box<dyn FnOnce() + Send + 'static>;

thread_local! {
    /// The calling thread's companion; it ends when the caller does.
    static COMPANION: std::cell::RefCell<Option<mpsc::Sender<Job>>> =
        const { std::cell::RefCell::new(None) };
    static IS_COMPANION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// On a pooled `job_thread`: the way to send it another job.
    static POOLED_SELF: std::cell::RefCell<Option<mpsc::Sender<Job>>> =
        const { std::cell::RefCell::new(None) };
}

fn spawn_companion() -> Option<mpsc::Sender<Job>> {
    job_thread("emlx-axon-mlx", false)
}

/// A thread with `LARGE_STACK_BYTES` of stack that runs the jobs sent to
/// it (and `on_large_stack`'s in place). `pooled`: it holds a sender to
/// itself, so it never ends, and each job of `on_pooled_thread` offers it
/// in `IDLE_THREADS` again; otherwise it ends with its last sender.
fn job_thread(name: &str, pooled: bool) -> Option<mpsc::Sender<Job>> {
    let (tx, jobs) = mpsc::channel::<Job>();
    let again = pooled.then(|| tx.clone());
    std::thread::Builder::new()
        .name(name.into())
        .stack_size(LARGE_STACK_BYTES)
        .spawn(move || {
            IS_COMPANION.with(|c| c.set(true));
            POOLED_SELF.with(|s| *s.borrow_mut() = again);
            for job in jobs {
                job();
            }
        })
        .ok()?;
    Some(tx)
}

/// Offers the pooled thread this runs on for the next job, before the
/// current one hands back its result: whoever receives that result and
/// starts more pooled work at once finds this thread idle, not a new one.
fn offer_this_thread() {
    POOLED_SELF.with(|s| {
        if let Some(again) = s.borrow().as_ref() {
            IDLE_THREADS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(again.clone());
        }
    });
}

/// Threads that ran a job of `on_pooled_thread` and wait for another.
static IDLE_THREADS: Lazy<Mutex<Vec<mpsc::Sender<Job>>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// Runs `f` on a `job_thread`, reusing one an earlier job left: MLX gives each thread that evaluates a default stream of its own
/// (on the CPU, with a thread behind it) and frees neither, so long-lived
/// work started again and again (a scheduler restarted) must not make new
/// threads each time. The receiver gets `f`'s result.
pub fn on_pooled_thread<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> crate::error::Result<mpsc::Receiver<std::thread::Result<T>>> {
    let (done, result) = mpsc::sync_channel(1);
    let mut job: Job = Box::new(move || {
        let outcome = catch_unwind(AssertUnwindSafe(f));
        offer_this_thread();
        let _ = done.send(outcome);
    });
    let idle = || IDLE_THREADS.lock().unwrap_or_else(|p| p.into_inner()).pop();
    while let Some(thread) = idle() {
        match thread.send(job) {
            Ok(()) => return Ok(result),
            Err(refused) => job = refused.0,
        }
    }
    let thread = job_thread("emlx-axon-pooled", true)
        .ok_or_else(|| crate::error::Error::Unsupported("could not start a thread".into()))?;
    thread
        .send(job)
        .map_err(|_| crate::error::Error::Unsupported("a new thread refused its job".into()))?;
    Ok(result)
}

/// Runs `f` on a thread with `LARGE_STACK_BYTES` of stack and returns its
/// result; a panic in `f` resumes on the caller. Each calling thread has its
/// own companion, so work that relies on a thread's default MLX stream keeps
/// one thread per caller.
pub fn on_large_stack<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if IS_COMPANION.with(|c| c.get()) {
        return f();
    }
    let (reply, result) = mpsc::sync_channel::<std::thread::Result<T>>(1);
    let job: Box<dyn FnOnce() + Send + '_> = Box::new(move || {
        let _ = reply.send(catch_unwind(AssertUnwindSafe(f)));
    });
    // SAFETY: this function does not return before the job has run or been
    // dropped (the reply channel disconnects only then), so whatever `f`
    // borrows outlives its use on the companion.
    let job: Job = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + '_>, Job>(job) };
    let sent = COMPANION.with(|slot| {
        let mut slot = slot.borrow_mut();
        if slot.is_none() {
            *slot = spawn_companion();
        }
        match slot.as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        }
    });
    if let Err(job) = sent {
        // No thread could be made: run here rather than fail.
        job();
    }
    match result.recv() {
        Ok(Ok(value)) => value,
        Ok(Err(panic)) => resume_unwind(panic),
        Err(_) => panic!("the MLX companion thread dropped a job"),
    }
}

/// How many CPU worker streams a projection is split across:
/// `EMLX_AXON_CPU_THREADS`, else the number of cores (1 turns splitting off).
pub fn cpu_parallelism() -> usize {
    crate::switches::cpu_threads()
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, 16)
}

pub fn mlx_version() -> String {
    prepare_mlx();
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

/// Whether the calling thread's default stream (the one a forward pass's ops
/// go to) runs on the CPU.
pub fn on_cpu_stream() -> bool {
    let stream = mlx_rs::Stream::thread_local_or_default();
    // SAFETY: a handle query on a live stream; the device handle is freed here.
    unsafe {
        let mut device = mlx_sys::mlx_device_new();
        let mut kind = mlx_sys::mlx_device_type__MLX_CPU;
        let ok = mlx_sys::mlx_stream_get_device(&mut device, stream.as_ptr()) == 0
            && mlx_sys::mlx_device_get_type(&mut kind, device) == 0;
        mlx_sys::mlx_device_free(device);
        ok && kind == mlx_sys::mlx_device_type__MLX_CPU
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;

    /// Uses about `depth` * 64 KiB of stack.
    fn deep(depth: usize) -> u64 {
        let frame = std::hint::black_box([depth as u8; 64 << 10]);
        if depth == 0 {
            frame[0] as u64
        } else {
            frame[1] as u64 + deep(depth - 1)
        }
    }

    #[test]
    fn work_on_a_small_stack_thread_gets_a_large_stack() {
        // A BEAM dirty scheduler thread's default stack: 40 kilowords.
        let small = 320 << 10;
        let value = std::thread::Builder::new()
            .stack_size(small)
            .spawn(|| on_large_stack(|| deep(64)))
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(value, (1..=64).sum::<u64>());
    }

    #[test]
    fn large_stack_work_borrows_nests_and_panics_like_a_call() {
        let mut seen = vec![1, 2];
        let sum = on_large_stack(|| {
            seen.push(3);
            on_large_stack(|| seen.iter().sum::<i32>())
        });
        assert_eq!(sum, 6);
        assert_eq!(seen, [1, 2, 3]);
        let panic = std::panic::catch_unwind(|| on_large_stack(|| panic!("inside"))).unwrap_err();
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"inside"));
        // The companion survives a panic.
        assert_eq!(on_large_stack(|| 7), 7);
    }

    #[test]
    fn the_stream_pool_is_bounded_and_reuses_released_streams() {
        let callers: Vec<Lease> = (0..MAX_STREAMS_PER_DEVICE + 8)
            .map(|_| Lease::new(DeviceKind::Cpu).unwrap())
            .collect();
        // Past the bound, callers share streams; every one still runs work.
        for lease in &callers {
            let x = lease.stream().run(|| mlx_rs::Array::from_int(2) * 3);
            assert_eq!(x.item_exact::<i32>(), 6);
        }
        // Workers never share: past the bound there is none to be had.
        let workers: Vec<Lease> = (0..MAX_STREAMS_PER_DEVICE + 8)
            .map_while(|_| Lease::worker(DeviceKind::Cpu).unwrap())
            .collect();
        assert_eq!(workers.len(), MAX_STREAMS_PER_DEVICE);
        let made = pooled_streams(DeviceKind::Cpu);
        assert_eq!(made, 2 * MAX_STREAMS_PER_DEVICE);
        // Released streams are handed out again, of either use.
        drop(workers);
        drop(callers);
        let again: Vec<Lease> = (0..4)
            .map(|_| Lease::new(DeviceKind::Cpu).unwrap())
            .collect();
        let worker = Lease::worker(DeviceKind::Cpu)
            .unwrap()
            .expect("an idle worker");
        assert_eq!(pooled_streams(DeviceKind::Cpu), made);
        drop((again, worker));
    }

    #[test]
    fn shared_arrays_keep_their_values_and_are_evaluated() {
        let lease = Lease::new(DeviceKind::default_kind()).unwrap();
        lease.stream().run(|| {
            let base = mlx_rs::Array::from_slice(&[1.5f32, -2.0, 3.25, 4.0], &[2, 2]);
            // Lazily computed, and a view of a computed buffer.
            let doubled = base.multiply(mlx_rs::Array::from_f32(2.0)).unwrap();
            let row = doubled.index((1..2, ..));
            let empty = mlx_rs::Array::from_slice::<f32>(&[], &[0]);
            share_with_host(&[&doubled, &row, &base, &empty]).unwrap();
            // Twice is harmless: a buffer already readable stays put.
            share_with_host(&[&doubled, &row]).unwrap();
            assert_eq!(doubled.as_slice::<f32>(), &[3.0, -4.0, 6.5, 8.0]);
            assert_eq!(row.as_slice::<f32>(), &[6.5, 8.0]);
            assert_eq!(base.as_slice::<f32>(), &[1.5, -2.0, 3.25, 4.0]);
        });
    }

    #[test]
    fn a_failing_raw_stream_creation_is_an_error() {
        if gpu_available() {
            return;
        }
        let err = MlxStream::new(DeviceKind::Gpu).err().expect("no GPU here");
        assert_eq!(err.kind(), "invalid_argument");
    }
}
