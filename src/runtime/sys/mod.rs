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
//! - The backend owns each connection's socket from [`Backend::add_conn`] to
//!   [`Backend::remove_conn`], which closes it; the shard names a connection by its token only.
//!   This lets io_uring keep sockets as direct descriptors (see [`uring`]), which take no slot in
//!   the process's descriptor table.
//! - At most one receive and one send (or one writability poll) are in flight per connection
//!   token.
//! - Receives land in the backend's own buffers, not the connection's: a pool of
//!   [`RECV_BUFS`] buffers of [`RECV_BUF_LEN`] bytes per shard (io_uring: a ring of provided
//!   buffers the kernel picks from when data arrives; epoll: a shard-wide pool read into when the
//!   socket is ready). A connection waiting for input holds no buffer. A receive that got bytes
//!   lends its buffer to the shard with the [`Event::Recv`] (`buf`); the shard reads it with
//!   [`Backend::recv_buf`], keeps what it needs (a partial message) and gives it back with
//!   [`Backend::release_buf`] before it calls [`Backend::wait`] again; a buffer a receive
//!   filled well it may take whole instead ([`Backend::take_buf`]), and a new one takes its
//!   place in the pool, so a full receive is decoded where the kernel wrote it. The backend
//!   never hands a lent buffer to the kernel, and frees the pool only after the kernel can no
//!   longer write to it. When every buffer is lent, a receive waits (it is retried by the next
//!   `wait`).
//! - A gather list (and the bytes it points to) handed to [`Backend::send`] stays valid and
//!   untouched until the matching [`Event`] is returned by [`Backend::wait`]. The shard
//!   guarantees this by owning it inside the connection and never freeing a connection while an
//!   operation on it is in flight (it shuts the socket down and waits for the completions first).
//!   `send` is `unsafe` for that reason.
//! - Accepting is re-armed by the backend itself after every accepted socket, until
//!   [`Backend::remove_listener`].
//! - [`Backend::wait`] also drains the shard's wake-up eventfd; a wake-up only ends the wait.
//! - Operations queued during a turn are submitted together by the next [`Backend::wait`] (one
//!   `io_uring_enter` for every connection's sends of the turn).

use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::time::Duration;

use bytes::BytesMut;

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

/// Identifies a receive buffer of a backend's pool, lent to the shard by an [`Event::Recv`].
pub(crate) type BufId = u16;

/// Bytes of one receive buffer: the most one receive takes. What one shard turn reads from a
/// publisher is one hub batch (one frame per subscriber), so this also sizes the batches of a
/// pipelining publisher. In the perf tool's fan-out to 100 subscribers, 32 KiB made twice the
/// sends of 64 KiB (34 M against 45 M deliveries/s with 64 B messages), and with 1 KiB messages
/// 128 KiB delivered 9.1 M/s against 7.5 M/s for 64 KiB. The pool is `RECV_BUFS` of these per
/// shard: 8 MiB of address space, of which only the pages receives write become resident.
pub(crate) const RECV_BUF_LEN: usize = 128 << 10;

/// Receive buffers per shard. A buffer is lent only from a receive's completion until the shard
/// has decoded it (within the same turn), so this bounds the receives completed per turn, not
/// the connections; only the pages a receive writes are touched.
pub(crate) const RECV_BUFS: u16 = 64;

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
        /// The buffer holding them, lent until [`Backend::release_buf`]; may be set whatever
        /// the result (give it back in every case).
        buf: Option<BufId>,
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

/// How long accepting pauses after [`accept_waiting`] ran out of descriptors or memory.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// What ended [`accept_waiting`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcceptEnd {
    /// Nothing more waits (`EAGAIN`): wait for the next readiness.
    Drained,
    /// The process ran out of descriptors or memory (reported as an [`Event::Accept`] error):
    /// try again after [`ACCEPT_BACKOFF`], not at once.
    Starved,
    /// The socket no longer listens (`EINVAL`: a drain shut it down, perhaps through another
    /// shard's descriptor of it): stop.
    Shut,
}

