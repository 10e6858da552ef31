//! The io_uring backend: the completion contract of [`super`], natively.
//!
//! One ring per shard. Receives (`IORING_OP_RECV` with buffer select), sends (`IORING_OP_SENDMSG` with `MSG_NOSIGNAL`), writability
//! polls (`IORING_OP_POLL_ADD`, the drain event after a partial send, cancelled with
//! `IORING_OP_ASYNC_CANCEL` when the shard wants the event at once) and listeners' readiness
//! polls (each followed by `accept4` on the shard, see `arm_accept`) are pushed to the
//! submission queue as the shard's turn produces them and reach the kernel together
//! in the next [`Backend::wait`]: one `io_uring_enter` submits every connection's sends of a turn
//! and waits for completions. The shard's wake-up eventfd is read by an `IORING_OP_READ` kept
//! armed on the ring, so a wake-up is just another completion.
//!
//! Every opcode used is probed once per process ([`probe`]), and the result cached in a
//! `OnceLock`; a kernel that refuses a ring, an opcode, the `EXT_ARG` wait or a ring of provided
//! buffers makes the engine fall back to epoll.
//!
//! # Direct descriptors
//!
//! Each ring has a table of registered files (`IORING_REGISTER_FILES2`, sparse), as large as
//! the process may open descriptors (the soft `RLIMIT_NOFILE`, which the kernel also caps the
//! table by) and no larger than `limits.max_connections`. A connection whose token fits in the
//! table is moved into the table's slot of the same index when the shard takes it over
//! ([`Backend::add_conn`]: `IORING_REGISTER_FILES_UPDATE`, then the process's descriptor is
//! closed) and every operation on it names that slot (`IOSQE_FIXED_FILE`). Such a socket takes
//! no slot in the process's descriptor table, so the descriptor limit caps each shard's table
//! rather than the whole server: with two shards a server can hold twice as many connections as
//! it could open descriptors. The kernel also skips looking the descriptor up (and taking a
//! reference to the file) on every operation. A connection whose token lies beyond the table,
//! or any connection when the kernel refuses the table, keeps its ordinary descriptor.
//! Shutting down a direct descriptor is an `IORING_OP_SHUTDOWN` (an ordinary one is shut down
//! with the system call, at once); closing one empties its slot.
//! The kernel runs a shutdown in its worker threads and may look its slot up only there, so a
//! slot is never emptied, nor given to another connection, while a shutdown naming it is
//! pending: a connection removed meanwhile leaves its slot *retired* until the last shutdown
//! completes, and a new connection under that token keeps an ordinary descriptor.
//!
//! # Receive buffers
//!
//! Receives pass no buffer: they select one from a ring of provided buffers registered with the
//! kernel (`IORING_REGISTER_PBUF_RING`, Linux 5.19; a kernel without it makes the shard run
//! epoll). The kernel takes a buffer only when data arrives, so a connection waiting for input
//! holds none; the completion names the buffer taken, the shard reads it and gives it back,
//! which puts it at the ring's tail again. A receive that finds the ring empty (`ENOBUFS`: more
//! receives completed in one turn than there are buffers) is re-armed by the backend itself.
//!
//! # Buffer lifetimes
//!
//! The kernel reads and writes submitted buffers asynchronously, so each one must outlive its
//! operation:
//!
//! - The receive buffers and the buffer ring belong to the backend; a buffer the kernel filled
//!   is not put back in the ring until the shard gave it back. On drop, the ring of buffers is
//!   unregistered before its memory is freed (if that fails, the memory is leaked rather than
//!   freed under the kernel).
//! - `msghdr`s, iovec arrays and the `Bytes` they point to belong to a boxed connection on the
//!   shard. The shard frees a connection only when no receive, send or poll on
//!   it is in flight; to end one early it shuts the socket down (`shutdown(SHUT_RDWR)`), which
//!   completes every pending operation, and waits for those completions.
//! - A shard leaves its loop only when it holds no connection, so no connection operation is in
//!   flight when the ring is dropped.
//! - Polls pass no buffer.
//! - The wake-up read's 8-byte buffer is leaked (8 bytes per shard): the ring's teardown in the
//!   kernel is asynchronous, so it is never freed.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};

use super::{Backend, BufId, Event, RecvBufs, Token, RECV_BUFS, RECV_BUF_LEN};

