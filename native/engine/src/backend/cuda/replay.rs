//! A one-token decode step replayed as one CUDA graph, outside MLX's graph.
//!
//! On a CUDA GPU a small model's step is bound by the host: MLX builds and
//! queues about 145 nodes a step (about 0.9 ms on an NVIDIA H200, as long as
//! the kernels take). When every node of a step is one of our kernels
//! ([`crate::backend::cuda::kernel`]), the step can run without MLX: one step is run
//! through MLX as usual while its launches are recorded (each kernel's
//! binary, grid, scalars, and the arrays it reads and writes), then those
//! launches, with the same buffers, are captured as one CUDA graph on a
//! stream of our own, followed by a small kernel that feeds each step's
//! tokens to the next (`ids`), moves the positions on, and writes the tokens
//! into pinned host memory. The step's last launch gives its tokens: our
//! argmax, or our sampling kernel, whose draws hash the positions the
//! replay moves on, so a replayed sampled step draws anew with no state. A step is then one graph launch, and the host
//! only reads tokens back.
//!
//! Every array the launches touch is held for the replay's life, so MLX
//! neither frees nor reuses their buffers, and none is read on the host
//! (that would move it). Before the first replay, the recorded step is
//! replayed once on its own inputs and every output compared with MLX's
//! run of it, bit for bit (the kernels are deterministic, and the cache
//! write puts the same keys and values at the same place): a replay that
//! differs is not used.
//!
//! On an NVIDIA H200 (Qwen3-0.6B shape, 4-bit, bfloat16) a replayed step
//! took 0.70 ms where MLX's took 1.0-1.9 ms, and building a replay 8-12 ms
//! (bench/RESULTS-gpu.md).

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mlx_rs::{Array, Dtype};
use once_cell::sync::OnceCell;

use crate::backend::cuda::kernel::{Compiled, Recording, Role};
use crate::error::{Error, Result};

/// Set once a replay's check differed from MLX's step: a difference would
/// recur (a kernel that is not deterministic, or a fault in the recording),
/// so later generations keep MLX's steps.
static DIFFERED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Asked for by [`time_next`], and what it gave.
    static TIME_NEXT: Cell<bool> = const { Cell::new(false) };
    static TIMES: RefCell<Option<Vec<(String, f32)>>> = const { RefCell::new(None) };
}

/// Has the next replay built on this thread time each of its kernels
/// alone, once, when it is dropped after its generation's last step (the
/// bench's profile): see [`kernel_times`].
pub fn time_next() {
    TIME_NEXT.with(|t| t.set(true));
}

/// The kernels of the last replay timed on this thread, in launch order,
/// and each one's device time alone in microseconds (the median of a few
/// runs); `None` where none was.
pub fn kernel_times() -> Option<Vec<(String, f32)>> {
    TIMES.with(|t| t.borrow_mut().take())
}

/// Whether steps may be replayed here: asked for, and the CUDA layers too.
pub fn wanted() -> bool {
    crate::switches::step_replay() && super::layer::wanted()
}

/// `Some(false)` once a replay differed in this process; `None` otherwise.
pub fn usable() -> Option<bool> {
    DIFFERED.load(Ordering::Relaxed).then_some(false)
}

/// Turns replays off for the process; whether they were off already.
pub(crate) fn set_differed() -> bool {
    DIFFERED.swap(true, Ordering::Relaxed)
}

/// `a`'s bits as unsigned integers of its width.
fn bits(a: &Array) -> Result<Array> {
    Ok(match a.item_size() {
        1 => a.view_dtype(Dtype::Uint8)?,
        2 => a.view_dtype(Dtype::Uint16)?,
        4 => a.view_dtype(Dtype::Uint32)?,
        _ => a.view_dtype(Dtype::Uint64)?,
    })
}

/// `a`'s bits (see [`bits`]) in a buffer of their own: an add of zero to
/// the bits copies every one (to the values it would turn -0 into 0), and
/// `contiguous` of a contiguous view copies nothing.
fn exact_bits(a: &Array) -> Result<Array> {
    let b = bits(a)?;
    Ok(b.add(Array::from_int(0).as_dtype(b.dtype())?)?)
}

