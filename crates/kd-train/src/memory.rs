//! Process-wide allocator tuning for training binaries.

/// Makes glibc's allocator keep freed memory for reuse instead of handing it back to the
/// operating system: large buffers (logits, their gradients) are otherwise `mmap`ed fresh on
/// every step and the kernel zeroes every page again. Measured on the bench model's LoRA
/// step (2 cores): 148 → 196 tokens/s, the same peak RSS. Freed memory stays with the
/// process (RSS does not shrink after a peak).
///
/// Call it once at the start of a binary, before the first large allocation. A library
/// should leave this to the application. Returns whether the settings took effect (`false`
/// on other C libraries, where it does nothing).
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes allocator parameters; called before threads
        // allocate heavily, it is safe at any time per glibc's documentation.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    /// After the call a block far above glibc's mmap threshold comes from the heap, not from
    /// a fresh `mmap` (which the kernel would zero again on every step): the allocator's count
    /// of mmapped bytes does not grow while the block lives. Without the call it grows by the
    /// block's size.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn large_blocks_come_from_the_heap_afterwards() {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let mmapped = || unsafe { libc::mallinfo2() }.hblkhd;
        // Above glibc's largest dynamic mmap threshold (32 MiB), below the size of a thread
        // arena's heap (64 MiB): the test runs on a thread of the harness.
        let size = 48 << 20;
        let before = mmapped();
        // black_box: the compiler may otherwise elide an allocation nobody reads.
        let probe = std::hint::black_box(vec![1u8; size]);
        let during = mmapped();
        drop(probe);
        assert!(
            during >= before + size,
            "without the call a {size}-byte block is mmapped ({before} → {during})"
        );
        assert!(super::retain_freed_memory());
        let before = mmapped();
        let block = std::hint::black_box(vec![1u8; size]);
        assert!(mmapped() <= before, "the block was mmapped after the call");
        assert_eq!(block.iter().map(|b| *b as usize).sum::<usize>(), size);
    }

    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    #[test]
    fn does_nothing_elsewhere() {
        assert!(!super::retain_freed_memory());
    }
}