/// Accepts every connection waiting on listening socket `fd` (non-blocking, close-on-exec) as
/// [`Event::Accept`]s of `listener`. Every shard accepts on every listener, and several may try
/// at once: the kernel gives each connection to one of them, the others find `EAGAIN`.
pub(crate) fn accept_waiting(fd: RawFd, listener: usize, out: &mut Vec<Event>) -> AcceptEnd {
    loop {
        let flags = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
        // SAFETY: null address pointers ask the kernel not to report the peer address.
        match syscall!(accept4(
            fd,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            flags
        )) {
            Ok(conn) => out.push(Event::Accept {
                listener,
                result: Ok(conn),
            }),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return AcceptEnd::Drained,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return AcceptEnd::Shut,
            Err(e) => {
                // EMFILE and friends.
                out.push(Event::Accept {
                    listener,
                    result: Err(e),
                });
                return AcceptEnd::Starved;
            }
        }
    }
}

/// The contract of an IO backend. See the module documentation for the rules.
pub(crate) trait Backend {
    /// The backend's name for logs: `io_uring` or `epoll`.
    fn name(&self) -> &'static str;

    /// Starts accepting on a listening socket; accepting re-arms itself.
    fn add_listener(&mut self, listener: usize, fd: RawFd) -> io::Result<()>;

    /// Stops accepting on a listener. The caller closes the socket afterwards.
    fn remove_listener(&mut self, listener: usize, fd: RawFd);

    /// Takes over a connection socket under `token`. On error the socket is closed.
    fn add_conn(&mut self, token: Token, fd: OwnedFd) -> io::Result<()>;

    /// Forgets a connection and closes its socket. Only called when no receive, send or poll
    /// on it is in flight.
    fn remove_conn(&mut self, token: Token);

    /// Shuts down part or all of a connection (`shutdown(2)`); `Shutdown::Both` makes every
    /// operation in flight on it complete. epoll runs it at once; io_uring after the next
    /// submission, in the kernel's workers. Either way the connection may be removed, and its
    /// token given to a new connection, right after: the shutdown reaches only the old socket.
    fn shutdown(&mut self, token: Token, how: std::net::Shutdown);

    /// Starts a receive of at most [`RECV_BUF_LEN`] bytes into a buffer of the backend's pool.
    fn recv(&mut self, token: Token);

    /// The first `len` bytes of lent buffer `buf` (what its [`Event::Recv`] reported).
    fn recv_buf(&self, buf: BufId, len: usize) -> &[u8];

    /// Lent buffer `buf` with its first `len` bytes (what its [`Event::Recv`] reported), taken
    /// out of the pool as an owned buffer: the bytes are kept where the receive wrote them, and
    /// a new buffer takes the old one's place. Give `buf` back with
    /// [`release_buf`](Backend::release_buf) all the same (it names the new buffer).
    fn take_buf(&mut self, buf: BufId, len: usize) -> BytesMut;

    /// Gives lent buffer `buf` back to the pool. Call it for every buffer an [`Event::Recv`]
    /// lends, before the next [`wait`](Backend::wait).
    fn release_buf(&mut self, buf: BufId);

    /// Starts a send of the gather list described by `msg` (`sendmsg` with `MSG_NOSIGNAL`). It
    /// completes once, with what the socket took: a partial send asks for
    /// [`Event::Writable`] next. To a full socket, epoll's completes at once with `Ok(0)`;
    /// io_uring's waits in the kernel until the socket has room.
    ///
    /// # Safety
    /// `msg`, its iovec array and every byte range the iovecs point to must stay valid and
    /// unchanged until the matching [`Event::Send`] is returned by [`wait`](Backend::wait).
    unsafe fn send(&mut self, token: Token, msg: *const libc::msghdr);

    /// Asks for one [`Event::Writable`] when the socket can take bytes again (after a partial
    /// send). At most one in flight per connection, never together with a send.
    fn poll_writable(&mut self, token: Token);

    /// The [`Event::Writable`] that [`poll_writable`](Backend::poll_writable) asked for is wanted
    /// now, whether or not the socket can take bytes (the next send finds out): a readiness
    /// event comes only once much of the socket's buffer is free, which a slow reader may take
    /// seconds to free while it reads all along. Nothing when no such wait is in flight.
    fn hurry_writable(&mut self, token: Token);

