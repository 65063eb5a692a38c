//! What runs the work: MLX streams and their leases, device questions, memory.

pub mod device;
pub mod memory;
