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
}
