//! WebSocket (RFC 6455) transport for powerhub, sans-IO.
