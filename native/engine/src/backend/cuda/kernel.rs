//! A CUDA kernel of our own as one node of an MLX graph.
//!
//! The source is a kernel body. At first use with given input dtypes, ranks
//! and template arguments, the whole kernel is written out (a signature of
//! `const T* name` per input and `T* __restrict__ name` per output;
//! `name_shape` and `name_strides` arrays where the body mentions them;
//! template arguments as constants), compiled with NVRTC to a binary for
//! this device and kept on disk, then launched through MLX's
//! `precompiled_cuda_kernel`, inside MLX's command graph like its own
//! kernels. MLX's own `cuda_kernel` would
//! recompile every variant in every process (about a second each: MLX skips
//! its disk cache for custom kernels and prepends its device headers), so
//! the source here includes nothing and says its half types itself.
//! The grid is given in threads, as MLX's `metal_kernel` takes it; MLX
//! divides it by the block size.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use mlx_rs::{Array, Dtype, Stream};
use once_cell::sync::OnceCell;

use crate::error::{Error, Result};

/// A compile-time constant of the kernel.
#[derive(Clone, Copy)]
pub enum Template {
    Dtype(Dtype),
    Int(i32),
    Bool(bool),
}

pub struct CudaKernel {
    name: String,
    inputs: Vec<String>,
    outputs: Vec<String>,
    body: String,
    /// Per input: whether the body reads `name_shape`, `name_strides`.
    reads: Vec<(bool, bool)>,
    /// `__launch_bounds__` of its variants, if any.
    bounds: Option<Bounds>,
    /// Compiled variants by their signature and constants.
    compiled: Mutex<HashMap<Vec<i32>, Arc<Compiled>>>,
}

/// A compiled variant: as MLX launches it (the binary and its symbol), the
/// binary, and its blocks per multiprocessor by block size, once asked.
pub(crate) struct Compiled {
    handle: *mut c_void,
    name: String,
    /// Names this binary and no other.
    token: String,
    binary: Vec<u8>,
    resident: Mutex<Vec<(i32, Option<i32>)>>,
}

// SAFETY: the object is immutable after creation; MLX copies what it needs
// from it into each node.
unsafe impl Send for Compiled {}
unsafe impl Sync for Compiled {}

impl Compiled {
    /// The kernel `name` from `binary`; `token` names this binary and no
    /// other (MLX is launched with it where it can, see the glue).
    fn new(name: &str, token: &str, binary: Vec<u8>) -> Result<Self> {
        let (c_name, c_token) = (c_string(name)?, c_string(token)?);
        // SAFETY: the shim copies the strings and the binary.
        let handle = unsafe {
            mlx_sys::emlx_cuda_kernel_new(
                c_name.as_ptr(),
                c_token.as_ptr(),
                binary.as_ptr().cast(),
                binary.len(),
            )
        };
        if handle.is_null() {
            return Err(Error::Mlx("could not hold a compiled CUDA kernel".into()));
        }
        Ok(Compiled {
            handle,
            name: name.to_string(),
            token: token.to_string(),
            binary,
            resident: Mutex::new(Vec::new()),
        })
    }

    /// The kernel's symbol.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// A name of this binary and no other.
    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    /// The cubin.
    pub(crate) fn binary(&self) -> &[u8] {
        &self.binary
    }

    /// Blocks of `threads` threads that one multiprocessor holds at once,
    /// as the driver tells (`None` where it cannot).
    fn resident(&self, threads: i32) -> Result<Option<i32>> {
        let mut known = self.resident.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, blocks)) = known.iter().find(|(t, _)| *t == threads) {
            return Ok(*blocks);
        }
        let name = c_string(&self.name)?;
        let mut blocks = 0;
        // SAFETY: the binary outlives the call; the shim writes one int.
        let status = unsafe {
            mlx_sys::emlx_cuda_occupancy(
                self.binary.as_ptr().cast(),
                name.as_ptr(),
                threads,
                &mut blocks,
            )
        };
        let blocks = (status == 0 && blocks > 0).then_some(blocks);
        known.push((threads, blocks));
        Ok(blocks)
    }
}