/// A copy of `a` in a buffer of its own, bit for bit.
pub(crate) fn exact_copy(a: &Array) -> Result<Array> {
    Ok(exact_bits(a)?.view_dtype(a.dtype())?)
}

/// The device address and size of an evaluated array.
fn device_ptr(a: &Array) -> Result<(u64, usize)> {
    let (mut ptr, mut bytes) = (0u64, 0usize);
    // SAFETY: the shim writes the two values for a live array.
    let status = unsafe { mlx_sys::emlx_array_device_ptr(a.as_ptr(), &mut ptr, &mut bytes) };
    if status != 0 {
        return Err(Error::Mlx("a replayed step's array holds no data".into()));
    }
    Ok((ptr, bytes))
}

/// The message the shim left in `error` (malloc'd), freed.
fn take_error(error: *mut c_char, what: &str) -> Error {
    let message = if error.is_null() {
        String::from("unknown failure")
    } else {
        // SAFETY: a NUL-terminated string from the shim, freed once here.
        unsafe {
            let m = CStr::from_ptr(error).to_string_lossy().into_owned();
            mlx_sys::emlx_cuda_free(error);
            m
        }
    };
    Error::Mlx(format!("{what}: {message}"))
}

/// Feeds a step's tokens to the next: the ids, each row's position one on,
/// and the tokens into the host ring's next slot.
const ADVANCE: &str = include_str!("cu/advance.cu");

/// Steps in flight at most (ring slots and events).
const SLOTS: i32 = 4;

/// The advance kernel's cubin and a name of it, for the life of the
/// process (the shim keeps a module per name).
fn advance_binary() -> Result<&'static (Vec<u8>, String)> {
    static BINARY: OnceCell<(Vec<u8>, String)> = OnceCell::new();
    BINARY.get_or_try_init(|| {
        let (binary, id) = crate::backend::cuda::kernel::binary("emlx_axon_advance", ADVANCE)?;
        Ok((binary, format!("emlx_axon_advance:{id}")))
    })
}

/// Runs of each kernel that [`time_next`]'s timing takes the median of.
pub const TIMING_RUNS: i32 = 9;

/// Elements of the replay's own small buffers at least: MLX puts arrays of
/// up to 8 bytes in host-resident managed memory, which every kernel
/// reading them would reach over the bus.
const SLOT_MIN: usize = 16;

/// `a` (`[rows]`) followed by zeros up to [`SLOT_MIN`] elements, in a buffer
/// of its own.
fn slot(a: &Array, rows: usize) -> Result<Array> {
    let flat = a.reshape(&[rows as i32])?;
    let pad = SLOT_MIN.saturating_sub(rows) as i32;
    if pad == 0 {
        return exact_copy(&flat);
    }
    let zeros = mlx_rs::ops::zeros_dtype(&[pad], a.dtype())?;
    Ok(mlx_rs::ops::concatenate(&[flat, zeros], 0)?)
}

fn host_values<T: mlx_rs::ArrayElement + Copy>(a: &Array) -> Result<Vec<T>> {
    a.try_as_slice::<T>()
        .map(<[T]>::to_vec)
        .map_err(|e| Error::Mlx(format!("reading a replay's check: {e}")))
}

/// Appends a launch of kernel `name` of the cubin `binary` (which `key`
/// names: the shim loads a module per key) to the step `handle`: `blocks`
/// of `block` threads, parameters `values`.
fn add(
    handle: *mut c_void,
    key: &str,
    binary: &[u8],
    name: &str,
    blocks: [i32; 3],
    block: [i32; 3],
    values: &[u64],
) -> Result<()> {
    let c = |s: &str| {
        std::ffi::CString::new(s).map_err(|_| Error::invalid("a kernel name holds a NUL byte"))
    };
    let (key, name) = (c(key)?, c(name)?);
    let (blocks, block) = (blocks.map(|b| b as u32), block.map(|b| b as u32));
    let mut error: *mut c_char = std::ptr::null_mut();
    // SAFETY: the shim copies the values and loads the binary (held by the
    // replay for its life).
    let status = unsafe {
        mlx_sys::emlx_cuda_step_add(
            handle,
            key.as_ptr(),
            binary.as_ptr().cast(),
            name.as_ptr(),
            blocks.as_ptr(),
            block.as_ptr(),
            values.as_ptr(),
            values.len(),
            &mut error,
        )
    };
    if status != 0 {
        return Err(take_error(error, "adding a kernel to the step"));
    }
    Ok(())
}

