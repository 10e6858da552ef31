//! Fuzz target `websocket_handshake`: the check in `tests/fuzz_targets/websocket_handshake.rs`.
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzz_targets/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::websocket_handshake::check(data));
