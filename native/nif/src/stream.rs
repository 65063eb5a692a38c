//! Per-process MLX streams sharing a model's weights. Each resource leases
//! a stream from the engine's bounded pool and gives it back when it is
//! closed or garbage-collected, so dropped streams leak neither MLX streams
//! nor their threads.

use emlx_axon_engine::runtime::device::{DeviceKind, Lease, MlxStream};
use rustler::{Atom, NifMap, ResourceArc};

use crate::error::{guard, NifError, NifResult};
use crate::slot::Slot;

mod atoms {
    rustler::atoms! { cpu, gpu, default, ok }
}

pub struct StreamResource {
    stream: Slot<Lease>,
    kind: DeviceKind,
    index: i32,
}

#[rustler::resource_impl]
impl rustler::Resource for StreamResource {}

impl StreamResource {
    /// The stream, or an error once it was closed.
    pub fn get(&self) -> NifResult<MlxStream> {
        self.stream.with(|lease| Ok(lease.stream().clone()))
    }
}

#[rustler::nif(schedule = "DirtyCpu")]
fn stream_new(device: Atom) -> NifResult<ResourceArc<StreamResource>> {
    guard(|| {
        let kind = if device == atoms::cpu() {
            DeviceKind::Cpu
        } else if device == atoms::gpu() {
            DeviceKind::Gpu
        } else if device == atoms::default() {
            DeviceKind::default_kind()
        } else {
            return Err(NifError::new(
                "invalid_argument",
                "device must be :cpu, :gpu or :default",
            ));
        };
        let lease = Lease::new(kind)?;
        Ok(ResourceArc::new(StreamResource {
            index: lease.stream().index(),
            stream: Slot::new(lease, ("closed_stream", "the stream was closed")),
            kind,
        }))
    })
}

#[rustler::nif]
fn stream_close(resource: ResourceArc<StreamResource>) -> Atom {
    resource.stream.free();
    atoms::ok()
}

#[derive(NifMap)]
pub struct StreamInfo {
    device: Atom,
    index: i32,
    closed: bool,
}

#[rustler::nif]
fn stream_info(resource: ResourceArc<StreamResource>) -> NifResult<StreamInfo> {
    Ok(StreamInfo {
        device: match resource.kind {
            DeviceKind::Cpu => atoms::cpu(),
            DeviceKind::Gpu => atoms::gpu(),
        },
        index: resource.index,
        closed: resource.stream.is_freed(),
    })
}
