//! Fuzz target `frame_decoder`: the check in `tests/fuzz_targets/frame_decoder.rs`.
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzz_targets/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::frame_decoder::check(data));
