//! `powerhub`: the push server.
//!
//! `powerhub serve` runs the engine on the embedded default config (loopback listeners: NDJSON on
//! 127.0.0.1:7400, the binary frame on 127.0.0.1:7401, WebSocket on 127.0.0.1:7402), or on
//! `--config FILE`, with CLI overrides. It registers the built-in protocols: `ndjson`, `frame`
//! and `websocket`.
//! At start it raises its soft limit of open descriptors (`ulimit -Sn`) to the hard limit, as
//! servers holding many connections do: a soft limit of 1 024 is common and would cap the
//! server far below `limits.max_connections`.
//! SIGINT or SIGTERM shut it down gracefully ([`Engine::shutdown`]): stop accepting, read and
//! serve what the connections already sent, deliver what was published, close each connection
//! with the `shutdown` error, all within `engine.shutdown_timeout_ms`. A second signal exits at
//! once. SIGHUP re-reads the config file's `[auth]` section and its key files
//! ([`Engine::reload_auth`]) and the TLS listeners' certificate files ([`Engine::reload_tls`]):
//! connections accepted from then on use them, open ones keep theirs; files that cannot be used
//! are logged and the running ones stay.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use powerhub::runtime::{
    BackendChoice, Config, Engine, EngineError, ListenerConfig, ProtocolRegistry, DEFAULT_CONFIG,
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
    /// A TCP listener PROTOCOL=ADDRESS (e.g. ndjson=127.0.0.1:7400); repeatable. Listeners given
    /// on the command line replace the configured ones.
    #[arg(long = "listen", value_name = "PROTOCOL=ADDRESS")]
    listen: Vec<String>,
    /// A Unix socket listener PROTOCOL=PATH (e.g. ndjson=/run/powerhub.sock); repeatable.
    /// Listeners given on the command line replace the configured ones.
    #[arg(long = "unix", value_name = "PROTOCOL=PATH")]
    unix: Vec<String>,
    /// Maximum open connections (limits.max_connections).
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Prints the embedded default config and exits.
    #[arg(long)]
    print_default_config: bool,
}

/// Prints the listeners, the backend and `ready` on stdout, for a supervisor or a script to
/// read. A reader that has gone (a closed pipe) does not stop the server: the lines are its
/// only use of stdout, and the log says the same on stderr.
fn announce(engine: &Engine) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let mut said = Ok(());
    for l in engine.listeners() {
        said = said.and_then(|()| writeln!(out, "listening {} {}", l.protocol, l.addr));
    }
    said = said
        .and_then(|()| writeln!(out, "backend {}", engine.backend()))
        .and_then(|()| writeln!(out, "ready"))
        .and_then(|()| out.flush());
    if let Err(e) = said {
        tracing::warn!(error = %e, "cannot write the ready lines to stdout; serving on");
    }
}

fn split_pair<'a>(flag: &str, value: &'a str) -> Result<(&'a str, &'a str), String> {
    value
        .split_once('=')
        .filter(|(p, a)| !p.is_empty() && !a.is_empty())
        .ok_or_else(|| {
            let expected = if flag == "unix" {
                "PROTOCOL=PATH, e.g. ndjson=/run/powerhub.sock"
            } else {
                "PROTOCOL=ADDRESS, e.g. ndjson=127.0.0.1:7400"
            };
            format!("--{flag} {value:?}: expected {expected}")
        })
}

/// The server's config: the file (or the embedded default) as the command line changes it.
fn build_config(args: &ServeArgs) -> Result<Config, String> {
    let config = match &args.config {
        Some(path) => Config::from_file(path).map_err(|e| e.to_string())?,
        None => Config::embedded_default(),
    };
    let config = with_overrides(config, args)?;
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

/// `config` as the command line changes it: `--shards`, `--backend`, `--max-connections`, and
/// `--listen` and `--unix`, which replace the listeners; with none, a config without listeners
/// gets the default ones. A reload reads the file through this too, so that it compares what
/// the server would run now with what it runs, not the file with the command line.
fn with_overrides(mut config: Config, args: &ServeArgs) -> Result<Config, String> {
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
        config.listeners = overrides;
    } else if config.listeners.is_empty() {
        // A file without `[[listener]]` keeps the default listeners, as every key it omits
        // keeps its default: a server that listens nowhere would say `ready` and serve nobody.
        config.listeners = Config::embedded_default().listeners;
    }
    Ok(config)
}