    /// Submits what was queued, waits up to `timeout` (`None`: until something happens) for
    /// completions or a wake-up, and appends finished operations to `events`.
    fn wait(&mut self, timeout: Option<Duration>, events: &mut Vec<Event>) -> io::Result<()>;

    /// Hands what was queued to the kernel now, without waiting: io_uring runs the sends at
    /// submission. Nothing to do where operations start when they are queued (epoll).
    fn submit(&mut self) {}
}

/// `shutdown(2)`'s `how` for `how`.
pub(crate) fn shutdown_how(how: std::net::Shutdown) -> libc::c_int {
    match how {
        std::net::Shutdown::Read => libc::SHUT_RD,
        std::net::Shutdown::Write => libc::SHUT_WR,
        std::net::Shutdown::Both => libc::SHUT_RDWR,
    }
}

/// The CPU time the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`), in user and kernel
/// mode; `None` where the clock cannot be read.
pub(crate) fn thread_cpu_time() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a live, writable timespec for the duration of the call.
    syscall!(clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts)).ok()?;
    Some(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
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

/// The memory of a backend's receive buffers: [`RECV_BUFS`] heap buffers of [`RECV_BUF_LEN`]
/// bytes, not zeroed, so only the pages receives write become resident.
///
/// The backend owns them and hands their addresses to the kernel (io_uring) or to `recv`
/// (epoll); a buffer is read only while lent to the shard, when nothing writes it. A lent buffer
/// that a receive filled well can be [taken](RecvBufs::take) whole: its bytes become the
/// connection's input where they lie (the lines decoded from them share it, no copy), and a new
/// buffer takes its place in the pool.
pub(crate) struct RecvBufs {
    /// The buffers: each with `RECV_BUF_LEN` bytes of capacity and a length of zero (what a
    /// receive writes is in its spare capacity until it is taken).
    bufs: Vec<BytesMut>,
    /// Each buffer's address, from its spare capacity when it was made (`bufs` is not touched
    /// while the kernel may write a buffer; these pointers are what writes it).
    ptrs: Vec<std::ptr::NonNull<u8>>,
}

impl std::fmt::Debug for RecvBufs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBufs").finish_non_exhaustive()
    }
}

/// A new receive buffer and the address its receives write.
fn fresh_buf() -> (BytesMut, std::ptr::NonNull<u8>) {
    let mut buf = BytesMut::with_capacity(RECV_BUF_LEN);
    let ptr = std::ptr::NonNull::from(buf.spare_capacity_mut()).cast::<u8>();
    (buf, ptr)
}

impl RecvBufs {
    /// Allocates the buffers.
    pub(crate) fn new() -> RecvBufs {
        let (bufs, ptrs) = (0..RECV_BUFS).map(|_| fresh_buf()).unzip();
        RecvBufs { bufs, ptrs }
    }

    /// The address of buffer `buf`.
    pub(crate) fn ptr(&self, buf: BufId) -> *mut u8 {
        self.ptrs[usize::from(buf)].as_ptr()
    }

    /// The first `len` bytes of buffer `buf`.
    ///
    /// # Safety
    /// Nothing may write buffer `buf` while the returned slice lives (the buffer is lent to the
    /// shard: neither the kernel nor `recv` holds it), and its last receive wrote at least
    /// `len` bytes.
    pub(crate) unsafe fn get(&self, buf: BufId, len: usize) -> &[u8] {
        let ptr = self.ptr(buf);
        // SAFETY: the range is inside the buffer's capacity (`len` is clamped to a buffer), the
        // caller guarantees that a receive wrote it (so it is initialised) and that nothing
        // writes it now.
        unsafe { std::slice::from_raw_parts(ptr, len.min(RECV_BUF_LEN)) }
    }