/// A recorded step, ready to replay.
pub(crate) struct StepReplay {
    handle: *mut c_void,
    rows: usize,
    /// Where the host writes each step's masks (device address, bytes), for
    /// a step whose sampling reads them: its head is queued first.
    mask: Option<(u64, usize)>,
    /// Launches queued so far (the check's included).
    launched: u64,
    /// Every array the launches read or write, and the binaries.
    _held: Vec<Array>,
    kernels: Vec<Arc<Compiled>>,
    /// Asked by [`time_next`]: times its kernels when dropped.
    timed: bool,
}

// SAFETY: the handle is used by one owner at a time; the shim makes the
// device's context current around every driver call.
unsafe impl Send for StepReplay {}

/// What building a replay gave, where nothing failed.
pub(crate) enum Built {
    Ready(StepReplay),
    /// Its checked step differed from MLX's run of it (why).
    Differs(String),
}

impl Drop for StepReplay {
    fn drop(&mut self) {
        // Timed at the end, on the last step's buffers: kernels whose time
        // depends on the values (the sampling kernel's gathered candidates)
        // see the generation's own, not the prompt's.
        if self.timed {
            match self.time_kernels(TIMING_RUNS) {
                Ok(times) => TIMES.with(|t| *t.borrow_mut() = Some(times)),
                Err(e) => crate::backend::notice(format!("timing the replay's kernels: {e}")),
            }
        }
        // SAFETY: made by `emlx_cuda_step_new`, freed once; waits for the
        // stream before the held arrays go.
        unsafe { mlx_sys::emlx_cuda_step_free(self.handle) };
    }
}

/// What a launch's input is in the replay.
fn resolve(
    input: &Array,
    existed: bool,
    slots: &[(u64, u64)],
    earlier: &[(u64, u64)],
) -> Result<Option<u64>> {
    let (ptr, _) = device_ptr(input)?;
    if let Some((_, own)) = slots.iter().find(|(from, _)| *from == ptr) {
        return Ok(Some(*own));
    }
    let made_before = earlier.iter().any(|&(lo, hi)| lo <= ptr && ptr < hi);
    Ok((made_before || existed).then_some(ptr))
}

