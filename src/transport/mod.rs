//! Built-in sinks: the in-process channel transport and the spy transport for tests.
