//! powerhub as a system under test: the `powerhub serve` push server (NDJSON over TCP).
//!
//! Everything that depends on the server's command line and push protocol is in this module.

use std::io;
use std::net::TcpStream;
use std::path::Path;

use super::{Decoder, SubOpts, Target, Wire};

/// The NDJSON push protocol of `powerhub serve`.
#[derive(Debug, Default)]
pub(crate) struct PowerhubWire;

impl Wire for PowerhubWire {
    fn subscribe(&self, _s: &mut TcpStream, _topic: &str, _opts: &SubOpts) -> io::Result<Vec<u8>> {
        Err(io::Error::other(
            "the powerhub push protocol is not wired yet",
        ))
    }

    fn hello_publisher(&self, _s: &mut TcpStream) -> io::Result<()> {
        Err(io::Error::other(
            "the powerhub push protocol is not wired yet",
        ))
    }

    fn encode_publish(&self, _topic: &str, _msg: &[u8], _out: &mut Vec<u8>) {}

    fn decoder(&self) -> Box<dyn Decoder> {
        Box::new(super::raw::LineDecoder)
    }
}

/// Start `powerhub serve` from `bin` on a free loopback port with `threads` shards.
pub(crate) fn start(bin: &Path, _threads: usize) -> io::Result<Target> {
    Err(io::Error::other(format!(
        "powerhub serve is not wired yet ({})",
        bin.display()
    )))
}

/// Publish `msgs` copies of `payload` to `n` in-process subscribers of a `powerhub::hub::Hub`
/// and wait until every subscriber has them.
pub(crate) fn inproc(
    _n: usize,
    _msgs: u64,
    _payload: bytes::Bytes,
) -> io::Result<crate::inproc::InprocOut> {
    Err(io::Error::other("powerhub::hub::Hub is not wired yet"))
}
