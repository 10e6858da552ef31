//! The registry of stream-protocol plugins, by name.

use std::collections::BTreeMap;
use std::sync::Arc;

use powerhub_plugin::ProtocolFactory;

/// Why a protocol could not be registered or found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Two factories claimed one name.
    #[error("a protocol named `{0}` is already registered")]
    Duplicate(String),
    /// A built-in plugin refused the configuration it was given.
    #[error("cannot configure the `{name}` protocol: {reason}")]
    Plugin {
        /// The protocol's name.
        name: String,
        /// What the plugin said.
        reason: String,
    },
    /// A listener names a protocol nobody registered.
    #[error("unknown protocol `{name}` (registered: {known})")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The registered names, comma-separated.
        known: String,
    },
}

/// Stream-protocol factories registered by name at start-up; listeners name them in the config.
///
/// ```
/// use powerhub::runtime::ProtocolRegistry;
///
/// let registry = ProtocolRegistry::with_builtins();
/// assert!(registry.get("ndjson").is_ok());
/// assert!(registry.get("frame").is_ok());
/// let err = registry.get("carrier-pigeon").unwrap_err();
/// assert!(err.to_string().contains("carrier-pigeon"));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ProtocolRegistry {
    factories: BTreeMap<String, Arc<dyn ProtocolFactory>>,
}

impl ProtocolRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry holding the plugins that need no configuration: `ndjson` (TCP and Unix
    /// sockets) and `frame`. [`for_config`](Self::for_config) adds `websocket`.
    pub fn with_builtins() -> Self {
        let mut r = Self::new();
        let builtins: [Arc<dyn ProtocolFactory>; 2] = [
            Arc::new(powerhub_ndjson::NdjsonFactory),
            Arc::new(powerhub_frame::FrameFactory),
        ];
        for f in builtins {
            r.register(f)
                .unwrap_or_else(|e| unreachable!("built-in names are distinct: {e}"));
        }
        r
    }

    /// The built-in plugins as `powerhub serve` registers them for `config`: `ndjson`,
    /// `frame`, and `websocket` with its message, frame and handshake limits taken from
    /// `config.limits` (and the live page served on a plain `GET`). The embedded default config
    /// has a WebSocket listener, which [`with_builtins`](Self::with_builtins) cannot serve.
    ///
    /// ```
    /// use powerhub::runtime::{Config, ProtocolRegistry};
    ///
    /// let config = Config::embedded_default();
    /// let registry = ProtocolRegistry::for_config(&config)?;
    /// assert_eq!(registry.names().collect::<Vec<_>>(), ["frame", "ndjson", "websocket"]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`RegistryError::Plugin`] when the WebSocket plugin refuses the limits.
    pub fn for_config(config: &crate::runtime::Config) -> Result<Self, RegistryError> {
        let mut r = Self::with_builtins();
        let ws = powerhub_websocket::WebSocketConfig::default()
            .with_serve_page(true)
            .with_max_message_bytes(config.limits.max_message_bytes)
            .with_max_frame_bytes(config.limits.max_message_bytes)
            .with_max_handshake_bytes(config.limits.max_handshake_bytes);
        let factory =
            powerhub_websocket::WebSocketFactory::new(ws).map_err(|e| RegistryError::Plugin {
                name: "websocket".into(),
                reason: e.to_string(),
            })?;
        r.register(Arc::new(factory))?;
        Ok(r)
    }

    /// Registers a factory under its [`ProtocolFactory::name`].
    pub fn register(&mut self, factory: Arc<dyn ProtocolFactory>) -> Result<(), RegistryError> {
        let name = factory.name().to_owned();
        if self.factories.contains_key(&name) {
            return Err(RegistryError::Duplicate(name));
        }
        self.factories.insert(name, factory);
        Ok(())
    }

    /// The factory registered as `name`.
    pub fn get(&self, name: &str) -> Result<Arc<dyn ProtocolFactory>, RegistryError> {
        self.factories
            .get(name)
            .cloned()
            .ok_or_else(|| RegistryError::Unknown {
                name: name.to_owned(),
                known: self
                    .factories
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The registered names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.factories.keys().map(String::as_str)
    }
}
