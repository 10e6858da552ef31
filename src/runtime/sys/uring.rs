//! The io_uring backend: the completion contract of [`super`], natively.
//!
//! One ring per shard. Receives, sends (`IORING_OP_SENDMSG` with `MSG_NOSIGNAL`), writability
//! polls (`IORING_OP_POLL_ADD`, the drain event after a partial send) and accepts are
//! pushed to the submission queue as the shard's turn produces them and reach the kernel together
//! in the next [`Backend::wait`]: one `io_uring_enter` submits every connection's sends of a turn
//! and waits for completions. The shard's wake-up eventfd is read by an `IORING_OP_READ` kept
//! armed on the ring, so a wake-up is just another completion.
//!
//! Every opcode used is probed once per process ([`probe`]), and the result cached in a
//! `OnceLock`; a kernel that refuses a ring, an opcode or the `EXT_ARG` wait makes the engine fall
//! back to epoll.
//!
//! # Buffer lifetimes
//!
//! The kernel reads and writes submitted buffers asynchronously, so each one must outlive its
//! operation:
//!
//! - Receive buffers, `msghdr`s, iovec arrays and the `Bytes` they point to belong to a boxed
//!   connection on the shard. The shard frees a connection only when no receive, send or poll on
//!   it is in flight; to end one early it shuts the socket down (`shutdown(SHUT_RDWR)`), which
//!   completes every pending operation, and waits for those completions.
//! - A shard leaves its loop only when it holds no connection, so no connection operation is in
//!   flight when the ring is dropped.
//! - Accepts pass no address buffer; polls pass none.
//! - The wake-up read's 8-byte buffer is leaked (8 bytes per shard): the ring's teardown in the
//!   kernel is asynchronous, so it is never freed.

use std::io;
use std::os::fd::RawFd;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring, Probe};

use super::{Backend, Event, Token};

const KIND_SHIFT: u32 = 56;
const KIND_RECV: u64 = 1;
const KIND_SEND: u64 = 2;
const KIND_ACCEPT: u64 = 3;
const KIND_WAKE: u64 = 4;
const KIND_POLL_OUT: u64 = 5;

/// How long accepting pauses after the kernel ran out of descriptors or memory.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Submission queue entries per ring (the completion queue is twice as large).
const ENTRIES: u32 = 1024;

fn user_data(kind: u64, index: u64) -> u64 {
    (kind << KIND_SHIFT) | index
}

/// Probes, once per process, whether io_uring can run this engine: a ring can be created, every
/// opcode the backend uses is supported and the kernel has the `EXT_ARG` wait. The error says
/// what is missing.
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
                (opcode::Accept::CODE, "ACCEPT"),
                (opcode::Recv::CODE, "RECV"),
                (opcode::SendMsg::CODE, "SENDMSG"),
                (opcode::Read::CODE, "READ"),
                (opcode::PollAdd::CODE, "POLL_ADD"),
            ] {
                if !probe.is_supported(code) {
                    return Err(format!("io_uring opcode {name} is not supported"));
                }
            }
            Ok(())
        })
        .clone()
}

/// The io_uring backend of one shard.
pub(crate) struct Uring {
    ring: IoUring,
    waker: RawFd,
    /// The eventfd read's 8-byte buffer. Leaked on purpose (8 bytes per shard): the kernel may
    /// still own it while the ring is torn down, so it is never freed.
    wake_buf: &'static mut u64,
    wake_armed: bool,
    listeners: Vec<Option<RawFd>>,
    /// Accepts in flight per listener (a removed listener's accept may still complete).
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
    /// Creates the ring and arms the wake-up read. Call [`probe`] first.
    pub(crate) fn new(waker: RawFd) -> io::Result<Uring> {
        // One thread submits and reaps (the shard's), so the kernel may run completion work
        // only when the shard asks for completions (`DEFER_TASKRUN`, Linux 6.1) instead of
        // interrupting it; older kernels refuse the flags and get a plain ring.
        let ring = IoUring::builder()
            .setup_cqsize(ENTRIES * 2)
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(ENTRIES)
            .or_else(|_| IoUring::builder().setup_cqsize(ENTRIES * 2).build(ENTRIES))?;
        let mut this = Uring {
            ring,
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
            if let Err(e) = self.ring.submit() {
                if e.raw_os_error() != Some(libc::EBUSY) && e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(error = %e, "io_uring submit failed");
                }
            }
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
        let entry = opcode::Accept::new(types::Fd(fd), std::ptr::null_mut(), std::ptr::null_mut())
            .flags(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC)
            .build()
            .user_data(user_data(KIND_ACCEPT, listener as u64));
        // SAFETY: null address pointers: the entry points to no memory of ours.
        unsafe { self.push(&entry) };
        self.accept_armed[listener] = true;
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
        // Wakes the armed accept with an error; it is not re-armed.
        // SAFETY: plain syscall on a socket the caller still owns.
        let _ = super::syscall!(shutdown(fd, libc::SHUT_RDWR));
    }

    fn add_conn(&mut self, _token: Token, _fd: RawFd) -> io::Result<()> {
        Ok(())
    }

    fn remove_conn(&mut self, _token: Token, _fd: RawFd) {}

    unsafe fn recv(&mut self, token: Token, fd: RawFd, buf: *mut u8, len: usize) {
        let len = len.min(u32::MAX as usize) as u32;
        let entry = opcode::Recv::new(types::Fd(fd), buf, len)
            .build()
            .user_data(user_data(KIND_RECV, u64::from(token)));
        // SAFETY: the caller keeps `buf` valid until the completion (contract of `Backend::recv`).
        unsafe { self.push(&entry) };
    }

    unsafe fn send(&mut self, token: Token, fd: RawFd, msg: *const libc::msghdr) {
        let entry = opcode::SendMsg::new(types::Fd(fd), msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(user_data(KIND_SEND, u64::from(token)));
        // SAFETY: the caller keeps `msg` and its buffers valid until the completion (contract of
        // `Backend::send`).
        unsafe { self.push(&entry) };
    }

    fn poll_writable(&mut self, token: Token, fd: RawFd) {
        let entry = opcode::PollAdd::new(types::Fd(fd), libc::POLLOUT as u32)
            .build()
            .user_data(user_data(KIND_POLL_OUT, u64::from(token)));
        // SAFETY: a poll points to no memory of ours.
        unsafe { self.push(&entry) };
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
                KIND_RECV => events.push(Event::Recv {
                    token: index as Token,
                    result,
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
                    let live = self.listeners.get(listener).is_some_and(Option::is_some);
                    if live {
                        let aborted = matches!(&result, Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED));
                        let starved = matches!(&result, Err(e) if matches!(
                            e.raw_os_error(),
                            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                        ));
                        if !aborted {
                            events.push(Event::Accept {
                                listener,
                                result: result.map(|fd| fd as RawFd),
                            });
                        }
                        if starved {
                            self.accept_later
                                .push((listener, Instant::now() + ACCEPT_BACKOFF));
                        } else {
                            rearm_accept.push(listener);
                        }
                    } else if let Ok(fd) = result {
                        // Accepted while the listener was being removed: refuse it.
                        // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
                        let _ = super::syscall!(close(fd as RawFd));
                    }
                }
                KIND_WAKE => {
                    self.wake_armed = false;
                    rearm_wake = true;
                }
                _ => {}
            }
        }
        if rearm_wake {
            self.arm_wake();
        }
        for listener in rearm_accept {
            self.arm_accept(listener);
        }
        Ok(())
    }
}
