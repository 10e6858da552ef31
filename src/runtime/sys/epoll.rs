//! The epoll backend: the completion contract of [`super`] emulated on readiness.
//!
//! Every socket is registered once, edge-triggered, for input, output and peer shutdown. The
//! backend remembers per connection whether the socket was last seen ready for reading and for
//! writing; an operation submitted while the socket is ready runs at once (the syscall's result
//! becomes a completion returned by the next `wait`), an operation that meets `EAGAIN` waits for
//! the next readiness edge. Edge-triggered mode is correct because a readiness flag is cleared
//! only by an `EAGAIN` seen from the socket itself.
//!
//! Receives read into a shard-wide pool of [`RecvBufs`], taken last-freed first (so a lightly
//! loaded shard keeps touching the same few pages) only when the socket is ready; a receive
//! that finds every buffer lent waits, and is retried by the next `wait`.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use bytes::BytesMut;

use super::{syscall, Backend, BufId, Event, RecvBufs, Token, RECV_BUFS, RECV_BUF_LEN};

/// `epoll_event.u64` of the wake-up eventfd.
const WAKER_KEY: u64 = u64::MAX;
/// Listener keys: this bit plus the listener index.
const LISTENER_BIT: u64 = 1 << 62;

#[derive(Debug)]
struct Slot {
    /// The socket, closed when the slot is dropped.
    sock: OwnedFd,
    readable: bool,
    writable: bool,
    /// A receive is pending.
    recv: bool,
    send: Option<*const libc::msghdr>,
    poll_out: bool,
}

/// The epoll backend of one shard.
#[derive(Debug)]
pub(crate) struct Epoll {
    epfd: RawFd,
    waker: RawFd,
    conns: Vec<Option<Slot>>,
    listeners: Vec<Option<RawFd>>,
    ready: Vec<Event>,
    buf: Vec<libc::epoll_event>,
    /// The receive buffers, and the ones not lent (the last freed on top).
    bufs: RecvBufs,
    free_bufs: Vec<BufId>,
    /// Connections whose receive found every buffer lent, retried by the next `wait`.
    starved: Vec<Token>,
    /// Listeners whose last accept failed for lack of resources, retried at the instant given
    /// (edge-triggered: no new edge may come while connections wait in the backlog).
    accept_later: Vec<(usize, Instant)>,
    /// The kernel has `epoll_pwait2` (nanosecond timeouts); cleared when it is refused.
    pwait2: bool,
}

// SAFETY: the raw pointers in `Slot` point into buffers owned by the shard's connections, and
// `bufs` into the backend's own buffers; the backend is created, used and dropped on the
// shard's thread only (it is moved there once, before any pointer is stored), so no pointer is
// ever dereferenced on another thread.
unsafe impl Send for Epoll {}

