//! IO backends: the contract every backend implements, and backend selection.
//!
//! A shard drives exactly one backend. The contract is completion-based (a *proactor*): the
//! shard asks the backend to receive into a buffer, to send a gather list, or to accept on a
//! listener, and later collects one [`Event`] per finished operation from [`Backend::wait`].
//! io_uring ([`uring`]) is completion-based natively; epoll ([`epoll`]) emulates the same contract
//! on top of readiness (it runs the syscall when the socket is ready and reports its result as a
//! completion), the way monoio's legacy driver does.
//!
//! Rules both backends follow, and the shard relies on:
//!
//! - At most one receive and one send (or one writability poll) are in flight per connection
//!   token.
//! - A buffer (or gather list and the bytes it points to) handed to [`Backend::recv`] or
//!   [`Backend::send`] stays valid and untouched until the matching [`Event`] is returned by
//!   [`Backend::wait`]. The shard guarantees this by owning the buffers inside the connection and
//!   never freeing a connection while an operation on it is in flight (it shuts the socket down and
//!   waits for the completions first). Both functions are `unsafe` for that reason.
//! - Accepting is re-armed by the backend itself after every accepted socket, until
//!   [`Backend::remove_listener`].
//! - [`Backend::wait`] also drains the shard's wake-up eventfd; a wake-up only ends the wait.
//! - Operations queued during a turn are submitted together by the next [`Backend::wait`] (one
//!   `io_uring_enter` for every connection's sends of the turn).

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

pub(crate) mod epoll;
#[cfg(target_os = "linux")]
pub(crate) mod uring;

/// Turns a libc call's `-1` into `io::Error::last_os_error()` (mio's `syscall!`).
macro_rules! syscall {
    ($fn: ident ( $($arg: expr),* $(,)* ) ) => {{
        #[allow(unused_unsafe)]
        // SAFETY: the caller of the macro passes arguments that satisfy the libc function's
        // contract; each call site documents why.
        let res = unsafe { libc::$fn($($arg, )*) };
        if res == -1 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(res)
        }
    }};
}
pub(crate) use syscall;

/// Identifies a connection inside one shard: its slot index.
pub(crate) type Token = u32;

/// A finished operation.
#[derive(Debug)]
pub(crate) enum Event {
    /// A listener accepted a socket (or failed to).
    Accept {
        /// The listener's index, as given to [`Backend::add_listener`].
        listener: usize,
        /// The accepted socket, non-blocking and close-on-exec.
        result: io::Result<RawFd>,
    },
    /// A receive finished: the byte count (0 = the peer closed its sending side).
    Recv {
        /// The connection.
        token: Token,
        /// Bytes received.
        result: io::Result<usize>,
    },
    /// The socket became writable after [`Backend::poll_writable`] (the drain event).
    Writable {
        /// The connection.
        token: Token,
    },
    /// A send finished: the byte count (may be less than offered).
    Send {
        /// The connection.
        token: Token,
        /// Bytes the kernel took.
        result: io::Result<usize>,
    },
}

/// The contract of an IO backend. See the module documentation for the rules.
pub(crate) trait Backend {
    /// The backend's name for logs: `io_uring` or `epoll`.
    fn name(&self) -> &'static str;

    /// Starts accepting on a listening socket; accepting re-arms itself.
    fn add_listener(&mut self, listener: usize, fd: RawFd) -> io::Result<()>;

    /// Stops accepting on a listener. The caller closes the socket afterwards.
    fn remove_listener(&mut self, listener: usize, fd: RawFd);

    /// Registers a connection socket under `token`.
    fn add_conn(&mut self, token: Token, fd: RawFd) -> io::Result<()>;

    /// Forgets a connection. Only called when no operation on it is in flight.
    fn remove_conn(&mut self, token: Token, fd: RawFd);

    /// Starts a receive of at most `len` bytes into `buf`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid for writes, and not be read or written by anyone else,
    /// until the matching [`Event::Recv`] is returned by [`wait`](Backend::wait).
    unsafe fn recv(&mut self, token: Token, fd: RawFd, buf: *mut u8, len: usize);

    /// Starts a send of the gather list described by `msg` (`sendmsg` with `MSG_NOSIGNAL`).
    ///
    /// # Safety
    /// `msg`, its iovec array and every byte range the iovecs point to must stay valid and
    /// unchanged until the matching [`Event::Send`] is returned by [`wait`](Backend::wait).
    unsafe fn send(&mut self, token: Token, fd: RawFd, msg: *const libc::msghdr);

    /// Asks for one [`Event::Writable`] when the socket can take bytes again (after a partial
    /// send). At most one in flight per connection, never together with a send.
    fn poll_writable(&mut self, token: Token, fd: RawFd);

    /// Submits what was queued, waits up to `timeout` (`None`: until something happens) for
    /// completions or a wake-up, and appends finished operations to `events`.
    fn wait(&mut self, timeout: Option<Duration>, events: &mut Vec<Event>) -> io::Result<()>;
}

/// Creates a non-blocking, close-on-exec eventfd used to wake a shard.
pub(crate) fn new_eventfd() -> io::Result<RawFd> {
    syscall!(eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC))
}

/// Wakes the shard that owns `fd` (an eventfd). Errors are ignored: EAGAIN means the counter is
/// already non-zero, which wakes the shard just the same.
pub(crate) fn wake_eventfd(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: `one` is a live 8-byte value for the duration of the call; `fd` is an eventfd
    // owned by a shard that outlives every handle that can call this.
    let _ = syscall!(write(fd, (&one as *const u64).cast(), 8));
}
