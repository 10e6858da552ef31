//! What the kernel says about a server process: CPU time (`/proc/PID/stat` utime + stime),
//! resident memory (`/proc/PID/status` VmRSS), and CPU affinity of every thread.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// CPU seconds (user + system) the process has used so far.
pub(crate) fn cpu_seconds(pid: u32) -> io::Result<f64> {
    stat_cpu_seconds(&format!("/proc/{pid}/stat")).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => {
            io::Error::other(format!("the server's process {pid} has exited"))
        }
        _ => e,
    })
}

/// CPU time (user + system) of each thread of `pid` whose name (`comm`, at most 15 bytes)
/// starts with `prefix`, in seconds, by thread id.
pub(crate) fn thread_cpu_seconds(pid: u32, prefix: &str) -> io::Result<Vec<(u32, f64)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let dir = entry?.path();
        let Some(tid) = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let name = std::fs::read_to_string(dir.join("comm"))?;
        if name.starts_with(prefix) {
            out.push((tid, stat_cpu_seconds(&dir.join("stat").to_string_lossy())?));
        }
    }
    out.sort_by_key(|&(tid, _)| tid);
    Ok(out)
}

/// The CPU time of the process or thread whose `stat` file is at `path`.
fn stat_cpu_seconds(path: &str) -> io::Result<f64> {
    let stat = std::fs::read_to_string(path)?;
    // The command name (field 2) is in parentheses and may contain spaces: split after it.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| io::Error::other("malformed /proc/PID/stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3, utime field 14, stime field 15 (1-based).
    let parse = |i: usize| -> io::Result<f64> {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .ok_or_else(|| io::Error::other("malformed /proc/PID/stat"))
    };
    let ticks = parse(14 - 3)? + parse(15 - 3)?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

/// Resident set size in KiB.
pub(crate) fn rss_kib(pid: u32) -> io::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| io::Error::other("no VmRSS in /proc/PID/status"))
}

/// Pin every thread of `pid` (or, with `None`, of this process) to the given CPUs.
pub(crate) fn pin(pid: Option<u32>, cpus: &[usize]) -> io::Result<()> {
    let dir = match pid {
        Some(p) => format!("/proc/{p}/task"),
        None => "/proc/self/task".to_owned(),
    };
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `set` is a valid cpu_set_t and `c` is below CPU_SETSIZE on any machine we run.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    for entry in std::fs::read_dir(dir)? {
        let tid: libc::pid_t = match entry?.file_name().to_string_lossy().parse() {
            Ok(t) => t,
            Err(_) => continue,
        };
        // SAFETY: `set` is a valid cpu_set_t of the size passed; a vanished thread only makes
        // the call fail with ESRCH.
        let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Pin the calling thread to one CPU (threads it spawns inherit it).
pub(crate) fn pin_current(cpu: usize) -> io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t and `cpu` is below CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is valid for the size passed.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The hard limit on open files of this process.
pub(crate) fn nofile_hard() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    lim.rlim_max
}

/// Number of CPUs online (whatever this process is pinned to).
pub(crate) fn cpus() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(1).max(1)
}

/// Raise this process's open-file limit as far as it goes (as root, up to `want`).
pub(crate) fn raise_nofile(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    let raised = libc::rlimit {
        rlim_cur: want.max(lim.rlim_cur),
        rlim_max: want.max(lim.rlim_max),
    };
    // SAFETY: `raised` is a valid rlimit; failure (not root) leaves the limit unchanged.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        return raised.rlim_cur;
    }
    let soft = libc::rlimit {
        rlim_cur: lim.rlim_max,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &soft) };
    lim.rlim_max
}

/// Busy and total ticks (`/proc/stat`) summed over the CPUs this process may run on, so that
/// a case can tell how busy the load generator's CPUs were: time in interrupts and softirqs
/// (loopback receive processing) counts as busy though no process is charged with it.
pub(crate) fn own_cpus_ticks() -> io::Result<(u64, u64)> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is valid and writable for the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let stat = std::fs::read_to_string("/proc/stat")?;
    let (mut busy, mut total) = (0, 0);
    for line in stat.lines() {
        let Some((name, rest)) = line.split_once(' ') else {
            continue;
        };
        let Some(cpu) = name
            .strip_prefix("cpu")
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        // SAFETY: `set` is a valid cpu_set_t; `cpu` comes from /proc/stat and is below
        // CPU_SETSIZE.
        if cpu >= libc::CPU_SETSIZE as usize || !unsafe { libc::CPU_ISSET(cpu, &set) } {
            continue;
        }
        // user nice system idle iowait irq softirq steal ...
        let ticks: Vec<u64> = rest
            .split_whitespace()
            .take(8)
            .filter_map(|f| f.parse().ok())
            .collect();
        if ticks.len() < 8 {
            return Err(io::Error::other("malformed /proc/stat"));
        }
        let sum: u64 = ticks.iter().sum();
        total += sum;
        busy += sum - ticks[3] - ticks[4];
    }
    Ok((busy, total))
}

/// One RSS sample: seconds since the sampler started, KiB.
pub(crate) type RssPoint = (f64, u64);

/// Samples a process's RSS every `period` on a thread of its own until stopped.
#[derive(Debug)]
pub(crate) struct RssSampler {
    stop: Arc<AtomicBool>,
    points: Arc<Mutex<Vec<RssPoint>>>,
    handle: Option<JoinHandle<()>>,
}

impl RssSampler {
    pub(crate) fn start(pid: u32, period: Duration) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let points = Arc::new(Mutex::new(Vec::new()));
        let (s, p) = (stop.clone(), points.clone());
        let handle = std::thread::spawn(move || {
            let t0 = Instant::now();
            while !s.load(Ordering::Relaxed) {
                if let Ok(kib) = rss_kib(pid) {
                    p.lock()
                        .expect("sampler lock")
                        .push((t0.elapsed().as_secs_f64(), kib));
                }
                std::thread::sleep(period);
            }
        });
        RssSampler {
            stop,
            points,
            handle: Some(handle),
        }
    }

    /// Stop sampling and return the series.
    pub(crate) fn finish(mut self) -> Vec<RssPoint> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        std::mem::take(&mut *self.points.lock().expect("sampler lock"))
    }
}

/// Makes the process `cmd` starts end with the perf tool: it is sent `SIGKILL` when the tool
/// exits, however it exits (a signal, an abort, `timeout`, a cancelled CI job), so that no
/// server or helper outlives a run. Every spawn is made on the main thread, which lives as long
/// as the tool (the signal follows the thread that spawned, not the process).
pub(crate) fn die_with_tool(cmd: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    let tool = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec, and calls only `prctl` and
    // `getppid`, which are async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The tool may have gone between the fork and the prctl: then no signal comes.
            if libc::getppid() as u32 != tool {
                return Err(io::Error::other("the perf tool exited"));
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_cpu_and_rss() {
        let pid = std::process::id();
        assert!(cpu_seconds(pid).expect("stat") >= 0.0);
        assert!(rss_kib(pid).expect("status") > 0);
    }

    #[test]
    fn reads_the_ticks_of_its_own_cpus() {
        let (busy, total) = own_cpus_ticks().expect("/proc/stat");
        assert!(total > 0 && busy <= total, "{busy} of {total}");
    }
}