impl StepReplay {
    /// Builds the replay of a recorded step whose tokens (`[rows]` uint32)
    /// are `next`, and checks it against `want`, an exact copy of `next`
    /// made before (the check writes its tokens into `next`'s buffer):
    /// returns the replay with its first step (the check) done, or why the
    /// check differed. The
    /// recording must have marked the ids and positions, and every kernel
    /// input must exist before the step or come from an earlier launch.
    pub(crate) fn build(rec: Recording, next: &Array, want: &Array) -> Result<Built> {
        let refuse = |why: &str| Err(Error::Unsupported(format!("no step replay: {why}")));
        let (Some(last), true) = (rec.launches.last(), next.dtype() == Dtype::Uint32) else {
            return refuse("the step's tokens are not our argmax's or sampling kernel's");
        };
        let rows = next.size();
        let find = |role: Role| rec.marks.iter().find(|(r, _)| *r == role).map(|(_, a)| a);
        let (Some(ids), Some(positions)) = (find(Role::Ids), find(Role::Positions)) else {
            return refuse("the step's ids or positions were not marked");
        };
        if ids.dtype() != Dtype::Uint32
            || ids.size() != rows
            || positions.dtype() != Dtype::Int32
            || positions.size() != rows
        {
            return refuse("ids or positions of another type or size");
        }
        // Buffers of our own for the changing inputs, and the step counter.
        let ids_slot = slot(ids, rows)?;
        let positions_slot = slot(positions, rows)?;
        let starts = find(Role::Starts).filter(|s| s.size() == rows);
        let starts_slot = starts.map(|s| slot(s, rows)).transpose()?;
        let mask = find(Role::Mask);
        if mask.is_some_and(|m| {
            m.dtype() != Dtype::Uint32 || m.ndim() != 2 || m.dim(0) as usize != rows
        }) {
            return refuse("a mask of another type or shape");
        }
        let mask_slot = mask.map(exact_copy).transpose()?;
        let counter = mlx_rs::ops::zeros_dtype(&[SLOT_MIN as i32], Dtype::Uint32)?;
        let outputs: Vec<&Array> = rec.launches.iter().flat_map(|l| &l.outputs).collect();
        // What the check compares the replay with, bit for bit.
        let copies = outputs
            .iter()
            .map(|a| exact_bits(a))
            .collect::<Result<Vec<_>>>()?;
        mlx_rs::transforms::eval(
            [&ids_slot, &positions_slot, &counter, want]
                .into_iter()
                .chain(&starts_slot)
                .chain(&mask_slot)
                .chain(&copies)
                .chain(outputs.iter().copied()),
        )?;
        if device_ptr(&last.outputs[0])?.0 != device_ptr(next)?.0 {
            return refuse("the step's tokens are not our argmax's or sampling kernel's");
        }
        let mut slots = vec![
            (device_ptr(ids)?.0, device_ptr(&ids_slot)?.0),
            (device_ptr(positions)?.0, device_ptr(&positions_slot)?.0),
        ];
        if let (Some(from), Some(own)) = (starts, &starts_slot) {
            slots.push((device_ptr(from)?.0, device_ptr(own)?.0));
        }
        // A mask is read by the step's sampling, its last launch, alone:
        // the launches before it (the head) run while the host computes it.
        let mut split = 0;
        let mut mask_at = None;
        if let (Some(from), Some(own)) = (mask, &mask_slot) {
            let from = device_ptr(from)?.0;
            let readers: Vec<usize> = rec
                .launches
                .iter()
                .enumerate()
                .filter(|(_, l)| {
                    l.inputs
                        .iter()
                        .any(|(a, _)| device_ptr(a).is_ok_and(|p| p.0 == from))
                })
                .map(|(i, _)| i)
                .collect();
            if readers != [rec.launches.len() - 1] {
                return refuse("the mask is read by another launch than the step's last");
            }
            split = rec.launches.len() - 1;
            slots.push((from, device_ptr(own)?.0));
            mask_at = Some(device_ptr(own)?);
        }

        let mut ring = 0u64;
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: the shim writes the ring's address and an error string.
        let handle =
            unsafe { mlx_sys::emlx_cuda_step_new(rows as i32, SLOTS, &mut ring, &mut error) };
        if handle.is_null() {
            return Err(take_error(error, "a CUDA stream for the step"));
        }
        let mut replay = StepReplay {
            handle,
            rows,
            mask: mask_at,
            launched: 0,
            _held: Vec::new(),
            kernels: Vec::new(),
            timed: false,
        };
        let mut earlier: Vec<(u64, u64)> = Vec::new();
        for l in &rec.launches {
            let mut values = Vec::new();
            for (input, existed) in &l.inputs {
                match resolve(input, *existed, &slots, &earlier)? {
                    Some(ptr) => values.push(ptr),
                    None => {
                        return refuse(&format!(
                            "an input of {} comes from an MLX op, not a kernel of ours",
                            l.kernel.name()
                        ))
                    }
                }
            }
            for out in &l.outputs {
                let (ptr, bytes) = device_ptr(out)?;
                values.push(ptr);
                earlier.push((ptr, ptr + bytes as u64));
            }
            values.extend(l.scalars.iter().map(|&s| u64::from(s as u32)));
            // As MLX's custom kernels launch: the grid in threads.
            let (g, t) = (l.grid, l.threads);
            let block = [t.0.min(g.0), t.1.min(g.1), t.2.min(g.2)];
            let blocks = [
                (g.0 + t.0 - 1) / t.0,
                (g.1 + t.1 - 1) / t.1,
                (g.2 + t.2 - 1) / t.2,
            ];
            add(
                replay.handle,
                l.kernel.token(),
                l.kernel.binary(),
                l.kernel.name(),
                blocks,
                block,
                &values,
            )?;
        }
        let advance_params = [
            device_ptr(next)?.0,
            slots[0].1,
            slots[1].1,
            ring,
            device_ptr(&counter)?.0,
            rows as u64,
            SLOTS as u64,
        ];
        let threads = ((rows as i32).clamp(1, 1024) + 31) / 32 * 32;
        let (advance, key) = advance_binary()?;
        add(
            replay.handle,
            key,
            advance,
            "emlx_axon_advance",
            [1, 1, 1],
            [threads, 1, 1],
            &advance_params,
        )?;
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live handle; the shim sets the error string on failure.
        if unsafe { mlx_sys::emlx_cuda_step_capture(replay.handle, split, &mut error) } != 0 {
            // Kernel by kernel still skips MLX's graph.
            crate::backend::notice(format!(
                "{}; the replayed step launches kernel by kernel",
                take_error(error, "capturing the step as a CUDA graph")
            ));
        }

        // The check: the recorded step again, on its own inputs.
        let first = replay.launch()?;
        let tokens = replay.tokens(first)?;
        let flags = outputs
            .iter()
            .zip(&copies)
            .map(|(a, c)| Ok(bits(a)?.ne(c)?.any(None)?))
            .collect::<Result<Vec<_>>>()?;
        mlx_rs::transforms::eval(&flags)?;
        let mut differing = 0;
        for f in &flags {
            differing += usize::from(host_values::<bool>(f)?[0]);
        }
        if differing > 0 || tokens != host_values::<u32>(want)? {
            return Ok(Built::Differs(format!(
                "the replayed step differs from MLX's run of it ({differing} of {} outputs)",
                outputs.len()
            )));
        }
        replay._held = rec
            .launches
            .iter()
            .flat_map(|l| l.inputs.iter().map(|(a, _)| a).chain(&l.outputs))
            .cloned()
            .chain([ids_slot, positions_slot, counter, next.clone()])
            .chain(starts_slot)
            .chain(mask_slot)
            .collect();
        replay.kernels = rec.launches.iter().map(|l| l.kernel.clone()).collect();
        replay.timed = TIME_NEXT.with(|t| t.replace(false));
        Ok(Built::Ready(replay))
    }

