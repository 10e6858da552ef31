//! `powerhub`: the push server.
//!
//! `powerhub serve` runs the engine on the embedded default config (loopback listeners: NDJSON on
//! 127.0.0.1:7400, the binary frame on 127.0.0.1:7401), or on `--config FILE`, with CLI overrides.
//! SIGINT or SIGTERM shut it down gracefully: stop accepting, flush the hub, give connections up
//! to `engine.shutdown_timeout_ms` to receive what was published, close. A second signal exits at
//! once.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use powerhub::runtime::{
    BackendChoice, Config, Engine, ListenerConfig, ProtocolRegistry, DEFAULT_CONFIG,
};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "powerhub",
    version,
    about = "Realtime topic fan-out: the push server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the push server.
    Serve(ServeArgs),
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// A TOML config file; keys it omits keep their default (see --print-default-config).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Worker threads (shards); 0 = one per core.
    #[arg(long, value_name = "N")]
    shards: Option<usize>,
    /// IO backend: auto, io_uring or epoll (POWERHUB_BACKEND=epoll also forces epoll).
    #[arg(long, value_name = "BACKEND")]
    backend: Option<BackendChoice>,
    /// A TCP listener PROTOCOL=ADDRESS (e.g. ndjson=127.0.0.1:7400); repeatable. Replaces the
    /// configured listeners of that protocol.
    #[arg(long = "listen", value_name = "PROTOCOL=ADDRESS")]
    listen: Vec<String>,
    /// A Unix socket listener PROTOCOL=PATH (e.g. ndjson=/run/powerhub.sock); repeatable.
    /// Replaces the configured listeners of that protocol.
    #[arg(long = "unix", value_name = "PROTOCOL=PATH")]
    unix: Vec<String>,
    /// Maximum open connections (limits.max_connections).
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Prints the embedded default config and exits.
    #[arg(long)]
    print_default_config: bool,
}

fn split_pair<'a>(flag: &str, value: &'a str) -> Result<(&'a str, &'a str), String> {
    value
        .split_once('=')
        .filter(|(p, a)| !p.is_empty() && !a.is_empty())
        .ok_or_else(|| {
            format!("--{flag} {value:?}: expected PROTOCOL=ADDRESS, e.g. ndjson=127.0.0.1:7400")
        })
}

fn build_config(args: &ServeArgs) -> Result<Config, String> {
    let mut config = match &args.config {
        Some(path) => Config::from_file(path).map_err(|e| e.to_string())?,
        None => Config::embedded_default(),
    };
    if let Some(n) = args.shards {
        config.engine.shards = n;
    }
    if let Some(b) = args.backend {
        config.engine.backend = b;
    }
    if let Some(n) = args.max_connections {
        config.limits.max_connections = n;
    }
    let mut overrides = Vec::new();
    for v in &args.listen {
        let (p, a) = split_pair("listen", v)?;
        overrides.push(ListenerConfig::tcp(p, a));
    }
    for v in &args.unix {
        let (p, a) = split_pair("unix", v)?;
        overrides.push(ListenerConfig::unix(p, a));
    }
    if !overrides.is_empty() {
        config
            .listeners
            .retain(|l| !overrides.iter().any(|o| o.protocol == l.protocol));
        config.listeners.extend(overrides);
    }
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

/// Blocks SIGINT and SIGTERM in this thread (and in every thread started after), so that they
/// are only received by `sigwait`.
fn block_signals() -> libc::sigset_t {
    // SAFETY: `set` is a local sigset initialised by `sigemptyset` before use; the calls only
    // read and write it and the calling thread's signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_signal(set: &libc::sigset_t) -> i32 {
    let mut sig: libc::c_int = 0;
    // SAFETY: `set` is an initialised sigset and `sig` a live out-parameter.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
}

fn serve(args: ServeArgs) -> ExitCode {
    if args.print_default_config {
        print!("{DEFAULT_CONFIG}");
        return ExitCode::SUCCESS;
    }
    let config = match build_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("powerhub: {e}");
            return ExitCode::from(2);
        }
    };
    let signals = block_signals();
    let registry = ProtocolRegistry::with_builtins();
    let engine = match Engine::start(config, &registry) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("powerhub: {e}");
            return ExitCode::from(1);
        }
    };
    for l in engine.listeners() {
        println!("listening {} {}", l.protocol, l.addr);
    }
    println!("backend {}", engine.backend());
    println!("ready");
    let sig = wait_signal(&signals);
    tracing::info!(signal = sig, "shutting down gracefully");
    // A second signal exits at once.
    std::thread::spawn(move || {
        let sig = wait_signal(&signals);
        eprintln!("powerhub: signal {sig} during shutdown; exiting now");
        std::process::exit(130);
    });
    match engine.shutdown() {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("powerhub: shutdown: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Cli::parse().command {
        Command::Serve(args) => serve(args),
    }
}
