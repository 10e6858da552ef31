//! Fuzz target `config_toml`: the check in `tests/fuzz_targets/config_toml.rs`.
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzz_targets/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::config_toml::check(data));