    /// Buffer `buf` with its first `len` bytes, taken out of the pool: a new buffer takes its
    /// place (give `buf` back as usual; it names the new one).
    ///
    /// # Safety
    /// As for [`get`](Self::get): the buffer is lent, and its last receive wrote at least `len`
    /// bytes.
    pub(crate) unsafe fn take(&mut self, buf: BufId, len: usize) -> BytesMut {
        let (fresh, ptr) = fresh_buf();
        let i = usize::from(buf);
        self.ptrs[i] = ptr;
        let mut taken = std::mem::replace(&mut self.bufs[i], fresh);
        // SAFETY: `len` is clamped to the capacity (`RECV_BUF_LEN`), and the caller guarantees
        // that a receive initialised those bytes.
        unsafe { taken.set_len(len.min(RECV_BUF_LEN)) };
        taken
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    use super::*;

    /// Arms a receive on more sockets than there are buffers, all with data waiting, and checks
    /// that no more buffers are lent than the pool holds, that each receive gets its own bytes,
    /// and that the receives that found the pool empty complete once buffers are given back.
    fn receives_beyond_the_pool_wait_for_a_buffer_and_then_complete(backend: &mut dyn Backend) {
        const SOCKETS: usize = RECV_BUFS as usize * 3 + 5;
        let pairs: Vec<(UnixStream, UnixStream)> = (0..SOCKETS)
            .map(|_| UnixStream::pair().expect("socketpair"))
            .collect();
        for (i, (ours, peer)) in pairs.iter().enumerate() {
            ours.set_nonblocking(true).unwrap();
            (&*peer)
                .write_all(format!("message {i}").as_bytes())
                .unwrap();
            let ours = ours.try_clone().expect("dup").into();
            backend.add_conn(i as Token, ours).unwrap();
            backend.recv(i as Token);
        }
        let mut got = vec![None; SOCKETS];
        let mut events = Vec::new();
        for _ in 0..100 {
            if got.iter().all(Option::is_some) {
                break;
            }
            backend
                .wait(Some(Duration::from_millis(50)), &mut events)
                .unwrap();
            let lent: Vec<BufId> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Recv { buf, .. } => *buf,
                    _ => None,
                })
                .collect();
            assert!(
                lent.len() <= RECV_BUFS as usize,
                "{} buffers lent",
                lent.len()
            );
            let mut distinct = lent.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), lent.len(), "a buffer lent twice");
            for event in events.drain(..) {
                if let Event::Recv { token, result, buf } = event {
                    let n = result.expect("receive succeeds");
                    let buf = buf.expect("a receive with bytes lends a buffer");
                    let text = String::from_utf8(backend.recv_buf(buf, n).to_vec()).unwrap();
                    assert_eq!(text, format!("message {token}"));
                    assert!(
                        got[token as usize].replace(text).is_none(),
                        "one completion"
                    );
                    backend.release_buf(buf);
                }
            }
        }
        assert!(got.iter().all(Option::is_some), "every receive completed");
        for i in 0..SOCKETS {
            backend.remove_conn(i as Token);
        }
    }

    /// The next receive to complete (its token, result and lent buffer, which the caller gives
    /// back), waited for up to 5 s; `None` if none completed.
    fn next_receive(
        backend: &mut dyn Backend,
    ) -> Option<(Token, io::Result<usize>, Option<BufId>)> {
        let mut events = Vec::new();
        for _ in 0..100 {
            backend
                .wait(Some(Duration::from_millis(50)), &mut events)
                .unwrap();
            if let Some(Event::Recv { token, result, buf }) = events
                .drain(..)
                .find(|event| matches!(event, Event::Recv { .. }))
            {
                return Some((token, result, buf));
            }
        }
        None
    }

    /// Shuts a connection down, removes it and gives its token to a new connection before the
    /// shutdown has run (io_uring runs it later, in the kernel's workers): the new connection is
    /// not shut down (its receive gets its peer's bytes), and the old one is.
    fn a_token_reused_right_after_a_shutdown_leaves_the_new_connection_open(
        backend: &mut dyn Backend,
    ) {
        use std::io::Read;
        let (old, old_peer) = UnixStream::pair().expect("socketpair");
        let (new, new_peer) = UnixStream::pair().expect("socketpair");
        old.set_nonblocking(true).unwrap();
        new.set_nonblocking(true).unwrap();
        backend.add_conn(0, old.into()).unwrap();
        backend.shutdown(0, std::net::Shutdown::Both);
        backend.remove_conn(0);
        backend.add_conn(0, new.into()).unwrap();
        backend.recv(0);
        (&new_peer).write_all(b"still open").unwrap();
        let got = next_receive(backend).map(|(token, result, buf)| {
            assert_eq!(token, 0);
            let n = result.expect("the new connection's receive succeeds");
            let buf = buf.expect("bytes lend a buffer");
            let got = backend.recv_buf(buf, n).to_vec();
            backend.release_buf(buf);
            got
        });
        assert_eq!(got.as_deref(), Some(&b"still open"[..]));
        old_peer
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(
            (&old_peer).read(&mut [0u8; 8]).unwrap(),
            0,
            "the old connection was shut down"
        );
        backend.remove_conn(0);
    }

    /// Takes the buffer of every receive on one connection, more receives than the pool has
    /// buffers: each taken buffer keeps its own bytes while the receives after it fill the
    /// buffers that took its place in the pool.
    fn a_taken_buffer_keeps_its_bytes_while_the_pool_receives_on(backend: &mut dyn Backend) {
        let (ours, peer) = UnixStream::pair().expect("socketpair");
        ours.set_nonblocking(true).unwrap();
        backend.add_conn(0, ours.into()).unwrap();
        let rounds = RECV_BUFS as usize * 2 + 3;
        let mut taken = Vec::new();
        for round in 0..rounds {
            (&peer)
                .write_all(format!("receive {round}").as_bytes())
                .unwrap();
            backend.recv(0);
            let (_, result, buf) =
                next_receive(backend).unwrap_or_else(|| panic!("receive {round} completed"));
            let n = result.expect("receive succeeds");
            let buf = buf.expect("a receive with bytes lends a buffer");
            taken.push(backend.take_buf(buf, n));
            backend.release_buf(buf);
        }
        for (round, bytes) in taken.iter().enumerate() {
            assert_eq!(&bytes[..], format!("receive {round}").as_bytes());
        }
        backend.remove_conn(0);
    }

    /// A connection `0` whose socket's buffer is full, and its peer.
    fn full_socket(backend: &mut dyn Backend) -> UnixStream {
        let (ours, peer) = UnixStream::pair().expect("socketpair");
        ours.set_nonblocking(true).unwrap();
        let chunk = [7u8; 4096];
        while (&ours).write(&chunk).is_ok() {}
        backend.add_conn(0, ours.into()).unwrap();
        peer
    }

    /// Reads everything the peer has been sent so far.
    fn drain_peer(peer: &mut UnixStream) {
        use std::io::Read;
        let mut sink = vec![0u8; 1 << 20];
        peer.set_nonblocking(true).unwrap();
        while peer.read(&mut sink).is_ok_and(|n| n > 0) {}
    }

    /// The next event, waited for up to `ms` milliseconds; `None` if none came.
    fn next_event(backend: &mut dyn Backend, ms: u64) -> Option<Event> {
        let mut events = Vec::new();
        for _ in 0..ms.div_ceil(10) {
            backend
                .wait(Some(Duration::from_millis(10)), &mut events)
                .unwrap();
            if !events.is_empty() {
                return Some(events.remove(0));
            }
        }
        None
    }

    /// A writability wait on a full socket ends when the peer reads, or at once when hurried
    /// (`hurry_writable`), the socket still full; one event each. (epoll takes a socket as
    /// writable until a send finds it full: one does first there, as in the shard.)
    fn a_hurried_writability_wait_ends_at_once(backend: &mut dyn Backend, epoll: bool) {
        let mut peer = if epoll {
            a_send_to_a_full_socket(backend, true)
        } else {
            full_socket(backend)
        };
        backend.poll_writable(0);
        assert!(next_event(backend, 200).is_none(), "the socket is full");
        backend.hurry_writable(0);
        assert!(matches!(
            next_event(backend, 5000),
            Some(Event::Writable { token: 0 })
        ));
        assert!(next_event(backend, 200).is_none(), "one event");
        backend.poll_writable(0);
        drain_peer(&mut peer);
        assert!(matches!(
            next_event(backend, 5000),
            Some(Event::Writable { token: 0 })
        ));
        backend.remove_conn(0);
    }

    /// A send to a full socket: on epoll it completes at once with nothing taken (`Ok(0)`), so
    /// that the shard sees the peer behind; on io_uring it waits in the kernel for room and
    /// completes once the peer reads. Either way it completes once, with what was taken.
    fn a_send_to_a_full_socket(backend: &mut dyn Backend, at_once: bool) -> UnixStream {
        let mut peer = full_socket(backend);
        let mut data = [1u8; 1024];
        let mut iov = libc::iovec {
            iov_base: data.as_mut_ptr().cast(),
            iov_len: data.len(),
        };
        // SAFETY: a zeroed msghdr is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        // SAFETY: `msg`, `iov` and `data` outlive the send's completion, awaited below.
        unsafe { backend.send(0, &msg) };
        if at_once {
            match next_event(backend, 5000) {
                Some(Event::Send {
                    token: 0,
                    result: Ok(0),
                }) => {}
                other => panic!("expected a send of nothing, got {other:?}"),
            }
        } else {
            assert!(next_event(backend, 200).is_none(), "waits for room");
            drain_peer(&mut peer);
            match next_event(backend, 5000) {
                Some(Event::Send {
                    token: 0,
                    result: Ok(n),
                }) => assert!(n > 0),
                other => panic!("expected the send's completion, got {other:?}"),
            }
        }
        peer
    }

    #[test]
    fn epoll_a_hurried_writability_wait_ends_at_once() {
        on_epoll(|b| a_hurried_writability_wait_ends_at_once(b, true));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn io_uring_a_hurried_writability_wait_ends_at_once() {
        on_io_uring(4, |b| a_hurried_writability_wait_ends_at_once(b, false));
        on_io_uring(0, |b| a_hurried_writability_wait_ends_at_once(b, false));
    }

    #[test]
    fn epoll_a_send_to_a_full_socket_completes_at_once_with_nothing_taken() {
        on_epoll(|b| {
            a_send_to_a_full_socket(b, true);
            b.remove_conn(0);
        });
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn io_uring_a_send_to_a_full_socket_completes_once_the_peer_reads() {
        on_io_uring(4, |b| {
            a_send_to_a_full_socket(b, false);
            b.remove_conn(0);
        });
    }

    /// Runs `check` on an epoll backend.
    fn on_epoll(check: fn(&mut dyn Backend)) {
        let waker = new_eventfd().unwrap();
        let mut backend = epoll::Epoll::new(waker).unwrap();
        check(&mut backend);
        drop(backend);
        let _ = syscall!(close(waker));
    }

    /// Runs `check` on an io_uring backend with a table of `direct` registered files, or says
    /// why it cannot.
    #[cfg(target_os = "linux")]
    fn on_io_uring(direct: usize, check: fn(&mut dyn Backend)) {
        if let Err(why) = uring::probe() {
            eprintln!("notice: io_uring unavailable ({why}); test skipped");
            return;
        }
        let waker = new_eventfd().unwrap();
        match uring::Uring::new(waker, direct) {
            Ok(mut backend) => check(&mut backend),
            Err(e) => eprintln!("notice: io_uring ring unavailable ({e}); test skipped"),
        }
        let _ = syscall!(close(waker));
    }

    #[test]
    fn epoll_a_token_reused_right_after_a_shutdown_leaves_the_new_connection_open() {
        on_epoll(a_token_reused_right_after_a_shutdown_leaves_the_new_connection_open);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn io_uring_a_token_reused_right_after_a_shutdown_leaves_the_new_connection_open() {
        on_io_uring(
            4,
            a_token_reused_right_after_a_shutdown_leaves_the_new_connection_open,
        );
    }

    #[test]
    fn epoll_a_taken_buffer_keeps_its_bytes_while_the_pool_receives_on() {
        on_epoll(a_taken_buffer_keeps_its_bytes_while_the_pool_receives_on);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn io_uring_a_taken_buffer_keeps_its_bytes_while_the_pool_receives_on() {
        on_io_uring(4, a_taken_buffer_keeps_its_bytes_while_the_pool_receives_on);
    }

    #[test]
    fn epoll_receives_beyond_the_pool_wait_for_a_buffer_and_then_complete() {
        on_epoll(receives_beyond_the_pool_wait_for_a_buffer_and_then_complete);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn io_uring_receives_beyond_the_pool_wait_for_a_buffer_and_then_complete() {
        // Half the sockets as direct descriptors, half as ordinary ones.
        on_io_uring(
            RECV_BUFS as usize * 3 / 2,
            receives_beyond_the_pool_wait_for_a_buffer_and_then_complete,
        );
    }
}
