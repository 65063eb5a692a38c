//! MLX's memory figures, so callers (and the reliability tests) can see
//! that models and generations give their memory back.

use emlx_axon_engine::runtime::memory;
use rustler::{Atom, NifMap};

use crate::error::NifResult;

mod atoms {
    rustler::atoms! { ok }
}

#[derive(NifMap)]
pub struct MemoryInfo {
    active: usize,
    peak: usize,
    cache: usize,
    limit: usize,
}

#[rustler::nif(schedule = "DirtyCpu")]
fn memory_info() -> NifResult<MemoryInfo> {
    let m = memory::info()?;
    Ok(MemoryInfo {
        active: m.active,
        peak: m.peak,
        cache: m.cache,
        limit: m.limit,
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn memory_reset_peak() -> NifResult<Atom> {
    memory::reset_peak()?;
    Ok(atoms::ok())
}

#[rustler::nif(schedule = "DirtyCpu")]
fn memory_clear_cache() -> NifResult<Atom> {
    memory::clear_cache()?;
    Ok(atoms::ok())
}

#[rustler::nif(schedule = "DirtyCpu")]
fn memory_set_limit(bytes: usize) -> NifResult<usize> {
    Ok(memory::set_limit(bytes)?)
}
