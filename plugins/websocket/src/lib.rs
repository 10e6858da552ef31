//! WebSocket (RFC 6455) transport for powerhub, sans-IO.
//!
//! [`WebSocketFactory`] is the [`ProtocolFactory`] registered as `"websocket"`: it builds one
//! [`WebSocket`] state machine per accepted connection. The runtime's shard owns the socket,
//! feeds inbound bytes to [`StreamProtocol::decode`], writes [`ProtocolOutput::urgent`] before
//! any queued data, and frames outbound messages with the `encode_*` methods:
//!
//! - the opening handshake (HTTP/1.1 upgrade, path and origin checks) is answered with
//!   `101 Switching Protocols`, or refused with an HTTP error response naming what was wrong;
//!   a plain `GET` of the endpoint returns the built-in web page when
//!   [`WebSocketConfig::serve_page`] is set;
//! - client text messages (one JSON message each) arrive as [`Inbound::Text`], binary messages
//!   as [`Inbound::Binary`], pongs as [`Inbound::Pong`] and the peer's close as
//!   [`Inbound::Close`] (its reply already in `urgent`);
//! - pings are answered with pongs in `urgent`: control frames never queue behind data.
//!
//! # Examples
//!
//! A handshake, one text message in, one out:
//!
//! ```
//! use powerhub_plugin::{BytesMut, Inbound, ProtocolFactory, ProtocolLimits, ProtocolOutput};
//! use powerhub_websocket::{WebSocketConfig, WebSocketFactory};
//!
//! let factory = WebSocketFactory::new(WebSocketConfig::default())?;
//! let mut conn = factory.new_connection(&ProtocolLimits::default());
//! let mut out = ProtocolOutput::default();
//!
//! let mut input = BytesMut::from(
//!     "GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
//!      Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
//! );
//! conn.decode(&mut input, &mut out)?;
//! assert!(out.urgent.starts_with(b"HTTP/1.1 101 Switching Protocols\r\n"));
//! assert!(conn.is_ready());
//!
//! // A masked text frame from the client: "hi" with the key 1, 2, 3, 4.
//! out.clear();
//! input.extend_from_slice(&[0x81, 0x82, 1, 2, 3, 4, b'h' ^ 1, b'i' ^ 2]);
//! conn.decode(&mut input, &mut out)?;
//! assert_eq!(out.events, vec![Inbound::Text("hi".into())]);
//!
//! // Server frames are unmasked.
//! let mut wire = BytesMut::new();
//! conn.encode_text(br#"{"type":"pong"}"#, &mut wire);
//! assert_eq!(&wire[..2], &[0x81, 15]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use powerhub_plugin::{
    ListenerOptions, OriginPolicy, ProtocolFactory, ProtocolLimits, StreamProtocol,
};

mod codec;
mod config;
mod frame;
mod handshake;

pub use codec::WebSocket;
pub use config::{ConfigError, WebSocketConfig};
pub use frame::{close_code, is_valid_close_code, ServerFrameHeader};
pub use handshake::{accept_key, SUBPROTOCOL};

#[cfg(doc)]
use powerhub_plugin::{Inbound, ProtocolOutput};

/// The name the protocol is registered under.
pub const NAME: &str = "websocket";

/// The built-in web page: connects to the endpoint it was served from, subscribes, and shows
/// live messages and the hub's stats. Self-contained (inline script and style).
pub const INDEX_HTML: &str = include_str!("../assets/index.html");

/// Builds a [`WebSocket`] per connection from a validated [`WebSocketConfig`].
///
/// ```
/// use powerhub_plugin::ProtocolFactory;
/// use powerhub_websocket::{WebSocketConfig, WebSocketFactory};
///
/// let factory = WebSocketFactory::new(WebSocketConfig::default().with_path("/ws"))?;
/// assert_eq!(factory.name(), "websocket");
/// assert_eq!(factory.config().path, "/ws");
/// assert!(WebSocketFactory::new(WebSocketConfig::default().with_path("ws")).is_err());
/// # Ok::<(), powerhub_websocket::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct WebSocketFactory {
    config: Arc<WebSocketConfig>,
}

impl WebSocketFactory {
    /// A factory for `config`, once [`WebSocketConfig::validate`] accepts it.
    pub fn new(config: WebSocketConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(WebSocketFactory {
            config: Arc::new(config),
        })
    }

    /// The configuration, e.g. for the runtime to read
    /// [`handshake_timeout`](WebSocketConfig::handshake_timeout).
    pub fn config(&self) -> &WebSocketConfig {
        &self.config
    }

    /// A connection state machine as its concrete type.
    pub fn connection(&self, limits: &ProtocolLimits) -> WebSocket {
        WebSocket::new(Arc::clone(&self.config), limits)
    }
}

impl ProtocolFactory for WebSocketFactory {
    fn name(&self) -> &str {
        NAME
    }

    fn new_connection(&self, limits: &ProtocolLimits) -> Box<dyn StreamProtocol> {
        Box::new(self.connection(limits))
    }

    /// A listener's origin policy and page setting, applied over this factory's configuration:
    /// [`OriginPolicy::Listed`] and [`OriginPolicy::SameHost`] accept requests without an
    /// `Origin` (programs; browsers always send one); [`ListenerOptions::serve_page`], when
    /// set, replaces [`WebSocketConfig::serve_page`].
    ///
    /// ```
    /// use powerhub_plugin::{ListenerOptions, OriginPolicy, ProtocolFactory};
    /// use powerhub_websocket::{WebSocketConfig, WebSocketFactory};
    ///
    /// let factory = WebSocketFactory::new(WebSocketConfig::default())?;
    /// let options = ListenerOptions::default().with_origins(OriginPolicy::SameHost);
    /// assert!(factory.for_listener(&options).unwrap().is_some());
    /// let bad = ListenerOptions::default().with_origins(OriginPolicy::Listed(vec!["evil".into()]));
    /// assert!(factory.for_listener(&bad).unwrap_err().contains("allowed_origins"));
    /// // Nothing to change: the factory as it is.
    /// assert!(factory.for_listener(&ListenerOptions::default()).unwrap().is_none());
    /// let no_page = ListenerOptions::default().with_serve_page(false);
    /// assert!(factory.for_listener(&no_page).unwrap().is_some());
    /// # Ok::<(), powerhub_websocket::ConfigError>(())
    /// ```
    fn for_listener(
        &self,
        options: &ListenerOptions,
    ) -> Result<Option<Arc<dyn ProtocolFactory>>, String> {
        if options.origins == OriginPolicy::Protocol && options.serve_page.is_none() {
            return Ok(None);
        }
        let mut base = (*self.config).clone();
        if let Some(serve) = options.serve_page {
            base = base.with_serve_page(serve);
        }
        let config = match &options.origins {
            OriginPolicy::Protocol => base,
            OriginPolicy::Any => base
                .with_allowed_origins(Vec::<String>::new())
                .with_same_host_origin(false),
            OriginPolicy::Listed(origins) => base
                .with_allowed_origins(origins.iter().cloned())
                .with_same_host_origin(false)
                .with_allow_missing_origin(true),
            OriginPolicy::SameHost => base
                .with_allowed_origins(Vec::<String>::new())
                .with_same_host_origin(true)
                .with_allow_missing_origin(true),
            _ => return Err("an origin policy this protocol does not know".to_owned()),
        };
        let factory = WebSocketFactory::new(config).map_err(|e| e.to_string())?;
        Ok(Some(Arc::new(factory)))
    }
}