impl Drop for Compiled {
    fn drop(&mut self) {
        // SAFETY: made by `emlx_cuda_kernel_new`, freed once.
        unsafe { mlx_sys::emlx_cuda_kernel_free(self.handle) };
    }
}

fn c_string(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid("a kernel string holds a NUL byte"))
}

/// Half types by their bits, with the conversions MLX's CUDA types make
/// (float to bfloat16 rounds to nearest even, NaN stays NaN), and the
/// integer names the bodies use.
const PRELUDE: &str = include_str!("cu/prelude.cu");

fn c_type(d: Dtype) -> Result<&'static str> {
    Ok(match d {
        Dtype::Float32 => "float",
        Dtype::Bfloat16 => "emlx_bf16",
        Dtype::Float16 => "emlx_f16",
        Dtype::Int32 => "int",
        Dtype::Uint32 => "uint32_t",
        Dtype::Int64 => "long long",
        Dtype::Uint64 => "unsigned long long",
        Dtype::Int16 => "short",
        Dtype::Uint16 => "unsigned short",
        Dtype::Int8 => "signed char",
        Dtype::Uint8 => "unsigned char",
        Dtype::Bool => "bool",
        other => return Err(Error::invalid(format!("no CUDA kernel type for {other:?}"))),
    })
}

/// A kernel's `__launch_bounds__`.
#[derive(Clone, Copy, Debug)]
enum Bounds {
    /// Blocks of at most this many threads, registers left for this many
    /// blocks a multiprocessor.
    Blocks(i32, i32),
    /// Blocks of the variant's `BLOCK` threads, registers left for this
    /// many threads a multiprocessor.
    Threads(i32),
}

impl CudaKernel {
    /// `name` is the kernel's symbol and names its cached binaries.
    pub fn new(name: &str, inputs: &[&str], outputs: &[&str], body: &str) -> Result<Self> {
        crate::runtime::device::prepare_mlx();
        let reads = inputs
            .iter()
            .map(|n| {
                (
                    body.contains(&format!("{n}_shape")),
                    body.contains(&format!("{n}_strides")),
                )
            })
            .collect();
        Ok(CudaKernel {
            name: name.into(),
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            outputs: outputs.iter().map(|s| s.to_string()).collect(),
            body: body.into(),
            reads,
            bounds: None,
            compiled: Mutex::new(HashMap::new()),
        })
    }

    /// Compiled for blocks of at most `threads` threads, with registers left
    /// for `blocks` of them on a multiprocessor.
    pub fn bounded(mut self, threads: i32, blocks: i32) -> Self {
        self.bounds = Some(Bounds::Blocks(threads, blocks));
        self
    }

    /// Compiled for blocks of the variant's `BLOCK` threads (a constant),
    /// with registers left for `threads` threads a multiprocessor.
    pub fn bounded_per_multiprocessor(mut self, threads: i32) -> Self {
        self.bounds = Some(Bounds::Threads(threads));
        self
    }

