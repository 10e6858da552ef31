//! The push protocol: client commands and server messages, newline-delimited JSON.
