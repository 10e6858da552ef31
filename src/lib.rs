//! powerhub: realtime topic fan-out that stays fast when a subscriber is slow.
//!
//! Every subscriber has its own bounded queue and a declared slow-consumer policy; what is
//! published together is encoded once per (topic, batch) and that one frame is shared by every
//! subscriber that receives the batch.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod copy;
pub mod hub;
mod loom;
pub mod outbox;
pub mod protocol;
pub mod push;
pub mod ring;
pub mod runtime;
pub mod security;
pub mod transport;

pub use powerhub_plugin as plugin;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