impl Epoll {
    /// `epoll_pwait2` with a nanosecond timeout where the kernel has it (Linux 5.11), else
    /// `epoll_wait` with the timeout rounded up to a millisecond (never polled a little early
    /// in a busy loop).
    fn epoll_wait(&mut self, timeout: Option<Duration>) -> io::Result<usize> {
        let (buf, len) = (self.buf.as_mut_ptr(), self.buf.len() as i32);
        if let Some(d) = timeout.filter(|_| self.pwait2) {
            let ts = libc::timespec {
                tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
                tv_nsec: d.subsec_nanos() as libc::c_long,
            };
            // SAFETY: `buf` is a live, initialised array of `len` events the kernel writes into;
            // `ts` is a valid timespec for the duration of the call; a null signal mask means
            // the mask is left as it is.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_epoll_pwait2,
                    self.epfd,
                    buf,
                    len,
                    &ts as *const libc::timespec,
                    std::ptr::null::<libc::sigset_t>(),
                    0usize,
                )
            };
            if rc >= 0 {
                return Ok(rc as usize);
            }
            let e = io::Error::last_os_error();
            // ENOSYS: an older kernel; EPERM: a seccomp filter that does not know the call.
            if !matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) {
                return Err(e);
            }
            self.pwait2 = false;
        }
        let ms = match timeout {
            None => -1,
            Some(d) => d.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32,
        };
        // SAFETY: as above.
        syscall!(epoll_wait(self.epfd, buf, len, ms)).map(|n| n as usize)
    }

    /// Creates an epoll instance and registers the shard's wake-up eventfd.
    pub(crate) fn new(waker: RawFd) -> io::Result<Epoll> {
        let epfd = syscall!(epoll_create1(libc::EPOLL_CLOEXEC))?;
        let mut this = Epoll {
            epfd,
            waker,
            conns: Vec::new(),
            listeners: Vec::new(),
            ready: Vec::new(),
            buf: vec![libc::epoll_event { events: 0, u64: 0 }; 1024],
            bufs: RecvBufs::new(),
            free_bufs: (0..RECV_BUFS).rev().collect(),
            starved: Vec::new(),
            accept_later: Vec::new(),
            pwait2: true,
        };
        this.ctl(
            libc::EPOLL_CTL_ADD,
            waker,
            libc::EPOLLIN as u32 | libc::EPOLLET as u32,
            WAKER_KEY,
        )?;
        Ok(this)
    }

    fn ctl(&mut self, op: i32, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: key };
        // SAFETY: `ev` lives across the call; the kernel copies it.
        syscall!(epoll_ctl(self.epfd, op, fd, &mut ev))?;
        Ok(())
    }

    fn try_recv(&mut self, token: Token) {
        let Some(slot) = self.conns.get_mut(token as usize).and_then(Option::as_mut) else {
            return;
        };
        if !slot.recv || !slot.readable {
            return;
        }
        let Some(buf) = self.free_bufs.pop() else {
            self.starved.push(token);
            return;
        };
        let ptr = self.bufs.ptr(buf);
        // SAFETY: `ptr..ptr+RECV_BUF_LEN` is a buffer of the pool that is not lent (it was in
        // `free_bufs`), so nothing else reads or writes it during the call.
        match syscall!(recv(slot.sock.as_raw_fd(), ptr.cast(), RECV_BUF_LEN, 0)) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                slot.readable = false;
                self.free_bufs.push(buf);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                self.free_bufs.push(buf);
                self.starved.push(token);
            }
            result => {
                slot.recv = false;
                let lent = matches!(result, Ok(n) if n > 0);
                if !lent {
                    self.free_bufs.push(buf);
                }
                self.ready.push(Event::Recv {
                    token,
                    result: result.map(|n| n as usize),
                    buf: lent.then_some(buf),
                });
            }
        }
    }

    fn try_send(&mut self, token: Token) {
        let Some(slot) = self.conns.get_mut(token as usize).and_then(Option::as_mut) else {
            return;
        };
        let Some(msg) = slot.send else { return };
        if !slot.writable {
            return;
        }
        // SAFETY: `msg` and the memory it describes are valid until the completion is reported
        // (the contract of `Backend::send`).
        match syscall!(sendmsg(slot.sock.as_raw_fd(), msg, libc::MSG_NOSIGNAL)) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // The socket took nothing: the send completes with 0 bytes, as io_uring's
                // does (`EAGAIN` on a non-blocking socket), so the shard learns that the peer
                // is behind and waits for the EPOLLOUT edge (`poll_writable`).
                slot.writable = false;
                slot.send = None;
                self.ready.push(Event::Send {
                    token,
                    result: Ok(0),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            result => {
                slot.send = None;
                // A short send on a non-blocking socket means its buffer is full: the next
                // `poll_writable` waits for the EPOLLOUT edge.
                // SAFETY: `msg` is valid (see above); only its iovec lengths are read.
                // (`msg_iovlen` is `usize` on glibc, `c_int` on musl: the cast is for the latter.)
                #[allow(clippy::unnecessary_cast)]
                let offered: usize = unsafe {
                    let m = &*msg;
                    std::slice::from_raw_parts(m.msg_iov, m.msg_iovlen as usize)
                        .iter()
                        .map(|v| v.iov_len)
                        .sum()
                };
                if matches!(result, Ok(n) if (n as usize) < offered) {
                    slot.writable = false;
                }
                self.ready.push(Event::Send {
                    token,
                    result: result.map(|n| n as usize),
                });
            }
        }
    }

    fn try_poll_out(&mut self, token: Token) {
        let Some(slot) = self.conns.get_mut(token as usize).and_then(Option::as_mut) else {
            return;
        };
        if slot.poll_out && slot.writable {
            slot.poll_out = false;
            self.ready.push(Event::Writable { token });
        }
    }

    fn accept_all(&mut self, listener: usize) {
        let Some(Some(fd)) = self.listeners.get(listener).copied() else {
            return;
        };
        if super::accept_waiting(fd, listener, &mut self.ready) == super::AcceptEnd::Starved {
            self.accept_later
                .push((listener, Instant::now() + super::ACCEPT_BACKOFF));
        }
    }
}

