//! Keys and values of earlier positions: the contract the layers write
//! through ([`cache::KvStore`]), a batch's cache (preallocated, quantized,
//! or a rotating window), the scheduler's slots and the prefix cache shared
//! between requests.

pub mod cache;
pub mod prefix;
pub mod slots;
pub(crate) mod window;