const KIND_SHIFT: u32 = 56;
const KIND_RECV: u64 = 1;
const KIND_SEND: u64 = 2;
const KIND_ACCEPT: u64 = 3;
const KIND_WAKE: u64 = 4;
const KIND_POLL_OUT: u64 = 5;
/// A shutdown of a direct descriptor (its slot waits for it, see [`Uring::shutdowns`]).
const KIND_SHUTDOWN_DIRECT: u64 = 6;
/// The cancellation of a writability poll ([`Backend::hurry_writable`]); its own completion says
/// nothing the poll's does not.
const KIND_CANCEL: u64 = 7;

/// Submission queue entries per ring (the completion queue is twice as large).
const ENTRIES: u32 = 1024;

/// The kernel's largest table of registered files (`IORING_MAX_FIXED_FILES`).
const MAX_DIRECT: u32 = 1 << 20;

/// The soft limit of open descriptors (`RLIMIT_NOFILE`), which also caps a table of registered
/// files.
fn nofile_soft() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 0;
    }
    usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
}

/// The buffer group of the receive buffers.
const BGID: u16 = 0;

/// One entry of a provided-buffer ring (`struct io_uring_buf`). The `resv` field of the first
/// entry is the ring's tail, written by the application and read by the kernel.
#[repr(C)]
struct RingEntry {
    addr: u64,
    len: u32,
    bid: u16,
    resv: u16,
}

/// A ring of provided buffers registered with the kernel: [`RECV_BUFS`] entries, each naming one
/// buffer of a [`RecvBufs`].
struct BufRing {
    /// Page-aligned, zero-filled array of `RECV_BUFS` entries.
    entries: std::ptr::NonNull<RingEntry>,
    /// Entries published so far (wrapping; the kernel's view of the tail).
    tail: u16,
    bufs: RecvBufs,
}

impl BufRing {
    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(
            usize::from(RECV_BUFS) * std::mem::size_of::<RingEntry>(),
            4096,
        )
        .expect("a valid constant layout")
    }

    /// Allocates the buffers and the ring and registers the ring with `ring` as group [`BGID`],
    /// every buffer published.
    fn new(ring: &IoUring) -> io::Result<BufRing> {
        const _: () = assert!(RECV_BUFS.is_power_of_two());
        let bufs = RecvBufs::new();
        // SAFETY: the layout has a non-zero size.
        let entries = unsafe { std::alloc::alloc_zeroed(Self::layout()) };
        let Some(entries) = std::ptr::NonNull::new(entries.cast::<RingEntry>()) else {
            return Err(io::ErrorKind::OutOfMemory.into());
        };
        let mut this = BufRing {
            entries,
            tail: 0,
            bufs,
        };
        // SAFETY: `entries` is a page-aligned array of `RECV_BUFS` entries that stays allocated
        // until it is unregistered (see `Drop for Uring`) or the registration fails (then `this`
        // frees it on return, and the kernel never saw it).
        unsafe {
            ring.submitter().register_buf_ring_with_flags(
                entries.as_ptr() as u64,
                RECV_BUFS,
                BGID,
                0,
            )?;
        }
        for buf in 0..RECV_BUFS {
            this.publish(buf);
        }
        Ok(this)
    }

    /// Puts buffer `buf` at the ring's tail: the kernel may fill it from now on.
    fn publish(&mut self, buf: BufId) {
        let index = usize::from(self.tail & (RECV_BUFS - 1));
        let addr = self.bufs.ptr(buf) as u64;
        // SAFETY: `index < RECV_BUFS`, inside the entries array. The slot at the tail is not
        // read by the kernel until the tail moves past it. Only the `addr`, `len` and `bid`
        // fields are written: the first entry's `resv` is the tail, which the kernel reads.
        unsafe {
            let entry = self.entries.as_ptr().add(index);
            std::ptr::addr_of_mut!((*entry).addr).write(addr);
            std::ptr::addr_of_mut!((*entry).len).write(RECV_BUF_LEN as u32);
            std::ptr::addr_of_mut!((*entry).bid).write(buf);
        }
        self.tail = self.tail.wrapping_add(1);
        // SAFETY: the first entry's `resv` field is the ring's tail: a naturally aligned u16
        // inside the entries array, shared with the kernel, so it is accessed atomically only.
        let tail =
            unsafe { &*std::ptr::addr_of!((*self.entries.as_ptr()).resv).cast::<AtomicU16>() };
        // Release: the entry written above is visible to the kernel before the new tail.
        tail.store(self.tail, Ordering::Release);
    }
}

