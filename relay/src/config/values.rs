//! Parsers and types for flag values: secret URLs, addresses, durations,
//! byte counts, and files holding secrets or certificates.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use outbox_client::SchemaName;

use super::ConfigError;
use crate::redact::redact_url;

/// A secret URL: Debug and Display show it with the password masked.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// The URL with its password, for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", redact_url(&self.0))
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.0))
    }
}

pub(super) fn parse_pg_url(s: &str) -> Result<SecretUrl, String> {
    crate::source::Database::check_url(s)
        .map(|_| SecretUrl(s.to_owned()))
        // The messages name the offending part, never the password; the
        // URL itself is cut out all the same.
        .map_err(|e| without(s, e.to_string()))
}

pub(super) fn parse_amqp_url(s: &str) -> Result<SecretUrl, String> {
    lapin::uri::AMQPUri::from_str(s)
        .map(|_| SecretUrl(s.to_owned()))
        // The parser's message quotes the whole URL, password and all.
        .map_err(|e| {
            without(
                s,
                format!(
                    "not an amqp:// or amqps:// URL (amqp://user:password@host:port/vhost): {e}"
                ),
            )
        })
}

/// `message` with `url` cut out, wherever it quotes it.
fn without(url: &str, message: String) -> String {
    if url.is_empty() {
        message
    } else {
        message.replace(url, "<the URL, not shown>")
    }
}

/// A clap parser for a URL that may hold a password: clap's own error
/// for a value its parser refuses quotes the value, and so the password
/// to the terminal and the logs; this one names the flag and the reason
/// only.
#[derive(Clone, Copy)]
pub(super) struct SecretUrlParser(pub(super) fn(&str) -> Result<SecretUrl, String>);

impl clap::builder::TypedValueParser for SecretUrlParser {
    type Value = SecretUrl;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<SecretUrl, clap::Error> {
        let flag = arg.map_or_else(|| "a URL".to_owned(), ToString::to_string);
        let refused = |reason: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!(
                    "invalid value for {flag} (not shown, as it may hold a password): {reason}\n"
                ),
            )
            .with_cmd(cmd)
        };
        let s = value
            .to_str()
            .ok_or_else(|| refused("not UTF-8".to_owned()))?;
        (self.0)(s).map_err(refused)
    }
}

/// An HTTP listen address, or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpAddr(pub Option<std::net::SocketAddr>);

pub(super) fn parse_http_addr(s: &str) -> Result<HttpAddr, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(HttpAddr(None));
    }
    s.parse()
        .map(|a| HttpAddr(Some(a)))
        .map_err(|e| format!("{e} (use host:port, e.g. 0.0.0.0:9839, or off)"))
}

pub(super) fn parse_schema(s: &str) -> Result<SchemaName, String> {
    SchemaName::new(s).map_err(|e| e.to_string())
}

pub(super) fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (use a unit, e.g. 250ms, 5s, 1m)"))
}

/// A byte count: a plain number, or one with a unit (KiB, MiB, GiB; KB, MB,
/// GB; B). At least 1.
pub(super) fn parse_bytes(s: &str) -> Result<i64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: i64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 8MiB, 512KiB, 1048576)"))?;
    let scale: i64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown unit {other:?} (use B, KiB, MiB, GiB, KB, MB or GB)"
            ))
        }
    };
    match n.checked_mul(scale) {
        Some(v) if v >= 1 => Ok(v),
        _ => Err(format!("{s:?} must be at least 1 byte and fit in 63 bits")),
    }
}

pub(super) fn read_secret(
    flag: &'static str,
    path: &PathBuf,
    parse: fn(&str) -> Result<SecretUrl, String>,
) -> Result<SecretUrl, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        flag,
        reason: format!("cannot read {}: {e}", path.display()),
    })?;
    parse(text.trim()).map_err(|reason| ConfigError { flag, reason })
}

pub(super) fn read_ca_file(flag: &'static str, path: &PathBuf) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        flag,
        reason: format!("cannot read {}: {e}", path.display()),
    })?;
    if !text.contains("-----BEGIN CERTIFICATE-----") {
        return Err(ConfigError {
            flag,
            reason: format!("{} holds no PEM certificate", path.display()),
        });
    }
    Ok(text)
}