    /// The whole kernel for these inputs, output dtypes and constants.
    pub(crate) fn source(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        templates: &[(&str, Template)],
    ) -> Result<String> {
        // MLX passes the inputs' pointers, the outputs', then the scalars.
        let mut pointers = Vec::new();
        let mut sizes = Vec::new();
        let mut locals = String::new();
        for ((name, a), (shape, strides)) in self.inputs.iter().zip(inputs).zip(&self.reads) {
            pointers.push(format!("const {}* {name}", c_type(a.dtype())?));
            let rank = a.ndim();
            let mut array = |kind: &str, ty: &str| {
                let values: Vec<String> = (0..rank).map(|i| format!("{name}_{kind}{i}")).collect();
                sizes.extend(values.iter().map(|v| format!("int {v}")));
                let _ = writeln!(
                    locals,
                    "  const {ty} {name}_{kind}[{}] = {{{}}};",
                    rank.max(1),
                    values.join(", ")
                );
            };
            if *shape {
                array("shape", "int");
            }
            if *strides {
                array("strides", "long long");
            }
        }
        for (name, (_, dtype)) in self.outputs.iter().zip(outputs) {
            // Fresh buffers: no input aliases them, so reads may move past
            // their writes.
            pointers.push(format!("{}* __restrict__ {name}", c_type(*dtype)?));
        }
        let params = [pointers, sizes].concat();
        let mut constants = String::new();
        for (name, value) in templates {
            let _ = match value {
                Template::Dtype(d) => writeln!(constants, "  using {name} = {};", c_type(*d)?),
                Template::Int(i) => writeln!(constants, "  constexpr int {name} = {i};"),
                Template::Bool(b) => writeln!(constants, "  constexpr bool {name} = {b};"),
            };
        }
        let block = templates
            .iter()
            .find_map(|(name, value)| match (name, value) {
                (&"BLOCK", Template::Int(b)) => Some(*b),
                _ => None,
            });
        let bounds = match (self.bounds, block) {
            (Some(Bounds::Blocks(t, b)), _) => format!("__launch_bounds__({t}, {b}) "),
            (Some(Bounds::Threads(n)), Some(t)) => {
                format!("__launch_bounds__({t}, {}) ", (n / t).max(1))
            }
            (Some(Bounds::Threads(_)), None) => {
                return Err(Error::invalid(format!(
                    "{} takes a BLOCK constant",
                    self.name
                )))
            }
            (None, _) => String::new(),
        };
        Ok(format!(
            "{PRELUDE}\nextern \"C\" __global__ void {bounds}{}(\n    {}) {{\n{constants}{locals}{}\n}}\n",
            self.name,
            params.join(",\n    "),
            self.body
        ))
    }

    fn compiled(
        &self,
        key: Vec<i32>,
        source: impl FnOnce() -> Result<String>,
    ) -> Result<Arc<Compiled>> {
        let mut map = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = map.get(&key) {
            return Ok(c.clone());
        }
        let (binary, id) = binary(&self.name, &source()?)?;
        let c = Arc::new(Compiled::new(&self.name, &format!("emlx:{id}"), binary)?);
        map.insert(key, c.clone());
        Ok(c)
    }

    /// Blocks of `threads` threads of the variant for these inputs, outputs
    /// and constants that one multiprocessor holds at once (compiled now if
    /// it is not yet), for grids of one wave; `None` where the driver
    /// cannot tell.
    pub fn resident_blocks(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        templates: &[(&str, Template)],
        threads: i32,
    ) -> Result<Option<i32>> {
        let key = variant(inputs, outputs, templates);
        let kernel = self.compiled(key, || self.source(inputs, outputs, templates))?;
        kernel.resident(threads)
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
        if inputs.len() != self.inputs.len() || outputs.len() != self.outputs.len() {
            return Err(Error::invalid(format!(
                "the {} kernel takes {} inputs and {} outputs",
                self.name,
                self.inputs.len(),
                self.outputs.len()
            )));
        }
        let key = variant(inputs, outputs, templates);
        let kernel = self.compiled(key, || self.source(inputs, outputs, templates))?;
        let mut scalars = Vec::new();
        for (a, (shape, strides)) in inputs.iter().zip(&self.reads) {
            if *shape {
                scalars.extend_from_slice(a.shape());
            }
            if *strides {
                for s in a.strides() {
                    scalars.push(i32::try_from(*s).map_err(|_| {
                        Error::invalid(format!(
                            "a stride of the {} kernel's input is too large",
                            self.name
                        ))
                    })?);
                }
            }
        }
        let out = launch(&kernel, inputs, outputs, &scalars, grid, threads)?;
        note_launch(&kernel, inputs, &out, &scalars, grid, threads);
        Ok(out)
    }
}

/// What makes a variant, cheaply (it is looked up at every launch): every
/// type and rank in the signature and every constant by name. Names are
/// their bytes (all positive), each value after a negative tag.
fn variant(
    inputs: &[&Array],
    outputs: &[(&[i32], Dtype)],
    templates: &[(&str, Template)],
) -> Vec<i32> {
    let mut key = Vec::with_capacity(2 * inputs.len() + outputs.len() + 8 * templates.len());
    key.extend(
        inputs
            .iter()
            .flat_map(|a| [a.dtype() as i32, a.ndim() as i32]),
    );
    key.extend(outputs.iter().map(|(_, d)| *d as i32));
    for (name, value) in templates {
        key.extend(name.bytes().map(i32::from));
        key.extend(match *value {
            Template::Dtype(d) => [-1, d as i32],
            Template::Int(i) => [-2, i],
            Template::Bool(b) => [-3, i32::from(b)],
        });
    }
    key
}