/// Blocks SIGINT, SIGTERM and SIGHUP in this thread (and in every thread started after), so that they
/// are only received by `sigwait`.
fn block_signals() -> libc::sigset_t {
    // SAFETY: `set` is a local sigset initialised by `sigemptyset` before use; the calls only
    // read and write it and the calling thread's signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
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
    raise_nofile();
    let signals = block_signals();
    // The WebSocket plugin's own limits follow the config's, so `limits.max_message_bytes` and
    // `limits.max_handshake_bytes` hold on WebSocket as on the other listeners.
    let registry = match ProtocolRegistry::for_config(&config) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("powerhub: {e}");
            return ExitCode::from(2);
        }
    };
    let engine = match Engine::start(config, &registry) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("powerhub: {e}");
            // 2: the configuration is refused, as a file's error is; 1: it could not run.
            let code = match e {
                EngineError::Bind { .. } | EngineError::Shard { .. } => 1,
                _ => 2,
            };
            return ExitCode::from(code);
        }
    };
    announce(&engine);
    let sig = loop {
        match wait_signal(&signals) {
            libc::SIGHUP => reload(&engine, &args),
            sig => break sig,
        }
    };
    tracing::info!(signal = sig, "shutting down gracefully");
    // A second signal exits at once.
    std::thread::spawn(move || {
        let sig = loop {
            match wait_signal(&signals) {
                libc::SIGHUP => continue,
                sig => break sig,
            }
        };
        eprintln!("powerhub: signal {sig} during shutdown; exiting now");
        // 128 + the signal, as a shell reports a process a signal ended.
        std::process::exit(128 + sig);
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

/// SIGHUP: the config file's `[auth]` section (and its key files) again, for the connections
/// accepted from now on.
fn reload(engine: &Engine, args: &ServeArgs) {
    let Some(path) = args.config.as_deref() else {
        tracing::info!(
            "SIGHUP: no config file to reload (the embedded default has no [auth] and no TLS)"
        );
        return;
    };
    let fresh = match reread(path, args) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::error!(config = %path.display(), error = %e, "SIGHUP: the config file cannot be read; the running [auth] stays");
            None
        }
    };
    if let Some(c) = &fresh {
        match engine.reload_auth(c.auth.as_ref()) {
            Ok(()) if c.auth.is_none() => {
                tracing::info!(config = %path.display(), "SIGHUP: the config has no [auth] section; authentication stays off")
            }
            Ok(()) => {
                tracing::info!(config = %path.display(), "SIGHUP: reloaded [auth] and its keys")
            }
            Err(e) => {
                tracing::error!(config = %path.display(), error = %e, "SIGHUP: reload refused; the running [auth] stays")
            }
        }
        // Everything but `[auth]` is read at start: an edit elsewhere is said not to apply, so
        // that it is not taken for applied.
        let changed = engine.config().changed_at_start_only(c);
        if !changed.is_empty() {
            tracing::warn!(
                config = %path.display(),
                sections = %changed.join(", "),
                "SIGHUP: these sections changed and are read at start only; the running values stay until a restart"
            );
        }
        // A listener's certificate paths are read at start: a reload reads the same files again.
        let running = &engine.config().listeners;
        for (index, (now, then)) in c.listeners.iter().zip(running).enumerate() {
            if (&now.tls_cert, &now.tls_key, &now.tls_client_ca)
                != (&then.tls_cert, &then.tls_key, &then.tls_client_ca)
            {
                tracing::warn!(
                    listener = index,
                    "SIGHUP: the listener's tls_cert, tls_key or tls_client_ca path changed; a reload reads the files at the paths given at start (new paths need a restart)"
                );
            }
        }
    }
    if engine
        .config()
        .listeners
        .iter()
        .all(|l| l.tls_cert.is_none())
    {
        return;
    }
    match engine.reload_tls() {
        Ok(()) => tracing::info!("SIGHUP: read the TLS listeners' certificate and key files again"),
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: TLS reload refused; the running certificates stay")
        }
    }
}