impl Drop for BufRing {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout, freed once; by now the ring is
        // unregistered or was never registered (see `Drop for Uring`).
        unsafe { std::alloc::dealloc(self.entries.as_ptr().cast(), Self::layout()) };
    }
}

/// A connection's socket, as the ring names it.
#[derive(Debug)]
enum Sock {
    /// No connection under this token.
    Empty,
    /// In the ring's table of registered files, at the token's index.
    Direct,
    /// An ordinary descriptor (the token lies beyond the table).
    Fd(OwnedFd),
}

/// Builds `$build` with `$fd` bound to the connection's file: a `types::Fixed` or a
/// `types::Fd`; `None` when there is no connection under `$token`.
macro_rules! on_sock {
    ($self:ident, $token:expr, |$fd:ident| $build:expr) => {
        match $self.socks.get($token as usize) {
            Some(Sock::Direct) => {
                let $fd = types::Fixed($token);
                Some($build)
            }
            Some(Sock::Fd(sock)) => {
                let $fd = types::Fd(sock.as_raw_fd());
                Some($build)
            }
            Some(Sock::Empty) | None => None,
        }
    };
}

fn user_data(kind: u64, index: u64) -> u64 {
    (kind << KIND_SHIFT) | index
}

/// Probes, once per process, whether io_uring can run this engine: a ring can be created, every
/// opcode the backend uses is supported, the kernel has the `EXT_ARG` wait and takes a ring of
/// provided buffers. The error says what is missing.
pub(crate) fn probe() -> Result<(), String> {
    static PROBED: OnceLock<Result<(), String>> = OnceLock::new();
    PROBED
        .get_or_init(|| {
            let ring = IoUring::new(8).map_err(|e| format!("io_uring_setup failed: {e}"))?;
            if !ring.params().is_feature_ext_arg() {
                return Err("the kernel lacks IORING_FEAT_EXT_ARG".into());
            }
            let mut probe = Probe::new();
            ring.submitter()
                .register_probe(&mut probe)
                .map_err(|e| format!("io_uring probe failed: {e}"))?;
            for (code, name) in [
                (opcode::Recv::CODE, "RECV"),
                (opcode::SendMsg::CODE, "SENDMSG"),
                (opcode::Read::CODE, "READ"),
                (opcode::PollAdd::CODE, "POLL_ADD"),
                (opcode::Shutdown::CODE, "SHUTDOWN"),
                (opcode::AsyncCancel::CODE, "ASYNC_CANCEL"),
            ] {
                if !probe.is_supported(code) {
                    return Err(format!("io_uring opcode {name} is not supported"));
                }
            }
            let bufs = BufRing::new(&ring).map_err(|e| {
                format!("io_uring provided-buffer rings (Linux 5.19) are not supported: {e}")
            })?;
            if ring.submitter().unregister_buf_ring(BGID).is_err() {
                // Never free memory the kernel may still know.
                std::mem::forget(bufs);
            }
            Ok(())
        })
        .clone()
}

/// The io_uring backend of one shard.
pub(crate) struct Uring {
    ring: IoUring,
    /// The receive buffers (`None` only during drop).
    bufs: Option<BufRing>,
    /// Each connection's socket, by token.
    socks: Vec<Sock>,
    /// Slots in the ring's table of registered files (0 when the kernel refused the table).
    direct: u32,
    /// Shutdowns pending per slot of the table (tokens with none are absent).
    shutdowns: HashMap<Token, u32>,
    /// Slots whose connection was removed while a shutdown naming it was pending: emptied when
    /// the last one completes, and given to no connection until then.
    retired: HashSet<Token>,
    waker: RawFd,
    /// The eventfd read's 8-byte buffer. Leaked on purpose (8 bytes per shard): the kernel may
    /// still own it while the ring is torn down, so it is never freed.
    wake_buf: &'static mut u64,
    wake_armed: bool,
    listeners: Vec<Option<RawFd>>,
    /// Readiness polls in flight per listener (a removed listener's may still complete).
    accept_armed: Vec<bool>,
    /// Listeners whose last accept failed for lack of resources (`EMFILE`, `ENFILE`, `ENOBUFS`,
    /// `ENOMEM`), re-armed at the given instant rather than at once (no busy loop).
    accept_later: Vec<(usize, Instant)>,
}

