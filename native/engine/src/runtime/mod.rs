//! What runs the work: MLX streams and their leases, device questions, memory,
//! host threads.

pub mod device;
pub mod memory;

/// Runs `f` on every job, on several threads where there are several jobs
/// and cores (constrained rows' masks, each row's grammar independent; a
/// grammar machinery's parts).
pub(crate) fn each_on_threads<T: Send>(
    jobs: &mut [T],
    f: impl Fn(&mut T) -> crate::error::Result<()> + Sync,
) -> crate::error::Result<()> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len());
    if threads <= 1 {
        return jobs.iter_mut().try_for_each(f);
    }
    let per_thread = jobs.len().div_ceil(threads);
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .chunks_mut(per_thread)
            .map(|part| scope.spawn(move || part.iter_mut().try_for_each(f)))
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    })
}
