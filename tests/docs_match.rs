//! The reference docs say what the server does: every default in docs/config.md is the embedded
//! config's, every key of the embedded config is documented, and docs/protocol.md's table of
//! error codes is exactly the set of codes the server can send.

use std::collections::{BTreeMap, BTreeSet};

fn doc(name: &str) -> String {
    let path = format!("{}/docs/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The rows `| `key` | `default` | ... |` of docs/config.md, by section (`engine`, `limits`, ...).
fn documented_defaults() -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut section = None;
    for line in doc("config.md").lines() {
        if let Some(rest) = line.strip_prefix("## `[") {
            section = rest.strip_suffix("]`").map(str::to_owned);
            continue;
        }
        if line.starts_with("## ") {
            section = None;
        }
        let Some(section) = &section else { continue };
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || !cells[1].starts_with('`') || !cells[2].starts_with('`') {
            continue;
        }
        let key = cells[1].trim_matches('`').to_owned();
        let default = cells[2].trim_matches('`').to_owned();
        out.entry(section.clone()).or_default().insert(key, default);
    }
    out
}

#[test]
fn every_documented_default_is_the_embedded_configs_and_every_key_is_documented() {
    let embedded: toml::Table = powerhub::runtime::DEFAULT_CONFIG
        .parse()
        .expect("the embedded config is TOML");
    let documented = documented_defaults();
    for section in ["engine", "limits", "subscriptions", "outbox"] {
        let table = embedded[section].as_table().expect("a section");
        let docs = documented
            .get(section)
            .unwrap_or_else(|| panic!("docs/config.md has no [{section}] table"));
        for (key, value) in table {
            let written = docs
                .get(key)
                .unwrap_or_else(|| panic!("{section}.{key} is not in docs/config.md"));
            // The documented default, read as TOML, is the embedded config's value.
            let parsed: toml::Table = format!("v = {written}").parse().unwrap_or_else(|e| {
                panic!("docs/config.md's default for {section}.{key} is not TOML: {written}: {e}")
            });
            assert_eq!(
                &parsed["v"], value,
                "docs/config.md gives {section}.{key} = {written}, the embedded config {value}"
            );
        }
        for key in docs.keys() {
            assert!(
                table.contains_key(key),
                "docs/config.md documents {section}.{key}, which the embedded config lacks"
            );
        }
    }
    // And the embedded config is what the code takes when a key is omitted (listeners aside:
    // a config file without any gets none).
    let mut embedded = powerhub::runtime::Config::embedded_default();
    let omitted = powerhub::runtime::Config::from_toml("", None).unwrap();
    embedded.listeners.clone_from(&omitted.listeners);
    assert_eq!(format!("{embedded:?}"), format!("{omitted:?}"));
}

/// The codes in docs/protocol.md's error table.
fn documented_codes() -> BTreeSet<String> {
    let text = doc("protocol.md");
    let start = text.find("`code` is one of:").expect("the error table");
    text[start..]
        .lines()
        .skip_while(|l| !l.starts_with("| code"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.split('|')
                .nth(1)
                .unwrap()
                .trim()
                .trim_matches('`')
                .to_owned()
        })
        .collect()
}

#[test]
fn the_error_table_lists_exactly_the_codes_the_server_can_send() {
    let documented = documented_codes();
    let sent: BTreeSet<String> = powerhub::protocol::ERROR_CODES
        .iter()
        .map(|c| (*c).to_owned())
        .collect();
    assert_eq!(
        documented, sent,
        "docs/protocol.md's table against powerhub::protocol::ERROR_CODES"
    );
}