impl std::fmt::Debug for Uring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uring")
            .field("waker", &self.waker)
            .finish_non_exhaustive()
    }
}

impl Uring {
    /// Creates the ring with a table of at most `max_direct` registered files (see the module
    /// documentation) and arms the wake-up read. Call [`probe`] first.
    pub(crate) fn new(waker: RawFd, max_direct: usize) -> io::Result<Uring> {
        // One thread submits and reaps (the shard's), so the kernel may run completion work
        // only when the shard asks for completions (`DEFER_TASKRUN`, Linux 6.1) instead of
        // interrupting it; older kernels refuse the flags and get a plain ring.
        let ring = IoUring::builder()
            .setup_cqsize(ENTRIES * 2)
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(ENTRIES)
            .or_else(|_| IoUring::builder().setup_cqsize(ENTRIES * 2).build(ENTRIES))?;
        let bufs = BufRing::new(&ring)?;
        let direct = u32::try_from(max_direct.min(nofile_soft()))
            .unwrap_or(u32::MAX)
            .min(MAX_DIRECT);
        let direct = match ring.submitter().register_files_sparse(direct) {
            Ok(()) => direct,
            Err(e) => {
                if direct > 0 {
                    tracing::debug!(error = %e, "no table of registered files; ordinary descriptors");
                }
                0
            }
        };
        let mut this = Uring {
            ring,
            bufs: Some(bufs),
            socks: Vec::new(),
            direct,
            shutdowns: HashMap::new(),
            retired: HashSet::new(),
            waker,
            wake_buf: Box::leak(Box::new(0)),
            wake_armed: false,
            listeners: Vec::new(),
            accept_armed: Vec::new(),
            accept_later: Vec::new(),
        };
        this.arm_wake();
        Ok(this)
    }

    /// Pushes one entry, submitting the queue first if it is full.
    ///
    /// # Safety
    /// The memory the entry points to must stay valid until its completion is reaped.
    unsafe fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: forwarded from the caller.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return;
            }
            // The queue is full: hand what is queued to the kernel and retry.
            Backend::submit(self);
        }
    }

    /// Empties slot `token` of the table, closing the socket it held (once no operation holds
    /// it).
    fn empty_slot(&mut self, token: Token) {
        if let Err(e) = self.ring.submitter().register_files_update(token, &[-1]) {
            tracing::error!(error = %e, token, "cannot close a direct descriptor");
        }
    }

    fn arm_wake(&mut self) {
        let buf: *mut u64 = &mut *self.wake_buf;
        let entry = opcode::Read::new(types::Fd(self.waker), buf.cast(), 8)
            .build()
            .user_data(user_data(KIND_WAKE, 0));
        // SAFETY: `wake_buf` is leaked: it stays valid for as long as the kernel may use it.
        unsafe { self.push(&entry) };
        self.wake_armed = true;
    }

    fn arm_accept(&mut self, listener: usize) {
        let Some(Some(fd)) = self.listeners.get(listener).copied() else {
            return;
        };
        // A readiness poll, then `accept4` here: io_uring's own accept waits as an exclusive
        // waiter, so a connection would go to one ring only, and wait for that shard however
        // busy it is while the others idle. Every ring's poll is woken; the first free shard
        // accepts.
        let entry = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .build()
            .user_data(user_data(KIND_ACCEPT, listener as u64));
        // SAFETY: a poll points to no memory of ours.
        unsafe { self.push(&entry) };
        self.accept_armed[listener] = true;
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        // The buffer ring's memory may be freed only once the kernel forgot it.
        if let Some(bufs) = self.bufs.take() {
            if let Err(e) = self.ring.submitter().unregister_buf_ring(BGID) {
                tracing::error!(error = %e, "cannot unregister the receive buffers; leaking them");
                std::mem::forget(bufs);
            }
        }
    }
}

impl Backend for Uring {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn add_listener(&mut self, listener: usize, fd: RawFd) -> io::Result<()> {
        if self.listeners.len() <= listener {
            self.listeners.resize(listener + 1, None);
            self.accept_armed.resize(listener + 1, false);
        }
        self.listeners[listener] = Some(fd);
        self.arm_accept(listener);
        Ok(())
    }

