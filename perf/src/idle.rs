//! The client side of the idle-connections scenario: helper processes that each open and hold
//! a share of the connections.
//!
//! Every connection costs the client a descriptor, and a process may open only so many
//! (`RLIMIT_NOFILE`). So that the client is never what caps a server, the connections of one
//! system are spread over helper processes (this binary run as `__idle-holder`), each holding at
//! most [`per_holder`] of them. A holder opens its share, says `opened N` (with the first error,
//! if any) on stdout, then every 200 ms reads what arrived on each connection and answers
//! keepalive pings (as it does while it opens them), until its stdin closes; then it says `alive M pongs P` and exits, closing
//! its connections.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::systems::{Decoder, SystemKind, Target};

/// Source addresses per `127.S.B.0/24` block. Each connection has its own source address:
/// binding port 0 before connect picks a port unique to the source address, so no address runs
/// out of ports, whatever earlier runs' closed connections (in TIME_WAIT) still hold.
const PER_BLOCK: usize = 250;

/// How often a holder reads its connections and answers their keepalives, while it opens them
/// and while it holds them.
const SERVE_EVERY: Duration = Duration::from_millis(200);

/// Descriptors a holder keeps for itself besides its connections.
const SPARE_FDS: u64 = 64;

/// The most connections one holder process opens: what its descriptor limit allows.
pub(crate) fn per_holder() -> usize {
    crate::procfs::raise_nofile(1 << 20);
    crate::procfs::nofile_hard()
        .saturating_sub(SPARE_FDS)
        .max(1) as usize
}

/// The loopback source address of connection `i` to system number `sys`.
fn source(sys: usize, i: usize) -> [u8; 4] {
    [
        127,
        1 + sys as u8,
        (i / PER_BLOCK) as u8,
        2 + (i % PER_BLOCK) as u8,
    ]
}

/// Connect from a chosen loopback source address (any of 127.0.0.0/8).
fn connect_from(src: [u8; 4], addr: SocketAddr) -> io::Result<TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    sock.bind(&SocketAddr::from((src, 0)).into())?;
    sock.connect_timeout(&addr.into(), Duration::from_secs(5))?;
    let s: TcpStream = sock.into();
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

/// One idle subscriber connection.
struct IdleConn {
    stream: TcpStream,
    buf: Vec<u8>,
    decoder: Box<dyn Decoder>,
    open: bool,
}

impl IdleConn {
    /// Read what arrived, answer keepalives; returns how many answers were written.
    fn serve(&mut self) -> u64 {
        let mut chunk = [0u8; 4096];
        let mut answered = 0;
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => self.open = false,
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    let mut reply = Vec::new();
                    match self.decoder.decode(&self.buf, &mut |_| {}, &mut reply) {
                        Ok(used) => {
                            self.buf.drain(..used);
                        }
                        Err(_) => self.open = false,
                    }
                    if !reply.is_empty() {
                        answered += 1;
                        if self.stream.write_all(&reply).is_err() {
                            self.open = false;
                        }
                    }
                    if self.open {
                        continue;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => self.open = false,
            }
            return answered;
        }
    }
}

/// The holder process: `__idle-holder SYSTEM ADDR SYS FIRST COUNT`.
pub(crate) fn holder_main(args: &[String]) -> ExitCode {
    match hold(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idle holder: {e}");
            ExitCode::FAILURE
        }
    }
}

fn hold(args: &[String]) -> io::Result<()> {
    let bad = |what: &str| io::Error::other(format!("bad argument: {what}"));
    let [kind, addr, sys, first, count] = args else {
        return Err(bad("expected SYSTEM ADDR SYS FIRST COUNT"));
    };
    let kind = SystemKind::parse(kind).ok_or_else(|| bad("SYSTEM"))?;
    let addr: SocketAddr = addr.parse().map_err(|_| bad("ADDR"))?;
    let sys: usize = sys.parse().map_err(|_| bad("SYS"))?;
    let first: usize = first.parse().map_err(|_| bad("FIRST"))?;
    let count: usize = count.parse().map_err(|_| bad("COUNT"))?;
    crate::procfs::raise_nofile(count as u64 + SPARE_FDS);
    let wire = kind.wire();
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            // Stop when the parent closes our stdin (or writes anything).
            let _ = io::stdin().read(&mut [0u8; 1]);
            stop.store(true, Ordering::Release);
        });
    }
    let mut conns: Vec<IdleConn> = Vec::with_capacity(count);
    let mut err = None;
    let mut pongs = 0u64;
    // Opening a share takes a while (tens of seconds for 100 000 connections on two CPUs): the
    // connections opened go on answering keepalives meanwhile, or a server's liveness timeout
    // would close them before the hold begins.
    let mut served = Instant::now();
    for i in first..first + count {
        if served.elapsed() >= SERVE_EVERY {
            for c in conns.iter_mut().filter(|c| c.open) {
                pongs += c.serve();
            }
            served = Instant::now();
        }
        let r = connect_from(source(sys, i), addr).and_then(|mut s| {
            let left = wire.subscribe(&mut s, "idle")?;
            s.set_nonblocking(true)?;
            Ok(IdleConn {
                stream: s,
                buf: left,
                decoder: wire.decoder(),
                open: true,
            })
        });
        match r {
            Ok(c) => conns.push(c),
            Err(e) => {
                // One line on stdout: what a refusal quotes may hold several.
                err = Some(format!("connection {i}: {e}").replace('\n', " | "));
                break;
            }
        }
    }
    let mut out = io::stdout().lock();
    match &err {
        Some(e) => writeln!(out, "opened {} error {e}", conns.len())?,
        None => writeln!(out, "opened {}", conns.len())?,
    }
    out.flush()?;
    loop {
        for c in conns.iter_mut().filter(|c| c.open) {
            pongs += c.serve();
        }
        if stop.load(Ordering::Acquire) {
            break;
        }
        std::thread::sleep(SERVE_EVERY);
    }
    let alive = conns.iter().filter(|c| c.open).count();
    writeln!(out, "alive {alive} pongs {pongs}")?;
    out.flush()
}