    /// Whether each step's sampling reads masks the host writes
    /// ([`set_mask`](Self::set_mask)).
    pub(crate) fn masked(&self) -> bool {
        self.mask.is_some()
    }

    /// Queues the next step up to its sampling (a masked step), which
    /// [`launch`](Self::launch) then queues.
    pub(crate) fn launch_head(&mut self) -> Result<()> {
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live handle.
        if unsafe { mlx_sys::emlx_cuda_step_launch_head(self.handle, &mut error) } != 0 {
            return Err(take_error(error, "launching a replayed step's head"));
        }
        Ok(())
    }

    /// Writes the masks the next step's sampling reads: `words`, as many
    /// as the recorded step's mask held, after what is queued.
    pub(crate) fn set_mask(&mut self, words: &[u32]) -> Result<()> {
        let Some((to, bytes)) = self.mask else {
            return Err(Error::invalid("a mask for a replayed step that takes none"));
        };
        if std::mem::size_of_val(words) != bytes {
            return Err(Error::invalid(format!(
                "a replayed step's mask of {} bytes, not {bytes}",
                std::mem::size_of_val(words)
            )));
        }
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live handle; the shim copies `bytes` from `words` before
        // it returns, to a device buffer the replay holds.
        let status = unsafe {
            mlx_sys::emlx_cuda_step_upload(
                self.handle,
                to,
                words.as_ptr().cast(),
                bytes,
                &mut error,
            )
        };
        if status != 0 {
            return Err(take_error(error, "writing a replayed step's mask"));
        }
        Ok(())
    }