    fn remove_listener(&mut self, listener: usize, fd: RawFd) {
        if let Some(slot) = self.listeners.get_mut(listener) {
            *slot = None;
        }
        // Wakes every shard's readiness poll on the socket with a hang-up; none is re-armed.
        // SAFETY: plain syscall on a socket the caller still owns.
        let _ = super::syscall!(shutdown(fd, libc::SHUT_RDWR));
    }

    fn add_conn(&mut self, token: Token, sock: OwnedFd) -> io::Result<()> {
        let idx = token as usize;
        if self.socks.len() <= idx {
            self.socks.resize_with(idx + 1, || Sock::Empty);
        }
        let direct = token < self.direct
            && !self.retired.contains(&token)
            && self
                .ring
                .submitter()
                .register_files_update(token, &[sock.as_raw_fd()])
                .is_ok_and(|n| n == 1);
        // A direct descriptor holds its own reference to the socket: the process's descriptor
        // is closed here, the socket when the slot is emptied.
        self.socks[idx] = if direct { Sock::Direct } else { Sock::Fd(sock) };
        Ok(())
    }

    fn remove_conn(&mut self, token: Token) {
        let Some(sock) = self.socks.get_mut(token as usize) else {
            return;
        };
        if let Sock::Direct = std::mem::replace(sock, Sock::Empty) {
            if self.shutdowns.contains_key(&token) {
                self.retired.insert(token);
            } else {
                self.empty_slot(token);
            }
        }
    }

    fn shutdown(&mut self, token: Token, how: std::net::Shutdown) {
        let how = super::shutdown_how(how);
        match self.socks.get(token as usize) {
            Some(Sock::Direct) => {
                let entry = opcode::Shutdown::new(types::Fixed(token), how)
                    .build()
                    .user_data(user_data(KIND_SHUTDOWN_DIRECT, u64::from(token)));
                // SAFETY: a shutdown points to no memory of ours.
                unsafe { self.push(&entry) };
                *self.shutdowns.entry(token).or_insert(0) += 1;
            }
            // An ordinary descriptor is shut down at once: a shutdown run later by the kernel's
            // workers could find the descriptor's number given to another socket by then.
            Some(Sock::Fd(sock)) => {
                let _ = super::syscall!(shutdown(sock.as_raw_fd(), how));
            }
            Some(Sock::Empty) | None => {}
        }
    }

    fn recv(&mut self, token: Token) {
        let Some(entry) = on_sock!(self, token, |fd| opcode::Recv::new(
            fd,
            std::ptr::null_mut(),
            RECV_BUF_LEN as u32
        )
        .buf_group(BGID)
        .build()
        .flags(squeue::Flags::BUFFER_SELECT)
        .user_data(user_data(KIND_RECV, u64::from(token)))) else {
            return;
        };
        // SAFETY: the entry points to no memory of ours but the registered buffer ring, which
        // the backend keeps until it is unregistered.
        unsafe { self.push(&entry) };
    }

    fn recv_buf(&self, buf: BufId, len: usize) -> &[u8] {
        let bufs = &self.bufs.as_ref().expect("buffers live until drop").bufs;
        // SAFETY: `buf` is lent to the shard (the contract of `Backend::release_buf`): the kernel
        // filled it and it is not in the ring again until `release_buf`, so nothing writes it.
        unsafe { bufs.get(buf, len) }
    }

    fn take_buf(&mut self, buf: BufId, len: usize) -> BytesMut {
        let bufs = &mut self.bufs.as_mut().expect("buffers live until drop").bufs;
        // SAFETY: as in `recv_buf`: lent (not in the ring), and `len` is what the kernel
        // reported. The new buffer reaches the ring only with `release_buf`.
        unsafe { bufs.take(buf, len) }
    }

    fn release_buf(&mut self, buf: BufId) {
        if let Some(ring) = self.bufs.as_mut() {
            ring.publish(buf);
        }
    }