/// What a system's holders report once stopped.
#[derive(Debug, Default)]
pub(crate) struct Held {
    pub(crate) alive: usize,
    pub(crate) pongs: u64,
}

/// The holder processes of one system.
pub(crate) struct Holders {
    procs: Vec<(Child, Option<ChildStdin>, BufReader<ChildStdout>)>,
}

impl Holders {
    /// Starts holders for `k` connections to `t` (system number `sys`) and waits until each has
    /// opened its share. Returns them with the connections opened and the first error.
    pub(crate) fn open(
        t: &Target,
        sys: usize,
        k: usize,
    ) -> io::Result<(Holders, usize, Option<String>)> {
        let per = per_holder();
        let exe = std::env::current_exe()?;
        let mut procs = Vec::new();
        let mut first = 0;
        while first < k {
            let count = per.min(k - first);
            let mut child = crate::procfs::die_with_tool(&mut Command::new(&exe))
                .arg("__idle-holder")
                .arg(t.kind.name())
                .arg(t.addr.to_string())
                .arg(sys.to_string())
                .arg(first.to_string())
                .arg(count.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?;
            let stdin = child.stdin.take();
            let stdout = child
                .stdout
                .take()
                .ok_or_else(|| io::Error::other("idle holder: no stdout"))?;
            procs.push((child, stdin, BufReader::new(stdout)));
            first += count;
        }
        let mut holders = Holders { procs };
        let mut opened = 0;
        let mut err = None;
        for (_, _, out) in &mut holders.procs {
            let line = read_line(out)?;
            let rest = line
                .strip_prefix("opened ")
                .ok_or_else(|| io::Error::other(format!("idle holder said {line:?}")))?;
            let (n, e) = match rest.split_once(" error ") {
                Some((n, e)) => (n, Some(e.to_owned())),
                None => (rest, None),
            };
            opened += n
                .parse::<usize>()
                .map_err(|_| io::Error::other(format!("idle holder said {line:?}")))?;
            err = err.or(e);
        }
        Ok((holders, opened, err))
    }

    /// Stops the holders (their connections close) and sums what they report.
    pub(crate) fn stop(mut self) -> io::Result<Held> {
        let mut held = Held::default();
        for (_, stdin, _) in &mut self.procs {
            drop(stdin.take());
        }
        for (child, _, out) in &mut self.procs {
            let line = read_line(out)?;
            let parsed = line
                .strip_prefix("alive ")
                .and_then(|r| r.split_once(" pongs "))
                .and_then(|(a, p)| Some((a.parse::<usize>().ok()?, p.parse::<u64>().ok()?)));
            let (alive, pongs) =
                parsed.ok_or_else(|| io::Error::other(format!("idle holder said {line:?}")))?;
            held.alive += alive;
            held.pongs += pongs;
            child.wait()?;
        }
        self.procs.clear();
        Ok(held)
    }
}

impl Drop for Holders {
    fn drop(&mut self) {
        for (child, _, _) in &mut self.procs {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn read_line(out: &mut BufReader<ChildStdout>) -> io::Result<String> {
    let mut line = String::new();
    if out.read_line(&mut line)? == 0 {
        return Err(io::Error::other("idle holder exited early"));
    }
    Ok(line.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::source;

    #[test]
    fn every_connection_has_its_own_loopback_source_address() {
        let a: Vec<[u8; 4]> = (0..60_000).map(|i| source(0, i)).collect();
        let mut sorted = a.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 60_000, "one source address per connection");
        assert!(a.iter().all(|s| s[0] == 127 && s[1] == 1 && s[3] >= 2));
        assert_ne!(source(0, 5)[1], source(1, 5)[1]);
    }
}
