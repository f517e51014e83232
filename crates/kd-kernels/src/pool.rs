//! Running work on rayon's global pool.

/// Runs `f` on a worker of rayon's global pool (here, when this thread is one already).
///
/// Work that makes many small parallel operations (a model's forward pass, a decoding loop)
/// should run this way: from a thread outside the pool, each operation hands its work to the
/// pool and sleeps until it is done (two context switches per operation), while from a worker
/// the operations fork and join inside the pool, the calling worker taking part.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

thread_local! {
    /// Whether this worker runs [`keep_awake`]'s work (a nested call keeps no more awake).
    static AWAKE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` on a worker of rayon's global pool, as [`on_pool`], with the pool's other workers
/// kept awake until it returns: each polls for work (its own, then other workers', as an idle
/// rayon worker does) instead of going to sleep when it finds none.
///
/// For work made of many small parallel operations with short serial stretches between them
/// (a decoding step: a few hundred fork-joins of tens of microseconds each), a worker that
/// fell asleep between two operations must be woken by a system call, which under a
/// hypervisor costs about as much as the operation saves. Here the other cores spin for as
/// long as `f` runs, as llama.cpp's threads do while it decodes; results are unchanged (which
/// thread runs a task never changes what it computes).
pub fn keep_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    on_pool(|| {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        if helpers == 0 || AWAKE.get() {
            return f();
        }
        let owner = rayon::current_thread_index();
        let done = AtomicBool::new(false);
        rayon::scope(|scope| {
            for _ in 0..helpers {
                scope.spawn(|_| {
                    // The owner may pop a helper it queued itself: it has `f` to finish.
                    if rayon::current_thread_index() == owner {
                        return;
                    }
                    while !done.load(Ordering::Acquire) {
                        if !matches!(rayon::yield_now(), Some(rayon::Yield::Executed)) {
                            std::hint::spin_loop();
                        }
                    }
                });
            }
            /// Marks this worker as the owner while it runs `f`; unmarks it and stops the
            /// helpers when `f` returns or unwinds.
            struct Owner<'a>(&'a AtomicBool);
            impl Drop for Owner<'_> {
                fn drop(&mut self) {
                    AWAKE.set(false);
                    self.0.store(true, Ordering::Release);
                }
            }
            AWAKE.set(true);
            let _owner = Owner(&done);
            f()
        })
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_work_runs_on_a_worker_and_returns_its_value() {
        assert_eq!(rayon::current_thread_index(), None);
        let index = super::on_pool(rayon::current_thread_index);
        assert!(index.is_some());
        // Nested: already on a worker, it runs in place.
        assert_eq!(super::on_pool(|| super::on_pool(|| 7)), 7);
    }

    #[test]
    fn keep_awake_returns_the_value_on_a_worker_and_nests() {
        assert_eq!(
            super::keep_awake(rayon::current_thread_index).map(|_| ()),
            Some(())
        );
        assert_eq!(super::keep_awake(|| super::keep_awake(|| 7)), 7);
        assert_eq!(super::on_pool(|| super::keep_awake(|| 8)), 8);
    }

    /// Parallel work inside runs to completion on pools of 1 to 4 workers (a helper queued
    /// by the owner and popped back by it returns at once instead of waiting for itself).
    #[test]
    fn keep_awake_runs_nested_parallel_work_on_any_pool_size() {
        use rayon::prelude::*;
        for threads in 1..=4 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let sum: u64 = pool.install(|| {
                super::keep_awake(|| {
                    (0..200u64)
                        .map(|i| {
                            let (a, b) = rayon::join(
                                || (0..i).into_par_iter().sum::<u64>(),
                                || (0..i).into_par_iter().map(|x| x * x).sum::<u64>(),
                            );
                            a + b
                        })
                        .sum()
                })
            });
            let expected: u64 = (0..200u64)
                .map(|i| (0..i).sum::<u64>() + (0..i).map(|x| x * x).sum::<u64>())
                .sum();
            assert_eq!(sum, expected, "{threads} threads");
        }
    }

    /// A panic in the work reaches the caller, and the worker is not left marked as running
    /// kept-awake work (its next call keeps the others awake again).
    #[test]
    fn keep_awake_passes_a_panic_on_and_unmarks_the_worker() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            let caught = std::panic::catch_unwind(|| super::keep_awake(|| panic!("inside")));
            assert!(caught.is_err());
            assert!(!super::AWAKE.get());
            assert!(super::keep_awake(|| super::AWAKE.get()));
            assert!(!super::AWAKE.get());
        });
    }
}