    /// Queues the next step (or the rest of it, after
    /// [`launch_head`](Self::launch_head)); its number, for
    /// [`tokens`](Self::tokens).
    pub(crate) fn launch(&mut self) -> Result<u64> {
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live handle.
        if unsafe { mlx_sys::emlx_cuda_step_launch(self.handle, &mut error) } != 0 {
            return Err(take_error(error, "launching a replayed step"));
        }
        self.launched += 1;
        Ok(self.launched - 1)
    }

    /// Each recorded kernel alone, `runs` times, after everything queued:
    /// its name and median device time in microseconds. The kernels rerun
    /// on the step's buffers and inputs, which rewrites the same values;
    /// the advance kernel, which would move the positions on, is left out.
    fn time_kernels(&self, runs: i32) -> Result<Vec<(String, f32)>> {
        let count = self.kernels.len();
        let mut us = vec![0f32; count];
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live handle; `us` holds `count` values, which are the
        // first launches (the advance kernel was added after them).
        let status = unsafe {
            mlx_sys::emlx_cuda_step_time(self.handle, runs, count, us.as_mut_ptr(), &mut error)
        };
        if status != 0 {
            return Err(take_error(error, "timing a replayed step's kernels"));
        }
        Ok(self
            .kernels
            .iter()
            .map(|k| k.name().to_string())
            .zip(us)
            .collect())
    }

    /// Step `n`'s tokens, one a row, once it is done.
    pub(crate) fn tokens(&mut self, n: u64) -> Result<Vec<u32>> {
        let mut tokens = vec![0u32; self.rows];
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live handle; `tokens` holds a value per row.
        let status = unsafe {
            mlx_sys::emlx_cuda_step_wait(self.handle, n, tokens.as_mut_ptr(), &mut error)
        };
        if status != 0 {
            return Err(take_error(error, "waiting for a replayed step"));
        }
        Ok(tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernel::record;
    use mlx_rs::ops::indexing::IndexOp;

    /// An exact copy keeps -0 and NaN payloads, of strided views too.
    #[test]
    fn exact_copies_keep_every_bit() {
        let raw: Vec<u16> = vec![0x8000, 0x7fc1, 0x3f80, 0xff81, 0x0001, 0xc000];
        let a = Array::from_slice(&raw, &[2, 3])
            .view_dtype(Dtype::Bfloat16)
            .unwrap();
        let column = a.index((.., 1..2));
        for x in [&a, &column] {
            let copy = exact_copy(x).unwrap();
            assert_eq!(copy.dtype(), Dtype::Bfloat16);
            let want = bits(x).unwrap().contiguous().unwrap();
            let got = bits(&copy).unwrap();
            assert_eq!(got.as_slice::<u16>(), want.as_slice::<u16>());
        }
        let column_bits = bits(&exact_copy(&column).unwrap()).unwrap();
        assert_eq!(column_bits.as_slice::<u16>(), [0x7fc1, 0x0001]);
    }

    /// Without a CUDA driver in the process, making a step is an error
    /// that says so, and what was made is freed.
    #[test]
    fn without_a_cuda_driver_no_step_is_made() {
        if crate::runtime::device::gpu_available() {
            return;
        }
        let (mut ring, mut error) = (0u64, std::ptr::null_mut());
        // SAFETY: the shim writes the two out values.
        let handle = unsafe { mlx_sys::emlx_cuda_step_new(1, SLOTS, &mut ring, &mut error) };
        assert!(handle.is_null());
        let e = take_error(error, "a CUDA stream for the step").to_string();
        assert!(e.contains("driver"), "{e}");
    }

    /// A step with none of our kernels (as on a CPU) is refused before
    /// anything is launched.
    #[test]
    fn a_step_without_our_kernels_is_refused() {
        let next = Array::from_slice(&[3u32], &[1]);
        let (_, rec) = record(|| Ok(())).unwrap();
        match StepReplay::build(rec, &next, &next) {
            Err(Error::Unsupported(why)) => assert!(why.contains("argmax"), "{why}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("built"),
        }
    }
}
