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

    /// A registry holding the built-in plugins: `ndjson` (TCP and Unix sockets) and `frame`.
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
