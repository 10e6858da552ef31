//! Fuzz target `push_connection`: the check in `tests/fuzz_targets/push_connection.rs`.
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzz_targets/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::push_connection::check(data));