fn launch(
    kernel: &Compiled,
    inputs: &[&Array],
    outputs: &[(&[i32], Dtype)],
    scalars: &[i32],
    grid: (i32, i32, i32),
    threads: (i32, i32, i32),
) -> Result<Vec<Array>> {
    let stream = Stream::thread_local_or_default();
    let shapes: Vec<i32> = outputs
        .iter()
        .flat_map(|(s, _)| s.iter().copied())
        .collect();
    let ndims: Vec<usize> = outputs.iter().map(|(s, _)| s.len()).collect();
    let dtypes: Vec<mlx_sys::mlx_dtype> = outputs.iter().map(|(_, d)| (*d).into()).collect();
    // SAFETY: FFI on live handles; the output vector is read back before it
    // is freed and each array handle is taken over by an `Array`.
    unsafe {
        let handles: Vec<_> = inputs.iter().map(|a| a.as_ptr()).collect();
        let ins = mlx_sys::mlx_vector_array_new_data(handles.as_ptr(), handles.len());
        let mut results = mlx_sys::mlx_vector_array_new();
        let status = mlx_sys::emlx_cuda_kernel_apply(
            &mut results,
            kernel.handle,
            ins,
            shapes.as_ptr(),
            ndims.as_ptr(),
            dtypes.as_ptr(),
            outputs.len(),
            scalars.as_ptr(),
            scalars.len(),
            grid.0,
            grid.1,
            grid.2,
            threads.0,
            threads.1,
            threads.2,
            stream.as_ptr(),
        );
        let out = if status == 0 {
            take_arrays(results, outputs.len())
        } else {
            Vec::new()
        };
        mlx_sys::mlx_vector_array_free(ins);
        mlx_sys::mlx_vector_array_free(results);
        if out.len() != outputs.len() {
            return Err(Error::Mlx(
                "a CUDA kernel of ours could not be applied".into(),
            ));
        }
        Ok(out)
    }
}

/// `arrays` again, on the same buffers, but evaluated only after `writer`
/// (a kernel's unevaluated output): a kernel that writes into them in place
/// (MLX sees no dependency in a write through an input). Evaluating the
/// returned handles runs the writer, and later graphs on the stream see the
/// write. Within the writer's own graph only nodes that read its output are
/// ordered after it (MLX's CUDA graph orders nodes by the buffers they were
/// seen to write, and an in-place write is not one): read the buffers there
/// only together with the writer's output, as attention reads the keys with
/// the queries.
pub(crate) fn written_by<const N: usize>(
    arrays: [&Array; N],
    writer: &Array,
) -> Result<[Array; N]> {
    // The writer goes first: MLX puts the node on the stream of its first
    // input's primitive (else on MLX's default stream, not the caller's).
    let handles: Vec<_> = std::iter::once(writer)
        .chain(arrays)
        .map(|a| a.as_ptr())
        .collect();
    // SAFETY: FFI on live handles; the result vector is read back before it
    // is freed and each array handle is taken over by an `Array`.
    let mut out = unsafe {
        let ins = mlx_sys::mlx_vector_array_new_data(handles.as_ptr(), handles.len());
        let deps = mlx_sys::mlx_vector_array_new();
        let mut results = mlx_sys::mlx_vector_array_new();
        let out = if mlx_sys::mlx_depends(&mut results, ins, deps) == 0 {
            take_arrays(results, N + 1)
        } else {
            Vec::new()
        };
        mlx_sys::mlx_vector_array_free(ins);
        mlx_sys::mlx_vector_array_free(deps);
        mlx_sys::mlx_vector_array_free(results);
        out
    };
    if out.len() != N + 1 {
        return Err(Error::Mlx("MLX's depends failed".into()));
    }
    out.remove(0);
    out.try_into()
        .map_err(|_| Error::Mlx("MLX's depends failed".into()))
}

