//! NDJSON push transport for powerhub: one JSON message per line, over TCP or Unix sockets.
