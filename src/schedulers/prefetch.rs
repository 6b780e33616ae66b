//! A cache-line prefetch hint, shared by both engine cores' block and page pools.

/// Asks the CPU to start loading `x`'s cache line. A replay's pool operations touch blocks and
/// buckets spread over megabytes, in an order known a few steps ahead (the LRU list, a request's
/// blocks and hashes): starting those loads early overlaps their cache misses.
#[inline(always)]
pub fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint: it cannot fault, and nothing the program observes
    // changes. `x` is a valid reference in any case.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(x as *const T as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}