/// The arrays of an MLX result vector holding exactly `n`, as our own
/// handles (fewer where it holds another count or a read fails).
///
/// # Safety
/// `results` is a live vector; the caller still frees it.
unsafe fn take_arrays(results: mlx_sys::mlx_vector_array, n: usize) -> Vec<Array> {
    let mut out = Vec::with_capacity(n);
    if mlx_sys::mlx_vector_array_size(results) == n {
        for i in 0..n {
            let mut a = mlx_sys::mlx_array_new();
            if mlx_sys::mlx_vector_array_get(&mut a, results, i) == 0 {
                out.push(Array::from_ptr(a));
            } else {
                mlx_sys::mlx_array_free(a);
            }
        }
    }
    out
}

/// What kernels are compiled and sized for.
struct Target {
    /// The device's architecture, `sm_90`.
    arch: String,
    /// NVRTC's version, `nvrtc13.0`.
    nvrtc: String,
    multiprocessors: i32,
}

/// The device's [`Target`], or why there is no compiling here.
fn target() -> Result<&'static Target> {
    static TARGET: OnceCell<std::result::Result<Target, String>> = OnceCell::new();
    let t = TARGET.get_or_init(|| {
        let (mut major, mut minor, mut sms, mut nv_major, mut nv_minor) = (0, 0, 0, 0, 0);
        // SAFETY: the shim writes the five ints it is given.
        let status = unsafe {
            mlx_sys::emlx_cuda_target(
                &mut major,
                &mut minor,
                &mut sms,
                &mut nv_major,
                &mut nv_minor,
            )
        };
        if status != 0 {
            return Err("no CUDA device or NVRTC in this process".to_string());
        }
        Ok(Target {
            arch: format!("sm_{major}{minor}"),
            nvrtc: format!("nvrtc{nv_major}.{nv_minor}"),
            multiprocessors: sms,
        })
    });
    t.as_ref().map_err(|e| Error::Unsupported(e.clone()))
}

/// The device's multiprocessors (streaming multiprocessors), for grids
/// sized to the device; `None` without a CUDA device.
pub(crate) fn multiprocessors() -> Option<i32> {
    target().ok().map(|t| t.multiprocessors).filter(|&n| n > 0)
}

