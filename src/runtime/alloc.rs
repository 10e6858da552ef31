//! Returning free memory to the system.
//!
//! `powerhub serve` runs on mimalloc, which keeps freed pages to reuse them and purges them
//! lazily, when the thread that owns them next allocates or frees. A shard that just closed a
//! burst of connections holding hundreds of MiB of unsent output may then sit idle with all of
//! it resident. [`release_free_memory`] asks mimalloc to purge the calling thread's free pages
//! now. Where another allocator is the global one, mimalloc's heap is empty and the call costs
//! next to nothing.

/// Returns the calling thread's free mimalloc pages to the system (`mi_collect(true)`).
pub(crate) fn release_free_memory() {
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread at any time; it
    // only walks and purges the calling thread's own heap (and abandoned segments).
    unsafe { libmimalloc_sys::mi_collect(true) }
}