    unsafe fn send(&mut self, token: Token, msg: *const libc::msghdr) {
        let Some(entry) = on_sock!(self, token, |fd| opcode::SendMsg::new(fd, msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(user_data(KIND_SEND, u64::from(token))))
        else {
            return;
        };
        // SAFETY: the caller keeps `msg` and its buffers valid until the completion (contract of
        // `Backend::send`).
        unsafe { self.push(&entry) };
    }

    fn poll_writable(&mut self, token: Token) {
        let Some(entry) = on_sock!(self, token, |fd| opcode::PollAdd::new(
            fd,
            libc::POLLOUT as u32
        )
        .build()
        .user_data(user_data(KIND_POLL_OUT, u64::from(token)))) else {
            return;
        };
        // SAFETY: a poll points to no memory of ours.
        unsafe { self.push(&entry) };
    }

    fn hurry_writable(&mut self, token: Token) {
        // The poll completes with `ECANCELED` (or has completed already: `ENOENT`), which is
        // its `Event::Writable` either way.
        let entry = opcode::AsyncCancel::new(user_data(KIND_POLL_OUT, u64::from(token)))
            .build()
            .user_data(user_data(KIND_CANCEL, u64::from(token)));
        // SAFETY: a cancellation points to no memory of ours.
        unsafe { self.push(&entry) };
    }

    fn submit(&mut self) {
        if let Err(e) = self.ring.submit() {
            if e.raw_os_error() != Some(libc::EBUSY) && e.kind() != io::ErrorKind::Interrupted {
                tracing::error!(error = %e, "io_uring submit failed");
            }
        }
    }

    fn wait(&mut self, timeout: Option<Duration>, events: &mut Vec<Event>) -> io::Result<()> {
        let now = Instant::now();
        let mut timeout = timeout;
        let mut i = 0;
        while i < self.accept_later.len() {
            let (listener, at) = self.accept_later[i];
            if at <= now {
                self.accept_later.swap_remove(i);
                self.arm_accept(listener);
            } else {
                let left = at - now;
                timeout = Some(timeout.map_or(left, |t| t.min(left)));
                i += 1;
            }
        }
        let result = match timeout {
            None => self.ring.submit_and_wait(1),
            Some(d) => {
                let ts = types::Timespec::from(d);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
        };
        match result {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME | libc::EINTR | libc::EBUSY)
                ) => {}
            Err(e) => return Err(e),
        }
        let mut rearm_wake = false;
        let mut rearm_accept = Vec::new();
        let mut rearm_recv = Vec::new();
        let mut empty = Vec::new();
        for cqe in self.ring.completion() {
            let data = cqe.user_data();
            let (kind, index) = (data >> KIND_SHIFT, data & ((1 << KIND_SHIFT) - 1));
            let res = cqe.result();
            let result = if res < 0 {
                Err(io::Error::from_raw_os_error(-res))
            } else {
                Ok(res as usize)
            };
            match kind {
                KIND_RECV if res == -libc::ENOBUFS => rearm_recv.push(index as Token),
                KIND_RECV => events.push(Event::Recv {
                    token: index as Token,
                    result,
                    buf: cqueue::buffer_select(cqe.flags()),
                }),
                KIND_SEND => events.push(Event::Send {
                    token: index as Token,
                    result,
                }),
                KIND_POLL_OUT => events.push(Event::Writable {
                    token: index as Token,
                }),
                KIND_ACCEPT => {
                    let listener = index as usize;
                    self.accept_armed[listener] = false;
                    let fd = self.listeners.get(listener).copied().flatten();
                    if let Some(fd) = fd {
                        let hung_up =
                            res > 0 && res & i32::from(libc::POLLHUP | libc::POLLERR) != 0;
                        match super::accept_waiting(fd, listener, events) {
                            // A listening socket that reports a hang-up was shut down (a
                            // drain, perhaps through another shard's descriptor of it).
                            super::AcceptEnd::Drained if !hung_up => rearm_accept.push(listener),
                            super::AcceptEnd::Starved => self
                                .accept_later
                                .push((listener, Instant::now() + super::ACCEPT_BACKOFF)),
                            _ => {}
                        }
                    }
                }
                KIND_WAKE => {
                    self.wake_armed = false;
                    rearm_wake = true;
                }
                KIND_SHUTDOWN_DIRECT => {
                    let token = index as Token;
                    if let Some(n) = self.shutdowns.get_mut(&token) {
                        *n -= 1;
                        if *n == 0 {
                            self.shutdowns.remove(&token);
                            if self.retired.remove(&token) {
                                empty.push(token);
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        for token in empty {
            self.empty_slot(token);
        }
        if rearm_wake {
            self.arm_wake();
        }
        for listener in rearm_accept {
            self.arm_accept(listener);
        }
        // Every buffer was taken: the shard gives them back before the next `wait` submits these.
        for token in rearm_recv {
            self.recv(token);
        }
        Ok(())
    }
}
