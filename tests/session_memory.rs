//! What an idle connection's push session keeps on the heap once it has subscribed: the parser's
//! scratch buffers belong to the thread that parses (a shard parses for all its connections),
//! not to each session. Measured with a counting allocator; one test in this binary, so no other
//! test allocates meanwhile.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use bytes::Bytes;
use powerhub::protocol::{Session, SessionConfig};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counter only observes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded from the caller.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded from the caller.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Subscribes a session and sends it a command that needs the full parser, as a client does.
fn subscribed(id: u64) -> Session {
    let mut s = Session::new(id, SessionConfig::default());
    let mut sub = br#"{"type":"subscribe","id":1,"stream":"s"}"#.to_vec();
    drop(s.handle_line(&mut sub));
    let ping = s.parse(Bytes::from_static(br#"{"type":"ping","id":2}"#));
    drop(ping.map(|cmd| s.handle_command(cmd)));
    s
}

#[test]
fn a_subscribed_session_keeps_no_parser_buffers() {
    // The thread's parser is allocated once, by the first session.
    let first = subscribed(0);
    const N: usize = 200;
    let mut sessions = Vec::with_capacity(N);
    let before = LIVE.load(Ordering::Relaxed);
    for id in 1..=N as u64 {
        sessions.push(subscribed(id));
    }
    let per_session = (LIVE.load(Ordering::Relaxed) - before) / N as isize;
    // A subscription's ids and its list entry; no parser scratch.
    assert!(
        per_session < 512,
        "a subscribed session keeps {per_session} bytes on the heap"
    );
    drop((first, sessions));
}
