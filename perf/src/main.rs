//! `powerhub-perf`: the load generator and benchmark runner.
//!
//! Runs the scenarios of the performance plan by name against powerhub (`powerhub serve` and the
//! in-process hub), Redis, NATS and a raw writev baseline, all on loopback, and prints a table
//! per scenario with powerhub's ratio against each peer. `.hgrm` files and SVG plots go to the
//! results directory.
//!
//! ```text
//! perf/peers.sh run -- cargo run --release -p powerhub-perf -- --quick
//! ```

use std::io::{self, BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

mod clock;
mod idle;
mod inproc;
mod load;
mod payload;
mod procfs;
mod report;
mod rtt;
mod scenarios;
mod systems;
mod tls;

use scenarios::{Ctx, ScreensProfile};
use systems::{raw::RawWire, SystemKind, Target};

/// How the worker-thread budget is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Budget {
    /// Every server runs one worker thread pinned to the last CPU; the load generator is
    /// pinned to the others.
    Pinned,
    /// Servers run two worker threads; nothing is pinned.
    Unpinned,
}

/// Benchmarks powerhub side by side with Redis, NATS and a raw writev baseline.
#[derive(Debug, Parser)]
#[command(name = "powerhub-perf", version)]
struct Args {
    /// Scenarios to run (default: all): fanout, latency, rtt, slow-consumer, screens,
    /// idle-connections, scaling, in-process. Any run with a problem (a system not run, a
    /// message not delivered) lists it and exits non-zero.
    scenarios: Vec<String>,
    /// A smoke run that finishes in under two minutes.
    #[arg(long)]
    quick: bool,
    /// Systems to run, comma-separated: powerhub (default io backend: io_uring where the kernel
    /// allows it), powerhub-epoll, powerhub-auth (with `[auth]`), powerhub-tls, redis, nats,
    /// nats-tls, raw.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "powerhub,powerhub-epoll,redis,nats,raw"
    )]
    systems: Vec<String>,
    /// Redis address (as written by peers.sh).
    #[arg(long, env = "REDIS_ADDR")]
    redis: Option<SocketAddr>,
    /// Redis server process id.
    #[arg(long, env = "REDIS_PID")]
    redis_pid: Option<u32>,
    /// NATS address.
    #[arg(long, env = "NATS_ADDR")]
    nats: Option<SocketAddr>,
    /// NATS server process id.
    #[arg(long, env = "NATS_PID")]
    nats_pid: Option<u32>,
    /// The powerhub binary (default: target/release/powerhub of this workspace).
    #[arg(long, env = "POWERHUB_BIN")]
    powerhub_bin: Option<PathBuf>,
    /// Seconds a started powerhub server may take to print `ready` before the tool gives up
    /// on it (a binary that is not powerhub, or one that hangs).
    #[arg(long, allow_negative_numbers = true, default_value_t = 30.0, value_parser = positive_seconds)]
    ready_timeout: f64,
    /// Worker-thread budget.
    #[arg(long, value_enum, default_value = "pinned")]
    budget: Budget,
    /// Results directory (default: perf/results of this workspace).
    #[arg(long)]
    results: Option<PathBuf>,
    /// Warm-up seconds per case (fanout, latency, slow-consumer, scaling; default 2, 0.2 in
    /// quick mode).
    #[arg(long, allow_negative_numbers = true)]
    warmup: Option<f64>,
    /// Measured seconds per case (default 10, 0.8 in quick mode: fanout, latency, slow-consumer,
    /// scaling; screens runs 5 s,
    /// idle-connections holds 5 s, in-process runs a fixed number of deliveries).
    #[arg(long, allow_negative_numbers = true)]
    measure: Option<f64>,
    /// fanout: subscriber counts (default 1,10,100,1000; 10,100 in quick mode).
    #[arg(long, allow_negative_numbers = true, value_delimiter = ',')]
    subs: Option<Vec<usize>>,
    /// fanout: message sizes in bytes (default 64,1024; 64 in quick mode; at least the benchmark
    /// message's fixed fields, at most 8 MiB: NATS's `max_payload` as perf/peers.sh starts it).
    #[arg(long, allow_negative_numbers = true, value_delimiter = ',')]
    sizes: Option<Vec<usize>>,
    /// rtt: round trips per block (default 2000; 200 in quick mode); every system runs 6 blocks
    /// (2 in quick mode), taking turns.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    rtt_samples: Option<u64>,
    /// latency: subscribers (default 100; 10 in quick mode).
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    latency_subs: Option<u64>,
    /// latency: offered rates as fractions of the slowest system's fanout maximum (default
    /// 0.25,0.5,0.75; 0.5 in quick mode; above 1 offers more than that maximum).
    #[arg(long, allow_negative_numbers = true, value_delimiter = ',')]
    rates: Option<Vec<f64>>,
    /// idle-connections: connections to open per system (default 50000; 2000 in quick mode).
    #[arg(long, allow_negative_numbers = true)]
    idle: Option<usize>,
    /// screens: screenshot_update frames per device per second (1 to 30: at most one per
    /// hierarchy_update tick; default 30, 5 in quick mode).
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..=30))]
    shot_hz: Option<u64>,
    /// screens: number of devices (default 20; 4 in quick mode).
    #[arg(long, allow_negative_numbers = true)]
    devices: Option<usize>,
    /// in-process: subscriber counts (default 1,100,10000).
    #[arg(long, allow_negative_numbers = true, value_delimiter = ',')]
    inproc_subs: Option<Vec<usize>>,
    /// in-process: the systems to run (default: all), comma-separated: hub, hub-inline,
    /// receivers, receivers-borrowed, broadcast, crossbeam, flume.
    #[arg(long, value_delimiter = ',')]
    inproc_systems: Option<Vec<String>>,
    /// in-process: repetitions of each system's run, interleaved (the median is reported;
    /// default 3, 1 in quick mode).
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=101))]
    inproc_reps: Option<u32>,
    /// slow-consumer: the offered rate as a fraction of the slowest system's fanout maximum.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.5)]
    slow_fraction: f64,
    /// latency: the maximum, in messages/s, that the --rates fractions are taken of, instead of
    /// the slowest system's probed fanout maximum (no probes run): runs compare at fixed rates.
    #[arg(long, allow_negative_numbers = true)]
    latency_max: Option<f64>,
    /// slow-consumer: the offered rate in messages/s, instead of a fraction of the slowest
    /// maximum (no probes run): runs of different days compare at one rate.
    #[arg(long, allow_negative_numbers = true)]
    slow_rate: Option<f64>,
    /// slow-consumer: an A/A control. The "with slow" runs have no slow readers either, so their
    /// difference from the runs without is the method's own noise at these settings.
    #[arg(long)]
    slow_control: bool,
    /// Runs of every socket case (fanout, latency, slow-consumer, screens): throughput is the
    /// median run's (with an even number of runs, the slower of the middle two), latency percentiles come from the runs' merged histograms, CPU per
    /// delivery is pooled over the runs, and the note gives the runs' throughput range.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
    repeat: u32,
}

