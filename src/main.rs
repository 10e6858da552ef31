//! `powerhub`: the push server.

fn main() {}
