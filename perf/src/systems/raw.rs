//! The raw writev baseline: the physical limit of this machine's loopback.
//!
//! A minimal server with no hub logic. Connections say `SUB\n` or `PUB\n` first. One thread
//! reads the publisher's pipelined frames (newline-delimited messages, exactly the bytes a
//! push subscriber receives) and writes each read batch to every subscriber socket with one
//! `writev` per subscriber per batch. A subscriber whose socket is full keeps at most
//! [`PENDING_CAP`] unsent bytes; past that whole batches are dropped for it (drop-newest), so a
//! stalled reader costs bounded memory and never stalls the others.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{request, Decoder, Stream, Wire};

/// Unsent bytes kept per subscriber before batches are dropped for it.
pub(crate) const PENDING_CAP: usize = 8 << 20;

/// The client side of the raw baseline.
#[derive(Debug, Default)]
pub(crate) struct RawWire;

impl Wire for RawWire {
    fn subscribe(&self, s: &mut dyn Stream, _topic: &str) -> io::Result<Vec<u8>> {
        request(s, b"SUB\n", "raw OK", |b| {
            b.starts_with(b"OK\n").then_some(3)
        })
    }

    fn hello_publisher(&self, s: &mut dyn Stream) -> io::Result<()> {
        request(s, b"PUB\n", "raw OK", |b| {
            b.starts_with(b"OK\n").then_some(3)
        })
        .map(drop)
    }

    fn encode_publish(&self, _topic: &str, msg: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(msg);
        out.push(b'\n');
    }

    fn decoder(&self) -> Box<dyn Decoder> {
        Box::new(LineDecoder { ping: None })
    }
}

/// Newline-delimited messages, optionally answering a keepalive line.
#[derive(Debug)]
pub(crate) struct LineDecoder {
    /// A line that is a keepalive ping, and the line that answers it.
    pub(crate) ping: Option<(&'static [u8], &'static [u8])>,
}

impl Decoder for LineDecoder {
    fn decode(
        &mut self,
        buf: &[u8],
        on_msg: &mut dyn FnMut(&[u8]),
        reply: &mut Vec<u8>,
    ) -> io::Result<usize> {
        let mut pos = 0;
        for nl in memchr::memchr_iter(b'\n', buf) {
            let line = &buf[pos..nl];
            match self.ping {
                Some((ping, pong)) if line == ping => reply.extend_from_slice(pong),
                _ => on_msg(line),
            }
            pos = nl + 1;
        }
        Ok(pos)
    }
}

struct Sub {
    stream: TcpStream,
    pending: Vec<u8>,
}

/// Write `pending` then `batch` with one writev; returns bytes written, or an error that means
/// the subscriber is gone.
fn writev2(fd: i32, a: &[u8], b: &[u8]) -> io::Result<usize> {
    let iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    loop {
        // SAFETY: both iovecs point into live slices that outlive the call; the kernel only
        // reads them.
        let n = unsafe { libc::writev(fd, iov.as_ptr(), 2) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(e),
        }
    }
}

impl Sub {
    /// Offer `batch` (complete frames); keeps what the socket did not take, within the cap.
    fn offer(&mut self, batch: &[u8]) -> io::Result<()> {
        let fd = self.stream.as_raw_fd();
        let n = writev2(fd, &self.pending, batch)?;
        if n < self.pending.len() {
            self.pending.drain(..n);
            if self.pending.len() + batch.len() <= PENDING_CAP {
                self.pending.extend_from_slice(batch);
            }
            return Ok(());
        }
        let taken = n - self.pending.len();
        self.pending.clear();
        if taken < batch.len() {
            // Keep the rest: a frame already started must be finished.
            self.pending.extend_from_slice(&batch[taken..]);
        }
        Ok(())
    }
}

/// Run the raw baseline server on `listen` until the process is killed. Prints
/// `LISTEN <addr>` on stdout once it accepts connections.
pub(crate) fn serve(listen: &str) -> io::Result<()> {
    let listener = TcpListener::bind(listen)?;
    println!("LISTEN {}", listener.local_addr()?);
    io::stdout().flush()?;
    serve_on(listener, &AtomicBool::new(false))
}