/// `--ready-timeout`: seconds, more than 0 and at most an hour.
fn positive_seconds(text: &str) -> Result<f64, String> {
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number of seconds"))?;
    if secs.is_finite() && secs > 0.0 && secs <= 3600.0 {
        Ok(secs)
    } else {
        Err(format!(
            "{text} seconds: must be more than 0 and at most 3600"
        ))
    }
}

fn start_raw() -> io::Result<Target> {
    let mut child = procfs::die_with_tool(&mut Command::new(std::env::current_exe()?))
        .args(["__raw-server", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| io::Error::other("raw server: no stdout"))?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("LISTEN ")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| io::Error::other(format!("raw server said {line:?}")))?;
    Ok(Target {
        kind: SystemKind::Raw,
        addr,
        pid: child.id(),
        wire: Arc::new(RawWire),
        backend: String::new(),
        child: Some(child),
        policies: Vec::new(),
        tls: None,
    })
}

/// `nats-server` with TLS on a free loopback port, configured as `perf/peers.sh` configures the
/// plaintext one (`max_payload`, `max_connections`, `GOMAXPROCS` = `PERF_THREADS`, default 1),
/// plus the run's test certificate.
fn start_nats_tls(files: Option<&tls::TlsFiles>, dir: &Path) -> io::Result<Target> {
    let files = files.ok_or_else(|| io::Error::other("no test certificate made"))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let conf = dir.join("nats-tls.conf");
    std::fs::write(
        &conf,
        format!(
            "max_payload: 8388608\nmax_connections: 100000\ntls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  timeout: 5\n}}\n",
            files.cert.display(),
            files.key.display()
        ),
    )?;
    let log = std::fs::File::create(dir.join("nats-tls.log"))?;
    let threads = std::env::var("PERF_THREADS").unwrap_or_else(|_| "1".to_owned());
    let child = procfs::die_with_tool(&mut Command::new("nats-server"))
        .arg("-c")
        .arg(&conf)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .env("GOMAXPROCS", threads)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot run nats-server (perf/peers.sh installs it): {e}"),
            )
        })?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let target = Target {
        kind: SystemKind::NatsTls,
        addr,
        pid: child.id(),
        wire: SystemKind::NatsTls.wire(),
        backend: String::new(),
        child: Some(child),
        policies: Vec::new(),
        tls: Some(Arc::clone(&files.client)),
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(addr).is_err() {
        if std::time::Instant::now() > deadline {
            return Err(io::Error::other(
                "nats-server (TLS) did not start listening",
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(target)
}

fn peer(kind: SystemKind, addr: Option<SocketAddr>, pid: Option<u32>) -> io::Result<Target> {
    let (Some(addr), Some(pid)) = (addr, pid) else {
        return Err(io::Error::other(format!(
            "{kind}: no address/pid given (start the peers with perf/peers.sh, or pass --{0} and --{0}-pid)",
            kind.name()
        )));
    };
    // Its CPU time is read from /proc/PID: a pid that names no process would fail every case.
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(io::Error::other(format!(
            "--{}-pid {pid}: no such process",
            kind.name()
        )));
    }
    Ok(Target {
        kind,
        addr,
        pid,
        wire: kind.wire(),
        backend: String::new(),
        child: None,
        policies: Vec::new(),
        tls: None,
    })
}

/// The report's "Systems": the servers the socket scenarios ran, the shard counts of `scaling`
/// (its own servers, unpinned) and the in-process systems, for the scenarios that ran.
fn systems_line(ctx: &Ctx, names: &[String]) -> String {
    let mut parts = Vec::new();
    if names.iter().any(|n| n != "in-process" && n != "scaling") {
        parts.push(if ctx.targets.is_empty() {
            "no server started (see Problems)".to_owned()
        } else {
            ctx.targets
                .iter()
                .map(|t| t.kind.name())
                .collect::<Vec<_>>()
                .join(", ")
        });
    }
    if names.iter().any(|n| n == "scaling") {
        parts.push(format!(
            "scaling: powerhub at 1 to {} shards, unpinned",
            procfs::cpus()
        ));
    }
    if names.iter().any(|n| n == "in-process") {
        parts.push(format!(
            "in-process {}",
            ctx.inproc_systems
                .as_deref()
                .map_or_else(|| inproc::SYSTEMS.join(", "), |s| s.join(", "))
        ));
    }
    parts.join("; ")
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().next().map(|l| {
                l.split_whitespace()
                    .nth(1)
                    .unwrap_or("0")
                    .parse::<u64>()
                    .unwrap_or(0)
            })
        })
        .unwrap_or(0);
    format!(
        "{} × {cpu}, {:.0} GiB RAM, Linux {}",
        procfs::cpus(),
        mem as f64 / 1024.0 / 1024.0,
        kernel.trim()
    )
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("__idle-holder") {
        return idle::holder_main(&argv[2..]);
    }
    if argv.get(1).map(String::as_str) == Some("__raw-server") {
        let listen = argv.get(2).map_or("127.0.0.1:0", String::as_str);
        return match systems::raw::serve(listen) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("raw server: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let args = Args::parse();
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("powerhub-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> io::Result<ExitCode> {
    let names: Vec<String> =
        if args.scenarios.is_empty() || args.scenarios.iter().any(|s| s == "all") {
            scenarios::NAMES.iter().map(|s| (*s).to_owned()).collect()
        } else {
            args.scenarios.clone()
        };
    for n in &names {
        if !scenarios::NAMES.contains(&n.as_str()) {
            return Err(io::Error::other(format!(
                "unknown scenario {n:?}; the scenarios are {}",
                scenarios::NAMES.join(", ")
            )));
        }
    }
    if let Some(twice) = names
        .iter()
        .enumerate()
        .find_map(|(i, n)| names[..i].contains(n).then_some(n))
    {
        return Err(io::Error::other(format!(
            "scenario {twice:?} is given twice"
        )));
    }
    if let Some(twice) = args
        .systems
        .iter()
        .enumerate()
        .find_map(|(i, n)| args.systems[..i].contains(n).then_some(n))
    {
        return Err(io::Error::other(format!("--systems lists {twice:?} twice")));
    }
    check_values(&args)?;
    let mut kinds = Vec::new();
    for s in &args.systems {
        kinds.push(SystemKind::parse(s).ok_or_else(|| {
            io::Error::other(format!(
                "unknown system {s:?} in --systems; the systems are powerhub, powerhub-epoll, powerhub-auth, powerhub-tls, redis, nats, nats-tls, raw"
            ))
        })?);
    }
    if let Some(bad) = args
        .inproc_systems
        .iter()
        .flatten()
        .find(|k| !inproc::SYSTEMS.contains(&k.as_str()))
    {
        return Err(io::Error::other(format!(
            "unknown system {bad:?} in --inproc-systems; the in-process systems are {}",
            inproc::SYSTEMS.join(", ")
        )));
    }
    if !(args.slow_fraction > 0.0 && args.slow_fraction <= 1.0) {
        return Err(io::Error::other(format!(
            "--slow-fraction {} is not in (0, 1]: it is a fraction of the slowest system's fanout maximum",
            args.slow_fraction
        )));
    }
    for (option, value) in [
        ("--slow-rate", args.slow_rate),
        ("--latency-max", args.latency_max),
    ] {
        if let Some(r) = value.filter(|r| !(r.is_finite() && *r >= 1.0)) {
            return Err(io::Error::other(format!(
                "{option} {r} is not a rate: give messages per second, at least 1"
            )));
        }
    }
    let quick = args.quick;
    let results = args
        .results
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results"));
    std::fs::create_dir_all(&results).map_err(|e| {
        io::Error::other(format!(
            "cannot create the results directory {} (--results): {e}",
            results.display()
        ))
    })?;
    let cpus = procfs::cpus();
    let threads = if args.budget == Budget::Pinned { 1 } else { 2 };
    let nofile = procfs::raise_nofile(1 << 17);
    // A socket scenario's subscribers are connections of this process (and of the server's):
    // past the descriptor limit the connects fail with errors that do not say why.
    let most = args
        .subs
        .iter()
        .flatten()
        .copied()
        .chain(args.latency_subs.map(|n| n as usize))
        .max()
        .unwrap_or(0);
    if most as u64 + 256 > nofile {
        return Err(io::Error::other(format!(
            "{most} subscribers need as many descriptors in this process, and this machine allows {nofile} per process (ulimit -Hn); ask for fewer with --subs or --latency-subs"
        )));
    }

    // The load generator's own CPUs, inherited by every thread and child it starts.
    if args.budget == Budget::Pinned && cpus > 1 {
        procfs::pin(None, &(0..cpus - 1).collect::<Vec<_>>())?;
    }
    let server_cpu = (args.budget == Budget::Pinned && cpus > 1).then(|| cpus - 1);
    let tls = if kinds.iter().any(|k| k.is_tls()) {
        Some(tls::TlsFiles::make(&results)?)
    } else {
        None
    };
    let launcher = systems::powerhub::Launcher {
        bin: args
            .powerhub_bin
            .clone()
            .unwrap_or_else(systems::powerhub::default_bin),
        shards: threads,
        pin: server_cpu,
        dir: results.clone(),
        tls: tls.clone(),
        ready_wait: std::time::Duration::from_secs_f64(args.ready_timeout),
    };
    let mut failures = Vec::new();
    let mut targets = Vec::new();
    // The in-process systems are libraries, and `scaling` starts its own servers.
    let needs_servers = names.iter().any(|n| n != "in-process" && n != "scaling");
    if needs_servers {
        for &k in &kinds {
            let t = match k {
                SystemKind::Raw => start_raw(),
                SystemKind::Redis => peer(k, args.redis, args.redis_pid),
                SystemKind::Nats => peer(k, args.nats, args.nats_pid),
                SystemKind::NatsTls => start_nats_tls(tls.as_ref(), &results),
                SystemKind::Powerhub
                | SystemKind::PowerhubEpoll
                | SystemKind::PowerhubAuth
                | SystemKind::PowerhubTls => {
                    launcher.start(k, systems::powerhub::Flavor::Throughput)
                }
            };
            match t {
                Ok(t) => {
                    if let (Some(cpu), false) = (server_cpu, k.is_powerhub()) {
                        procfs::pin(Some(t.pid), &[cpu])?;
                    }
                    targets.push(t);
                }
                Err(e) => failures.push(format!("{k}: not run: {e}")),
            }
        }
    }
    targets.sort_by_key(|t| t.kind);

    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.enable_steady_tick(Duration::from_millis(200));

    let secs = |v: Option<f64>, quick_v: f64, full_v: f64| {
        Duration::from_secs_f64(v.unwrap_or(if quick { quick_v } else { full_v }))
    };
    let ctx = Ctx {
        quick,
        results: results.clone(),
        readers: if args.budget == Budget::Pinned { 1 } else { 2 },
        warmup: secs(args.warmup, 0.2, 2.0),
        measure: secs(args.measure, 0.8, 10.0),
        fanout_subs: args.subs.clone().unwrap_or(if quick {
            vec![10, 100]
        } else {
            vec![1, 10, 100, 1000]
        }),
        sizes: args
            .sizes
            .clone()
            .unwrap_or(if quick { vec![64] } else { vec![64, 1024] }),
        rtt_samples: args
            .rtt_samples
            .map_or(if quick { 200 } else { 2000 }, |n| n as usize),
        latency_subs: args
            .latency_subs
            .map_or(if quick { 10 } else { 100 }, |n| n as usize),
        latency_fractions: args.rates.clone().unwrap_or(if quick {
            vec![0.5]
        } else {
            vec![0.25, 0.5, 0.75]
        }),
        slow_subs: if quick { 20 } else { 100 },
        slow_size: 1024,
        slow_fraction: args.slow_fraction,
        slow_rate: args.slow_rate,
        latency_max: args.latency_max,
        slow_control: args.slow_control,
        idle_target: args.idle.unwrap_or(if quick { 2000 } else { 50_000 }),
        idle_hold: Duration::from_secs(if quick { 1 } else { 5 }),
        screens: ScreensProfile {
            devices: args.devices.unwrap_or(if quick { 4 } else { 20 }),
            hz: 30,
            shot_hz: args.shot_hz.unwrap_or(if quick { 5 } else { 30 }),
            subs: if quick { 10 } else { 50 },
            stalled: if quick { 1 } else { 5 },
            secs: if quick { 2.0 } else { 5.0 },
        },
        inproc_subs: args.inproc_subs.clone().unwrap_or(vec![1, 100, 10_000]),
        inproc_deliveries: if quick { 200_000 } else { 5_000_000 },
        inproc_systems: args.inproc_systems.clone(),
        reps: args
            .inproc_reps
            .map_or(if quick { 1 } else { 3 }, |r| r as usize),
        repeat: args.repeat as usize,
        threads,
        targets,
        launcher: Some(launcher),
        pb: pb.clone(),
        max_rates: Default::default(),
    };

    let mut out = String::new();
    out.push_str(&format!(
        "## powerhub-perf results\n\nMachine: {}. Budget: {} ({} server worker thread{}{}). Systems: {}. Mode: {}.\n\nCommand: `powerhub-perf {}`\n\n",
        machine(),
        if args.budget == Budget::Pinned { "pinned" } else { "unpinned" },
        ctx.threads,
        if ctx.threads == 1 { "" } else { "s" },
        if args.budget == Budget::Pinned { ", server on the last CPU, load generator on the others" } else { "" },
        systems_line(&ctx, &names),
        if quick { "quick" } else { "full" },
        std::env::args().skip(1).collect::<Vec<_>>().join(" "),
    ));
    for name in &names {
        match scenarios::run(&ctx, name) {
            Ok(sc) => {
                let text = sc.render();
                pb.suspend(|| println!("{text}"));
                out.push_str(&text);
                out.push('\n');
                failures.extend(sc.failures);
            }
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    pb.finish_and_clear();
    drop(ctx);
    if !failures.is_empty() {
        out.push_str("### Problems\n\n");
        for f in &failures {
            out.push_str(&format!("- {f}\n"));
        }
    }
    let report = results.join(if quick {
        "report-quick.md"
    } else {
        "report.md"
    });
    std::fs::write(&report, &out).map_err(|e| {
        io::Error::other(format!("cannot write the report {}: {e}", report.display()))
    })?;
    println!(
        "Report: {}; the plots (where a scenario draws one) are in {}",
        report.display(),
        results.display()
    );
    if names.iter().any(|n| n == "latency") {
        println!(
            "The latency scenario's .hgrm files are in {}",
            results.join("latency").display()
        );
    }
    if !failures.is_empty() {
        eprintln!("Problems:");
        for f in &failures {
            eprintln!("- {f}");
        }
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses the values no run can use, naming the option: counts of zero, durations that are
/// not a number of seconds (or longer than a day), rates that are not fractions, sizes under the
/// benchmark message's fixed fields or over what every system takes.
fn check_values(args: &Args) -> io::Result<()> {
    let bad = |message: String| Err(io::Error::other(message));
    for (option, values) in [
        ("--subs", args.subs.as_deref()),
        ("--inproc-subs", args.inproc_subs.as_deref()),
    ] {
        if values.is_some_and(|v| v.is_empty() || v.contains(&0)) {
            return bad(format!("{option} needs subscriber counts of at least 1"));
        }
    }
    for (option, value) in [("--idle", args.idle), ("--devices", args.devices)] {
        if value == Some(0) {
            return bad(format!("{option} 0: give at least 1"));
        }
    }
    if let Some(w) = args
        .warmup
        .filter(|w| !(w.is_finite() && *w >= 0.0 && *w <= MAX_SECS))
    {
        return bad(format!(
            "--warmup {w} is not a number of seconds from 0 to {MAX_SECS}"
        ));
    }
    if let Some(m) = args
        .measure
        .filter(|m| !(m.is_finite() && *m > 0.0 && *m <= MAX_SECS))
    {
        return bad(format!(
            "--measure {m} is not a number of seconds over 0 and at most {MAX_SECS}"
        ));
    }
    if let Some(r) = args
        .rates
        .iter()
        .flatten()
        .find(|r| !(r.is_finite() && **r > 0.0))
    {
        return bad(format!(
            "--rates {r} is not a fraction of the maximum rate (more than 0)"
        ));
    }
    if args.rates.as_ref().is_some_and(Vec::is_empty) {
        return bad("--rates needs at least one fraction".to_owned());
    }
    let least = payload::Template::new(0, scenarios::BENCH, "t", "").len();
    if let Some(size) = args.sizes.iter().flatten().find(|&&s| s < least) {
        return bad(format!(
            "--sizes {size}: the benchmark message is at least {least} bytes (its sequence number, time, stream and type)"
        ));
    }
    if let Some(size) = args.sizes.iter().flatten().find(|&&s| s > MAX_SIZE) {
        return bad(format!(
            "--sizes {size}: at most {MAX_SIZE} bytes (8 MiB, NATS's max_payload as perf/peers.sh starts it; powerhub's max_message_bytes here is 16 MiB)"
        ));
    }
    if args.sizes.as_ref().is_some_and(Vec::is_empty) {
        return bad("--sizes needs at least one size".to_owned());
    }
    Ok(())
}

/// The longest `--warmup` or `--measure`: a day.
const MAX_SECS: f64 = 86_400.0;
/// The largest `--sizes` (see its help).
const MAX_SIZE: usize = 8 << 20;
