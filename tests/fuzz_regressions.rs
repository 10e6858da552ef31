//! Every input kept under `fuzz/regressions/<target>/` (seeds, and every input that ever made
//! a fuzz target fail) replayed through that target's check (`tests/fuzz_targets/`).

use std::path::{Path, PathBuf};

mod fuzz_targets;

fn inputs(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a readable directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

fn replay(target: &str) {
    let (_, check) = fuzz_targets::TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .expect("a known target");
    let files = inputs(target);
    assert!(!files.is_empty(), "no regression inputs for {target}");
    for file in files {
        let data = std::fs::read(&file).expect("a readable input");
        let result = std::panic::catch_unwind(|| check(&data));
        assert!(result.is_ok(), "{target}: {} fails", file.display());
    }
}

#[test]
fn command_parser() {
    replay("command_parser");
}

#[test]
fn config_toml() {
    replay("config_toml");
}

#[test]
fn frame_decoder() {
    replay("frame_decoder");
}

#[test]
fn push_connection() {
    replay("push_connection");
}

#[test]
fn websocket_codec() {
    replay("websocket_codec");
}

#[test]
fn websocket_handshake() {
    replay("websocket_handshake");
}

#[test]
fn every_target_has_a_test_and_a_fuzz_target() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/fuzz_targets");
    for (name, _) in fuzz_targets::TARGETS {
        assert!(
            fuzz.join(format!("{name}.rs")).is_file(),
            "no fuzz target {name}"
        );
    }
}
