//! Built-in sinks: the in-process channel transport and the spy transport for tests.
//!
//! Both implement the plugin crate's [`Sink`](powerhub_plugin::Sink) and use nothing private to
//! the hub.

mod channel;
mod spy;

pub use self::channel::{channel, ChannelEvent, ChannelReceiver, ChannelSink, TryRecvError};
pub use self::spy::{SpyFrame, SpyMode, SpySink};
