//! From requests to tokens: [`generate::Generation`] for a batch that starts
//! together, [`scheduler::Scheduler`] for requests that come and go.

pub mod generate;
mod request;
pub mod scheduler;