/// The config file at `path` again, as the command line changes it (see [`with_overrides`]).
fn reread(path: &std::path::Path, args: &ServeArgs) -> Result<Config, String> {
    let config = Config::from_file(path).map_err(|e| e.to_string())?;
    with_overrides(config, args)
}

/// Raises the soft limit of open descriptors to the hard limit (no further than the kernel's
/// `fs.nr_open`, which bounds it when the hard limit is unlimited), and says so in the log.
fn raise_nofile() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<libc::rlim_t>().ok())
        .unwrap_or(1 << 20);
    let want = lim.rlim_max.min(nr_open);
    if want <= lim.rlim_cur {
        return;
    }
    let raised = libc::rlimit {
        rlim_cur: want,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: `raised` is a valid rlimit; raising the soft limit up to the hard one needs no
    // privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        tracing::info!(
            from = lim.rlim_cur,
            to = want,
            "raised the soft limit of open descriptors to the hard limit"
        );
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

#[cfg(test)]
mod tests {
    use super::*;

    fn serve_args(args: &[&str]) -> ServeArgs {
        let cli = Cli::try_parse_from([&["powerhub", "serve"], args].concat()).expect("parses");
        let Command::Serve(args) = cli.command;
        args
    }

    fn addresses(config: &Config) -> Vec<String> {
        config
            .listeners
            .iter()
            .map(|l| format!("{} {:?} {:?}", l.protocol, l.address, l.path))
            .collect()
    }

    #[test]
    fn a_config_file_without_listeners_keeps_the_default_listeners() {
        let dir = std::env::temp_dir().join(format!("powerhub-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("limits-only.toml");
        std::fs::write(&file, "[limits]\nmax_connections = 10\n").unwrap();
        let path = file.to_str().unwrap();
        let config = build_config(&serve_args(&["--config", path])).unwrap();
        assert_eq!(config.limits.max_connections, 10);
        let default = Config::embedded_default();
        assert!(!default.listeners.is_empty());
        assert_eq!(addresses(&config), addresses(&default));
        // Listeners in the file, or on the command line, replace the defaults.
        std::fs::write(
            &file,
            "[[listener]]\nprotocol = \"ndjson\"\naddress = \"127.0.0.1:0\"\n",
        )
        .unwrap();
        let config = build_config(&serve_args(&["--config", path])).unwrap();
        assert_eq!(config.listeners.len(), 1);
        let config = build_config(&serve_args(&[
            "--config",
            path,
            "--listen",
            "frame=127.0.0.1:0",
        ]))
        .unwrap();
        assert_eq!(addresses(&config), ["frame Some(\"127.0.0.1:0\") None"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A reload compares the file, as the command line changes it, with what runs: the
    /// command line's overrides are no change, an edit of the file is. (Every reload of a
    /// server started with `--shards`, `--backend`, `--max-connections` or `--listen` warned
    /// that `[engine]`, `[limits]` or `[[listener]]` had changed.)
    #[test]
    fn a_reload_of_an_unchanged_file_finds_no_change_whatever_the_command_line_overrides() {
        let dir = std::env::temp_dir().join(format!("powerhub-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("powerhub.toml");
        std::fs::write(&file, "[limits]\nmax_message_bytes = 8192\n").unwrap();
        let path = file.to_str().unwrap();
        let flags: [&[&str]; 5] = [
            &[],
            &["--shards", "2"],
            &["--backend", "epoll"],
            &["--max-connections", "50"],
            &[
                "--listen",
                "ndjson=127.0.0.1:0",
                "--unix",
                "frame=/tmp/x.sock",
            ],
        ];
        for extra in flags {
            let args = serve_args(&[&["--config", path][..], extra].concat());
            let running = build_config(&args).unwrap();
            let fresh = reread(&file, &args).unwrap();
            assert_eq!(
                running.changed_at_start_only(&fresh),
                Vec::<&str>::new(),
                "{extra:?}"
            );
        }
        // An edit is still found, beside the overrides.
        let args = serve_args(&["--config", path, "--shards", "2"]);
        let running = build_config(&args).unwrap();
        std::fs::write(&file, "[limits]\nmax_message_bytes = 4096\n").unwrap();
        let fresh = reread(&file, &args).unwrap();
        assert_eq!(running.changed_at_start_only(&fresh), ["[limits]"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
