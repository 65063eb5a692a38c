//! The queue policy: which waiting request is prefilled next.

use super::*;

/// A waiting request passed over this many times is prefilled next,
/// however long its prompt.
const MAX_PASSED_OVER: usize = 8;

impl Scheduler {
    /// The waiting request to prefill next: the shortest prompt (the oldest
    /// among equals), so that a short request is not held behind the
    /// prefill of long ones; one passed over `MAX_PASSED_OVER` times goes
    /// first, so long prompts are not starved.
    pub(super) fn next_request(&mut self) -> Option<Request> {
        let i = self.next_index()?;
        Some(self.take_queued(i))
    }

    /// Where in the queue [`next_request`](Self::next_request) takes from.
    pub(super) fn next_index(&self) -> Option<usize> {
        self.queue
            .iter()
            .position(|r| r.passed_over >= MAX_PASSED_OVER)
            .or_else(|| (0..self.queue.len()).min_by_key(|&i| (self.queue[i].prompt.len(), i)))
    }

    /// Removes the queue's `i`-th request; the older ones it passed count it.
    pub(super) fn take_queued(&mut self, i: usize) -> Request {
        for older in self.queue.iter_mut().take(i) {
            older.passed_over += 1;
        }
        self.queue.remove(i).expect("a queued request")
    }

    pub(super) fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(Option::is_none)
    }
}