/// Serve on `listener` until `stop` is set.
pub(crate) fn serve_on(listener: TcpListener, stop: &AtomicBool) -> io::Result<()> {
    let (tx, rx) = crossbeam_channel::unbounded::<(bool, TcpStream)>();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { continue };
            let _ = s.set_nodelay(true);
            let mut hello = [0u8; 4];
            if s.read_exact(&mut hello).is_err() {
                continue;
            }
            let is_pub = &hello == b"PUB\n";
            if s.write_all(b"OK\n").is_err() || s.set_nonblocking(true).is_err() {
                continue;
            }
            if tx.send((is_pub, s)).is_err() {
                return;
            }
        }
    });

    let mut subs: Vec<Sub> = Vec::new();
    let mut publisher: Option<TcpStream> = None;
    let mut buf = vec![0u8; 1 << 20];
    let mut filled = 0;
    while !stop.load(Ordering::Relaxed) {
        let incoming = if publisher.is_none() && subs.iter().all(|s| s.pending.is_empty()) {
            rx.recv_timeout(Duration::from_millis(100)).ok()
        } else {
            rx.try_recv().ok()
        };
        if let Some((is_pub, s)) = incoming {
            if is_pub {
                publisher = Some(s);
                filled = 0;
            } else {
                subs.push(Sub {
                    stream: s,
                    pending: Vec::new(),
                });
            }
            continue;
        }
        // Wait for the publisher, and for subscribers with unsent bytes to take more.
        let mut fds: Vec<libc::pollfd> = Vec::new();
        if let Some(p) = &publisher {
            fds.push(libc::pollfd {
                fd: p.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let with_pending: Vec<usize> = (0..subs.len())
            .filter(|&i| !subs[i].pending.is_empty())
            .collect();
        for &i in &with_pending {
            fds.push(libc::pollfd {
                fd: subs[i].stream.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            });
        }
        if fds.is_empty() {
            continue;
        }
        // SAFETY: `fds` is a live, correctly sized array of pollfd for the call's duration.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 10) };
        if rc <= 0 {
            continue;
        }
        let mut batch_end = 0;
        if let Some(p) = publisher.as_mut() {
            if fds[0].revents != 0 {
                match p.read(&mut buf[filled..]) {
                    Ok(0) => publisher = None,
                    Ok(n) => {
                        filled += n;
                        batch_end = memchr::memrchr(b'\n', &buf[..filled]).map_or(0, |i| i + 1);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => publisher = None,
                }
            }
        }
        let batch = &buf[..batch_end];
        let mut dead = Vec::new();
        for (i, sub) in subs.iter_mut().enumerate() {
            if batch.is_empty() && sub.pending.is_empty() {
                continue;
            }
            if sub.offer(batch).is_err() {
                dead.push(i);
            }
        }
        for i in dead.into_iter().rev() {
            subs.swap_remove(i);
        }
        buf.copy_within(batch_end..filled, 0);
        filled -= batch_end;
        if filled == buf.len() {
            // A single message larger than the buffer: grow.
            buf.resize(buf.len() * 2, 0);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_decoder_hands_out_complete_lines_and_answers_the_keepalive() {
        let mut d = LineDecoder {
            ping: Some((b"{\"type\":\"ping\"}", b"{\"type\":\"pong\"}\n")),
        };
        let stream = b"{\"a\":1}\n{\"type\":\"ping\"}\n{\"b\":2}\n{\"c\"";
        let mut got = Vec::new();
        let mut reply = Vec::new();
        let n = d
            .decode(stream, &mut |m| got.push(m.to_vec()), &mut reply)
            .unwrap();
        assert_eq!(got, vec![b"{\"a\":1}".to_vec(), b"{\"b\":2}".to_vec()]);
        assert_eq!(reply, b"{\"type\":\"pong\"}\n");
        assert_eq!(&stream[n..], b"{\"c\"");
    }

    #[test]
    fn a_stalled_subscriber_costs_at_most_the_pending_cap_and_keeps_whole_frames() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let _reader = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (stream, _) = listener.accept().unwrap();
        stream.set_nonblocking(true).unwrap();
        let mut sub = Sub {
            stream,
            pending: Vec::new(),
        };
        let line = [b"y".repeat(99), b"\n".to_vec()].concat();
        let batch = line.repeat(10_000);
        for _ in 0..200 {
            sub.offer(&batch).unwrap();
            assert!(sub.pending.len() <= PENDING_CAP);
        }
        // Nothing was read: the kernel took what it could, the rest is bounded and ends on a
        // frame boundary.
        assert!(sub.pending.len() <= PENDING_CAP);
        assert_eq!(sub.pending.last(), Some(&b'\n'));
    }
}
