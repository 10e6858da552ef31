//! Entry points for the fuzz targets and their regression tests: the publish fast path and the
//! full parser, each alone, so that a target can check that they agree. Not part of the API.

use super::command::{Command, CommandError};

/// The publish fast path alone: `Some` for a line it reads, `None` for a line it leaves to the
/// full parser. The line must be UTF-8 (as [`full`] checks first).
pub fn fast_publish(line: &[u8]) -> Option<Command> {
    super::fast::publish(line, super::command::DEFAULT_MAX_JSON_DEPTH)
}

/// The full parser alone, with the default limits.
pub fn full(line: &[u8]) -> Result<Command, CommandError> {
    super::command::parse_full_default(line)
}
