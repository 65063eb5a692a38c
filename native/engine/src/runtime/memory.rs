//! MLX's allocator figures, and the check that refuses work which cannot fit.
//!
//! MLX's CPU allocator does not report a failed allocation: `malloc`'s null
//! comes back as an empty buffer that the next kernel writes through, which
//! kills the whole process (for the NIF, the BEAM node). So every allocation
//! whose size a caller controls (a checkpoint's weights, a generation's KV
//! cache) is checked against MLX's memory limit before it is made.

use mlx_rs::Array;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes held by live arrays.
    pub active: usize,
    /// The most `active` has been since start or `reset_peak`.
    pub peak: usize,
    /// Freed buffers MLX keeps for reuse.
    pub cache: usize,
    /// MLX's memory limit (on the CPU, 80% of the machine's memory).
    pub limit: usize,
}

type Getter = unsafe extern "C" fn(*mut usize) -> std::os::raw::c_int;

fn read(getter: Getter, what: &str) -> Result<usize> {
    crate::runtime::device::prepare_mlx();
    let mut value = 0usize;
    // SAFETY: the MLX-C getters only write the one usize they are given.
    match unsafe { getter(&mut value) } {
        0 => Ok(value),
        _ => Err(Error::Mlx(format!("could not read MLX's {what} memory"))),
    }
}

pub fn info() -> Result<MemoryInfo> {
    Ok(MemoryInfo {
        active: read(mlx_sys::mlx_get_active_memory, "active")?,
        peak: read(mlx_sys::mlx_get_peak_memory, "peak")?,
        cache: read(mlx_sys::mlx_get_cache_memory, "cache")?,
        limit: read(mlx_sys::mlx_get_memory_limit, "limit")?,
    })
}

fn status(code: std::os::raw::c_int, what: &str) -> Result<()> {
    match code {
        0 => Ok(()),
        _ => Err(Error::Mlx(format!("could not {what}"))),
    }
}

pub fn reset_peak() -> Result<()> {
    crate::runtime::device::prepare_mlx();
    // SAFETY: a plain MLX-C call without arguments.
    status(
        unsafe { mlx_sys::mlx_reset_peak_memory() },
        "reset the peak memory",
    )
}

/// Returns the buffers MLX keeps for reuse to the system.
pub fn clear_cache() -> Result<()> {
    crate::runtime::device::prepare_mlx();
    // SAFETY: a plain MLX-C call without arguments.
    status(
        unsafe { mlx_sys::mlx_clear_cache() },
        "clear the buffer cache",
    )
}

/// Sets MLX's memory limit, which `ensure_fits` holds work to; returns the
/// previous one.
pub fn set_limit(bytes: usize) -> Result<usize> {
    crate::runtime::device::prepare_mlx();
    let mut previous = 0usize;
    // SAFETY: MLX-C writes the previous limit into `previous`.
    status(
        unsafe { mlx_sys::mlx_set_memory_limit(&mut previous, bytes) },
        "set the memory limit",
    )?;
    Ok(previous)
}

/// Fails with `Error::OutOfMemory` when `bytes` more would take MLX past its
/// memory limit. Concurrent work can still add up past it; this catches the
/// single request that can never fit, which would otherwise crash.
pub(crate) fn ensure_fits(bytes: Option<usize>, what: &str) -> Result<()> {
    let MemoryInfo { active, limit, .. } = info()?;
    if limit == 0 {
        // A backend that keeps no limit gives nothing to check against.
        return Ok(());
    }
    let free = limit.saturating_sub(active);
    match bytes {
        Some(bytes) if bytes <= free => Ok(()),
        Some(bytes) => Err(Error::OutOfMemory(format!(
            "{what} needs {} but only {} of MLX's {} memory limit is free",
            human(bytes),
            human(free),
            human(limit)
        ))),
        None => Err(Error::OutOfMemory(format!(
            "{what} needs more memory than can be counted"
        ))),
    }
}

/// Bytes that evaluating `arrays` will allocate: those of the arrays not
/// yet computed (a loaded tensor already holds its data).
pub(crate) fn unevaluated_bytes<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> usize {
    arrays
        .into_iter()
        .filter(|a| !is_available(a))
        .map(Array::nbytes)
        .sum()
}

/// Whether `array` holds its data (evaluated, or made from data).
pub(crate) fn is_available(array: &Array) -> bool {
    let mut available = false;
    // SAFETY: MLX-C writes one bool; a failure leaves `false`, which only
    // makes the estimate larger.
    unsafe { mlx_sys::_mlx_array_is_available(&mut available, array.as_ptr()) };
    available
}

fn human(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 20), "3.0 MiB");
        assert_eq!(human(usize::MAX), "16777216.0 TiB");
    }

    #[test]
    fn refuses_what_cannot_fit() {
        let limit = info().unwrap().limit;
        assert!(limit > 0);
        assert!(ensure_fits(Some(1), "a byte").is_ok());
        let err = ensure_fits(Some(limit + 1), "the test").unwrap_err();
        assert_eq!(err.kind(), "out_of_memory");
        assert!(err.to_string().contains("the test needs"), "{err}");
        assert_eq!(ensure_fits(None, "x").unwrap_err().kind(), "out_of_memory");
    }
}