/// 64-bit FNV-1a: a cached binary's name (stable across builds, unlike
/// std's hasher).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in *part {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where compiled kernels are kept: `EMLX_AXON_KERNEL_CACHE`, else the
/// user's cache folder, else the temporary folder.
fn cache_dir() -> PathBuf {
    if let Some(dir) = crate::switches::kernel_cache() {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("emlx_axon").join("cuda")
}

/// The source's binary for this device and the name that tells it from
/// every other: from the cache, or compiled now and stored there (written
/// whole under another name first, so that a reader never sees half of one;
/// a cache that cannot be written only costs time).
pub(crate) fn binary(name: &str, source: &str) -> Result<(Vec<u8>, String)> {
    let Target { arch, nvrtc, .. } = target()?;
    let hash = fnv1a(&[source.as_bytes(), arch.as_bytes(), nvrtc.as_bytes()]);
    let id = format!("{arch}-{nvrtc}-{:x}-{hash:016x}", source.len());
    let dir = cache_dir();
    let path = dir.join(format!("{name}-{id}.cubin"));
    if let Ok(bytes) = std::fs::read(&path) {
        if !bytes.is_empty() {
            return Ok((bytes, id));
        }
    }
    let bytes = compile(source, arch)?;
    let tmp = dir.join(format!(".{}.{}", std::process::id(), hash));
    if std::fs::create_dir_all(&dir).is_ok() && std::fs::write(&tmp, &bytes).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
    Ok((bytes, id))
}

fn compile(source: &str, arch: &str) -> Result<Vec<u8>> {
    let (source, arch) = (c_string(source)?, c_string(arch)?);
    let mut binary: *mut c_char = std::ptr::null_mut();
    let mut log: *mut c_char = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: the shim fills the out pointers with malloc'd memory (or
    // null), freed below after copying.
    unsafe {
        let status = mlx_sys::emlx_cuda_compile(
            source.as_ptr(),
            arch.as_ptr(),
            &mut binary,
            &mut size,
            &mut log,
        );
        let message = (!log.is_null()).then(|| CStr::from_ptr(log).to_string_lossy().into_owned());
        let bytes = (!binary.is_null())
            .then(|| std::slice::from_raw_parts(binary as *const u8, size).to_vec());
        mlx_sys::emlx_cuda_free(binary);
        mlx_sys::emlx_cuda_free(log);
        match (status, bytes) {
            (0, Some(b)) => Ok(b),
            _ => Err(Error::Mlx(format!(
                "NVRTC could not compile a kernel: {}",
                message.unwrap_or_default().trim()
            ))),
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

// The launch log: while a step is recorded (see `replay`), each launch of
// our kernels on the recording's stream is kept with what it read and wrote.

/// Step inputs that change from step to step: the replay writes its own
/// buffers in their place.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Role {
    /// The step's token ids (uint32, one a row).
    Ids,
    /// Each row's position (int32), where its key and value are written.
    Positions,
    /// Each row's first key (int32): constant, but made each step in memory
    /// the device reaches over the bus (see [`SLOT_MIN`]).
    Starts,
    /// The tokens each row may take (a bitmask, uint32), which the host
    /// writes before each step's sampling.
    Mask,
}

/// A kernel launch as MLX ran it.
pub(crate) struct Launch {
    pub(crate) kernel: Arc<Compiled>,
    /// Each input, and whether it existed before the step (scheduled or
    /// computed when the launch was recorded).
    pub(crate) inputs: Vec<(Array, bool)>,
    pub(crate) outputs: Vec<Array>,
    pub(crate) scalars: Vec<i32>,
    /// In threads, as [`crate::backend::cuda::kernel::CudaKernel::apply`] takes it.
    pub(crate) grid: (i32, i32, i32),
    pub(crate) threads: (i32, i32, i32),
}

/// The launches of one step on one stream.
pub(crate) struct Recording {
    pub(crate) stream: Stream,
    pub(crate) launches: Vec<Launch>,
    pub(crate) marks: Vec<(Role, Array)>,
}

thread_local! {
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// Whether this thread is recording a step.
pub(crate) fn recording() -> bool {
    RECORDING.with(|r| r.borrow().is_some())
}

/// Names an input that changes from step to step, while recording.
pub(crate) fn mark(role: Role, a: &Array) {
    RECORDING.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            rec.marks.push((role, a.clone()));
        }
    });
}

/// Keeps a launch of our kernels while recording on the recording's stream
/// (kernel checks run on streams of their own and are left out).
pub(crate) fn note_launch(
    kernel: &Arc<Compiled>,
    inputs: &[&Array],
    outputs: &[Array],
    scalars: &[i32],
    grid: (i32, i32, i32),
    threads: (i32, i32, i32),
) {
    RECORDING.with(|r| {
        let mut r = r.borrow_mut();
        let Some(rec) = r.as_mut() else {
            return;
        };
        if Stream::thread_local_or_default() != rec.stream {
            return;
        }
        rec.launches.push(Launch {
            kernel: kernel.clone(),
            inputs: inputs
                .iter()
                .map(|a| ((*a).clone(), scheduled(a)))
                .collect(),
            outputs: outputs.to_vec(),
            scalars: scalars.to_vec(),
            grid,
            threads,
        });
    });
}

/// Runs `f` (one step, on the current stream) recording its launches.
pub(crate) fn record<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, Recording)> {
    let start = Recording {
        stream: Stream::thread_local_or_default(),
        launches: Vec::new(),
        marks: Vec::new(),
    };
    let started = RECORDING.with(|r| {
        let mut r = r.borrow_mut();
        r.is_none().then(|| *r = Some(start)).is_some()
    });
    if !started {
        return Err(Error::invalid("a step is already being recorded"));
    }
    /// Ends the recording however `f` ends, a panic included: a recording
    /// left on would keep every later launch's arrays.
    struct End;
    impl Drop for End {
        fn drop(&mut self) {
            RECORDING.with(|r| r.borrow_mut().take());
        }
    }
    let end = End;
    let result = f();
    let recording = RECORDING.with(|r| r.borrow_mut().take());
    drop(end);
    let recording = recording.ok_or_else(|| Error::Mlx("the recording ended early".into()))?;
    Ok((result?, recording))
}