impl Backend for Epoll {
    fn name(&self) -> &'static str {
        "epoll"
    }

    fn add_listener(&mut self, listener: usize, fd: RawFd) -> io::Result<()> {
        if self.listeners.len() <= listener {
            self.listeners.resize(listener + 1, None);
        }
        self.listeners[listener] = Some(fd);
        // Every shard's epoll holds the listening socket: exclusive, so that a connection wakes
        // one shard waiting in `epoll_wait`, not all of them (one that is busy finds it in its
        // ready list and accepts until `EAGAIN`).
        self.ctl(
            libc::EPOLL_CTL_ADD,
            fd,
            (libc::EPOLLIN | libc::EPOLLET | libc::EPOLLEXCLUSIVE) as u32,
            LISTENER_BIT | listener as u64,
        )?;
        // Connections may have queued before registration: accept them now.
        self.accept_all(listener);
        Ok(())
    }

    fn remove_listener(&mut self, listener: usize, fd: RawFd) {
        let _ = self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0);
        if let Some(slot) = self.listeners.get_mut(listener) {
            *slot = None;
        }
    }

    fn add_conn(&mut self, token: Token, sock: OwnedFd) -> io::Result<()> {
        let idx = token as usize;
        if self.conns.len() <= idx {
            self.conns.resize_with(idx + 1, || None);
        }
        let fd = sock.as_raw_fd();
        let events = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32;
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, u64::from(token))?;
        self.conns[idx] = Some(Slot {
            sock,
            readable: true,
            writable: true,
            recv: false,
            send: None,
            poll_out: false,
        });
        Ok(())
    }

    fn remove_conn(&mut self, token: Token) {
        if let Some(slot) = self.conns.get_mut(token as usize).and_then(Option::take) {
            let _ = self.ctl(libc::EPOLL_CTL_DEL, slot.sock.as_raw_fd(), 0, 0);
            drop(slot.sock);
        }
    }

    fn shutdown(&mut self, token: Token, how: std::net::Shutdown) {
        if let Some(Some(slot)) = self.conns.get(token as usize) {
            let _ = syscall!(shutdown(slot.sock.as_raw_fd(), super::shutdown_how(how)));
        }
    }

    fn recv(&mut self, token: Token) {
        if let Some(Some(slot)) = self.conns.get_mut(token as usize) {
            debug_assert!(!slot.recv, "one receive in flight per connection");
            slot.recv = true;
            self.try_recv(token);
        }
    }

    fn recv_buf(&self, buf: BufId, len: usize) -> &[u8] {
        debug_assert!(!self.free_bufs.contains(&buf), "buffer {buf} is not lent");
        // SAFETY: `buf` is lent to the shard (the contract of `Backend::release_buf`): it is not
        // in `free_bufs`, so no `recv` writes it until it is given back.
        unsafe { self.bufs.get(buf, len) }
    }

    fn take_buf(&mut self, buf: BufId, len: usize) -> BytesMut {
        debug_assert!(!self.free_bufs.contains(&buf), "buffer {buf} is not lent");
        // SAFETY: as in `recv_buf`: lent, and `len` is what its `recv` returned.
        unsafe { self.bufs.take(buf, len) }
    }

    fn release_buf(&mut self, buf: BufId) {
        debug_assert!(
            !self.free_bufs.contains(&buf),
            "buffer {buf} released twice"
        );
        self.free_bufs.push(buf);
    }

    unsafe fn send(&mut self, token: Token, msg: *const libc::msghdr) {
        if let Some(Some(slot)) = self.conns.get_mut(token as usize) {
            debug_assert!(slot.send.is_none(), "one send in flight per connection");
            slot.send = Some(msg);
            self.try_send(token);
        }
    }

    fn poll_writable(&mut self, token: Token) {
        if let Some(Some(slot)) = self.conns.get_mut(token as usize) {
            slot.poll_out = true;
            self.try_poll_out(token);
        }
    }

    fn hurry_writable(&mut self, token: Token) {
        if let Some(Some(slot)) = self.conns.get_mut(token as usize) {
            if slot.poll_out {
                // The next send tries `sendmsg`; a full socket gives `EAGAIN`, and the send
                // waits for the EPOLLOUT edge as any other.
                slot.writable = true;
                self.try_poll_out(token);
            }
        }
    }

    fn wait(&mut self, timeout: Option<Duration>, events: &mut Vec<Event>) -> io::Result<()> {
        for token in std::mem::take(&mut self.starved) {
            self.try_recv(token);
        }
        let now = Instant::now();
        let mut timeout = timeout;
        for (listener, at) in std::mem::take(&mut self.accept_later) {
            if at <= now {
                self.accept_all(listener);
            } else {
                self.accept_later.push((listener, at));
                let left = at - now;
                timeout = Some(timeout.map_or(left, |t| t.min(left)));
            }
        }
        let timeout = if self.ready.is_empty() {
            timeout
        } else {
            Some(Duration::ZERO)
        };
        let n = match self.epoll_wait(timeout) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
            Err(e) => return Err(e),
        };
        for i in 0..n {
            let ev = self.buf[i];
            let (key, bits) = (ev.u64, ev.events);
            if key == WAKER_KEY {
                let mut value: u64 = 0;
                // SAFETY: `value` is a live 8-byte buffer; the eventfd is non-blocking.
                let _ = syscall!(read(self.waker, (&mut value as *mut u64).cast(), 8));
                continue;
            }
            if key & LISTENER_BIT != 0 {
                self.accept_all((key & !LISTENER_BIT) as usize);
                continue;
            }
            let token = key as Token;
            let hangup = bits & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0;
            if let Some(Some(slot)) = self.conns.get_mut(token as usize) {
                if hangup || bits & (libc::EPOLLIN | libc::EPOLLRDHUP) as u32 != 0 {
                    slot.readable = true;
                }
                if hangup || bits & libc::EPOLLOUT as u32 != 0 {
                    slot.writable = true;
                }
            }
            self.try_recv(token);
            self.try_send(token);
            self.try_poll_out(token);
        }
        events.append(&mut self.ready);
        Ok(())
    }
}

impl Drop for Epoll {
    fn drop(&mut self) {
        // SAFETY: `epfd` is owned by this backend and closed exactly once.
        let _ = syscall!(close(self.epfd));
    }
}
