//! Fuzz target `command_parser`: the check in `tests/fuzz_targets/command_parser.rs`.
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzz_targets/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::command_parser::check(data));
