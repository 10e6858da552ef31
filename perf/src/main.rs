//! powerhub-perf: load generator and benchmark runner.

fn main() {}
