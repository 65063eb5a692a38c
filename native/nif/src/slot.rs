//! A native object that an Elixir resource holds until it is freed by an
//! explicit call (`*_free`, `stream_close`) or with the resource. Freeing
//! early gives memory or a pooled stream back without waiting for the GC;
//! later calls get `gone` as their error.

use std::sync::{Mutex, MutexGuard};

use crate::error::{NifError, NifResult};

pub struct Slot<T> {
    value: Mutex<Option<T>>,
    /// The error of a call after the value was freed.
    gone: (&'static str, &'static str),
}

impl<T> Slot<T> {
    pub fn new(value: T, gone: (&'static str, &'static str)) -> Self {
        Slot {
            value: Mutex::new(Some(value)),
            gone,
        }
    }

    // A panic while holding the lock was already turned into an error for
    // that call; the value is still whole, so later calls may use it.
    fn lock(&self) -> MutexGuard<'_, Option<T>> {
        self.value.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the value, or fails once it was freed.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> NifResult<R>) -> NifResult<R> {
        match self.lock().as_mut() {
            Some(value) => f(value),
            None => Err(NifError::new(self.gone.0, self.gone.1)),
        }
    }

    /// Drops the value now.
    pub fn free(&self) {
        self.take();
    }

    /// Takes the value out, leaving the slot freed.
    pub fn take(&self) -> Option<T> {
        self.lock().take()
    }

    pub fn is_freed(&self) -> bool {
        self.lock().is_none()
    }
}
