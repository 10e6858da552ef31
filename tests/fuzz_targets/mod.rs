//! The checks of the fuzz targets: each takes one input and panics when a property fails.
//!
//! The fuzz targets (`fuzz/fuzz_targets/*.rs`, run with `scripts/fuzz.sh`) include this module
//! with `#[path]`, and `tests/fuzz_regressions.rs` replays every input kept under
//! `fuzz/regressions/<target>/` through the same check, so an input that once failed stays a
//! test of the ordinary suite.

pub(crate) mod command_parser;
pub(crate) mod config_toml;
pub(crate) mod frame_decoder;
pub(crate) mod push_connection;
mod support;
pub(crate) mod websocket_codec;
pub(crate) mod websocket_handshake;

/// A check: panics when the input breaks a property.
pub(crate) type Check = fn(&[u8]);

/// Every target: its name (of the fuzz target and of its regressions folder) and its check.
pub(crate) const TARGETS: &[(&str, Check)] = &[
    ("command_parser", command_parser::check),
    ("config_toml", config_toml::check),
    ("frame_decoder", frame_decoder::check),
    ("push_connection", push_connection::check),
    ("websocket_codec", websocket_codec::check),
    ("websocket_handshake", websocket_handshake::check),
];
