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

/// Every source file of the crate and its transports.
fn sources() -> Vec<(String, String)> {
    fn walk(dir: &std::path::Path, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push((
                    path.display().to_string(),
                    std::fs::read_to_string(&path).unwrap(),
                ));
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    walk(&root.join("src"), &mut out);
    for plugin in std::fs::read_dir(root.join("plugins")).unwrap() {
        let src = plugin.unwrap().path().join("src");
        if src.is_dir() {
            walk(&src, &mut out);
        }
    }
    out
}

/// The arguments of the call whose `(` is at `open`, split at top-level commas (string
/// literals and nested brackets skipped).
fn call_args(text: &str, open: usize) -> Vec<String> {
    let (mut depth, mut args, mut cur, mut in_str, mut esc) =
        (0, Vec::new(), String::new(), false, false);
    for c in text[open..].chars() {
        if in_str {
            cur.push(c);
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_str = true;
                cur.push(c);
            }
            '(' | '[' | '{' => {
                depth += 1;
                if depth > 1 {
                    cur.push(c);
                }
            }
            ')' | ']' | '}' => {
                depth -= 1;
                if depth == 0 {
                    args.push(cur.trim().to_owned());
                    return args;
                }
                cur.push(c);
            }
            ',' if depth == 1 => args.push(std::mem::take(&mut cur).trim().to_owned()),
            _ => cur.push(c),
        }
    }
    args
}

/// So that the table's check covers what is sent: every error is built with a code from
/// `powerhub_plugin::codes`, never with a string literal.
#[test]
fn every_error_the_server_builds_takes_its_code_from_the_one_list() {
    let mut literal = Vec::new();
    for (path, text) in sources() {
        for (at, _) in text
            .match_indices("error(")
            .chain(text.match_indices("error_with_limit("))
        {
            let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
            let line = text[line_start..at].trim_start();
            if line.starts_with("//")
                || !text[..at].ends_with("reply::")
                    && !text[..at].ends_with("reply::error_with_limit")
                    && !line.contains("reply::")
            {
                continue;
            }
            let open = at + text[at..].find('(').unwrap();
            let args = call_args(&text, open);
            if args.get(1).is_some_and(|code| code.starts_with('"')) {
                literal.push(format!(
                    "{path}: {}",
                    &text[line_start..open + 40.min(text.len() - open)]
                ));
            }
        }
        for (at, _) in text.match_indices("\\\"code\\\":\\\"") {
            let after = &text[at + 11..];
            if after.starts_with(|c: char| c.is_ascii_lowercase()) {
                literal.push(format!(
                    "{path}: {}",
                    &text[at..at + 40.min(text.len() - at)]
                ));
            }
        }
    }
    assert!(
        literal.is_empty(),
        "codes written as literals: {literal:#?}"
    );
}

#[test]
fn the_worked_example_of_docs_security_is_a_config_the_server_accepts() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/examples/secure.toml");
    let config = powerhub::runtime::Config::from_file(&path).expect("the example parses");
    let auth = config.auth.as_ref().expect("it configures [auth]");
    powerhub::security::auth::Authenticator::from_config(auth).expect("its [auth] builds");
    let tls: Vec<_> = config
        .listeners
        .iter()
        .map(|l| {
            powerhub::security::tls::TlsFiles::from_listener_keys(
                l.tls_cert.as_deref(),
                l.tls_key.as_deref(),
                l.tls_client_ca.as_deref(),
            )
            .expect("complete TLS keys")
            .is_some()
        })
        .collect();
    assert_eq!(tls, [true, true, true], "every listener has TLS");
    assert!(doc("security.md").contains("docs/examples/secure.toml"));
}