fn scheduled(a: &Array) -> bool {
    // SAFETY: reads the status of a live array.
    unsafe { mlx_sys::emlx_array_scheduled(a.as_ptr()) != 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recording is per call: marks are kept inside it only, a recording
    /// cannot nest, and it ends with the call, failed or not.
    #[test]
    fn recording_keeps_marks_within_one_call() {
        let a = Array::from_slice(&[1u32], &[1]);
        mark(Role::Ids, &a);
        let ((), rec) = record(|| {
            assert!(recording());
            mark(Role::Positions, &a);
            assert!(record(|| Ok(())).is_err(), "nested");
            Ok(())
        })
        .unwrap();
        assert!(!recording());
        assert_eq!(
            rec.marks.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            [Role::Positions]
        );
        let failed = record(|| -> Result<()> { Err(Error::invalid("boom")) });
        assert!(failed.is_err() && !recording());
        let panicked = std::panic::catch_unwind(|| record(|| -> Result<()> { panic!("boom") }));
        assert!(panicked.is_err() && !recording(), "a panic ends it too");
    }

    fn zeros(shape: &[i32], dtype: Dtype) -> Array {
        mlx_rs::ops::zeros_dtype(shape, dtype).unwrap()
    }

    /// The signature MLX's launch fills: input pointers, output pointers,
    /// then the sizes `apply` passes, in its order (each input's shape, then
    /// its strides).
    #[test]
    fn source_lists_parameters_in_launch_order() {
        let body = "out[0] = x[a_shape[1] + b_strides[0] + a_strides[2]];";
        let k = CudaKernel::new("emlx_test", &["a", "b", "x"], &["out"], body).unwrap();
        let (a, b) = (
            zeros(&[2, 3, 4], Dtype::Bfloat16),
            zeros(&[5], Dtype::Int32),
        );
        let x = zeros(&[8], Dtype::Float16);
        let source = k
            .source(
                &[&a, &b, &x],
                &[(&[1], Dtype::Float32)],
                &[
                    ("T", Template::Dtype(Dtype::Bfloat16)),
                    ("N", Template::Int(7)),
                ],
            )
            .unwrap();
        let signature = [
            "const emlx_bf16* a",
            "const int* b",
            "const emlx_f16* x",
            "float* __restrict__ out",
            "int a_shape0",
            "int a_shape1",
            "int a_shape2",
            "int a_strides0",
            "int a_strides1",
            "int a_strides2",
            "int b_strides0) {",
        ]
        .join(",\n    ");
        assert!(source.contains(&signature), "{source}");
        assert!(source.contains("using T = emlx_bf16;"));
        assert!(source.contains("constexpr int N = 7;"));
        assert!(source.contains("const long long b_strides[1] = {b_strides0};"));
        assert!(!source.contains("x_shape") && !source.contains("#include"));
    }

    /// Bounds by threads a multiprocessor take the block size from the
    /// variant's `BLOCK`, and a kernel without one is refused.
    #[test]
    fn bounds_per_multiprocessor_read_the_block_constant() {
        let k = CudaKernel::new("emlx_test", &["x"], &["out"], "out[0] = x[0];")
            .unwrap()
            .bounded_per_multiprocessor(768);
        let x = zeros(&[4], Dtype::Float32);
        let out: [(&[i32], Dtype); 1] = [(&[1], Dtype::Float32)];
        for (block, blocks) in [(128, 6), (32, 24), (384, 2), (1024, 1)] {
            let source = k
                .source(&[&x], &out, &[("BLOCK", Template::Int(block))])
                .unwrap();
            let bounds = format!("__launch_bounds__({block}, {blocks}) emlx_test(");
            assert!(source.contains(&bounds), "{block}: {source}");
        }
        assert!(k.source(&[&x], &out, &[("N", Template::Int(1))]).is_err());
    }

    /// A variant's key tells apart every input type and rank, output type,
    /// constant name and value, and kind of constant.
    #[test]
    fn variants_differ_by_type_rank_and_constant() {
        let out: [(&[i32], Dtype); 1] = [(&[1], Dtype::Float32)];
        let key =
            |x: &Array, out: &[(&[i32], Dtype)], t: &[(&str, Template)]| variant(&[x], out, t);
        let x = zeros(&[2, 3], Dtype::Bfloat16);
        let n1 = [("N", Template::Int(1))];
        let base = key(&x, &out, &n1);
        assert_eq!(base, key(&zeros(&[4, 5], Dtype::Bfloat16), &out, &n1));
        let others = [
            key(&zeros(&[6], Dtype::Bfloat16), &out, &n1),
            key(&zeros(&[2, 3], Dtype::Float32), &out, &n1),
            key(&x, &[(&[1], Dtype::Bfloat16)], &n1),
            key(&x, &out, &[("M", Template::Int(1))]),
            key(&x, &out, &[("NN", Template::Int(1))]),
            key(&x, &out, &[("N", Template::Int(2))]),
            key(&x, &out, &[("N", Template::Bool(true))]),
            key(&x, &out, &[("N", Template::Dtype(Dtype::Bool))]),
            key(&x, &out, &[]),
        ];
        for (i, other) in others.iter().enumerate() {
            assert_ne!(&base, other, "variant {i}");
        }
    }

    /// Handles made to wait for a writer hold the same values, and
    /// evaluating them evaluates the writer.
    #[test]
    fn written_by_keeps_values_and_waits_for_the_writer() {
        let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
        let b = Array::from_slice(&[4i32, 5], &[2]);
        a.eval().unwrap();
        let writer = a.multiply(Array::from_f32(2.0)).unwrap();
        let [a2, b2] = written_by([&a, &b], &writer).unwrap();
        mlx_rs::transforms::eval([&a2, &b2]).unwrap();
        assert_eq!(a2.as_slice::<f32>(), &[1.0, 2.0, 3.0]);
        assert_eq!(b2.as_slice::<i32>(), &[4, 5]);
        // SAFETY: a status query on a live handle.
        let mut available = false;
        let status = unsafe { mlx_sys::_mlx_array_is_available(&mut available, writer.as_ptr()) };
        assert!(status == 0 && available, "the writer was not evaluated");
    }

    /// Where MLX has no CUDA device (the CPU build), a kernel is an error,
    /// never a crash.
    #[test]
    fn without_cuda_a_kernel_is_an_error() {
        if crate::runtime::device::gpu_available() {
            return;
        }
        let k = CudaKernel::new("emlx_test", &["x"], &["y"], "y[0] = x[0];").unwrap();
        let x = zeros(&[4], Dtype::Float32);
        let out = k.apply(
            &[&x],
            &[(&[4], Dtype::Float32)],
            (32, 1, 1),
            (32, 1, 1),
            &[],
        );
        assert!(out.is_err());
        assert!(k.apply(&[], &[], (1, 1, 1), (1, 1, 1), &[]).is_err());
    }

    /// A compiled binary is put in MLX's module cache under the name MLX
    /// gives the short token it is launched with: the binary itself, and
    /// its kernel list.
    #[cfg(not(target_os = "macos"))]
    #[test]
    fn compiled_binaries_are_staged_in_mlx_module_cache() {
        let dir = std::env::temp_dir().join(format!("emlx-ptx-{}", std::process::id()));
        std::env::set_var("MLX_PTX_CACHE_DIR", &dir);
        let binary = b"not a real cubin, only staged";
        drop(Compiled::new("emlx_stage_test", "emlx:test", binary.to_vec()).unwrap());
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        let with = |ext: &str| {
            files
                .iter()
                .find(|p| p.extension().is_some_and(|e| e == ext))
        };
        let (ptx, list) = (with("ptx").unwrap(), with("txt").unwrap());
        assert!(ptx
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("emlx_stage_test_"));
        assert_eq!(std::fs::read(ptx).unwrap(), binary);
        assert_eq!(
            std::fs::read_to_string(list).unwrap(),
            "emlx_stage_test\temlx_stage_test\n"
        );
        assert_eq!(files.len(), 2, "no temporary file left: {files:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
