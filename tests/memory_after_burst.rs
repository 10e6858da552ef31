//! Memory comes back after a burst: `powerhub serve` with eight clients that send commands and
//! never read, each closed when its unsent replies reach `limits.max_outbox_bytes`; once they are
//! gone the server's RSS is back within 2x of its warm baseline within seconds
//! (`perf/burst_rss.py` drives it and checks; both backends).

use std::process::Command;

fn run(backend: &str) {
    let dir = std::env::temp_dir().join(format!("powerhub-burst-{}-{backend}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("burst.toml");
    // Limits shrunk so that the burst is short: 8 x 4 MiB of replies.
    std::fs::write(
        &config,
        "[limits]\nbackpressure_bytes = 1048576\nmax_outbox_bytes = 4194304\n\n\
         [outbox]\nhigh_water_bytes = 1048576\n",
    )
    .unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/perf/burst_rss.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_powerhub"))
        .args(["--backend", backend, "--warm", "--seconds", "3"])
        .arg("--config")
        .arg(&config)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "RSS did not come back on {backend}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn memory_comes_back_after_never_reading_clients_are_closed_at_max_outbox_bytes_on_io_uring() {
    if std::env::var("POWERHUB_BACKEND").is_ok_and(|v| v == "epoll") {
        eprintln!("notice: POWERHUB_BACKEND=epoll; the io_uring run is skipped");
        return;
    }
    run("io_uring");
}

#[test]
fn memory_comes_back_after_never_reading_clients_are_closed_at_max_outbox_bytes_on_epoll() {
    run("epoll");
}
