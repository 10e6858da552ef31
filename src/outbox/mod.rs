//! The per-connection outbound queue of the push-stream back-pressure spec (sans-IO).
