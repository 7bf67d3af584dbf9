use std::fmt;

use crate::Error;

/// A validated Postgres schema name: 1 to 63 characters of `a-z`, `0-9` and `_`,
/// not starting with a digit.
///
/// The name is spliced into SQL text (identifiers cannot be bind parameters), so
/// it is checked here once and quoted on every use.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SchemaName(String);

impl SchemaName {
    /// The default schema, `outbox`.
    pub const DEFAULT: &'static str = "outbox";

    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self, Error> {
        let valid = !name.is_empty()
            && name.len() <= 63
            && !name.as_bytes()[0].is_ascii_digit()
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if valid {
            Ok(SchemaName(name.to_owned()))
        } else {
            Err(Error::InvalidSchemaName {
                name: name.to_owned(),
            })
        }
    }

    /// The bare name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name quoted as an SQL identifier, e.g. `"outbox"`.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }

    /// The LISTEN/NOTIFY channel the insert trigger signals, e.g. `outbox.messages`.
    pub fn notify_channel(&self) -> String {
        format!("{}.messages", self.0)
    }
}

impl Default for SchemaName {
    fn default() -> Self {
        SchemaName(Self::DEFAULT.to_owned())
    }
}

impl fmt::Display for SchemaName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for SchemaName {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        SchemaName::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers() {
        for ok in ["outbox", "_x", "a1_b2", &"a".repeat(63)] {
            assert_eq!(
                SchemaName::new(ok).map(|s| s.quoted()).ok(),
                Some(format!("\"{ok}\""))
            );
        }
    }

    #[test]
    fn rejects_anything_that_could_escape_quoting() {
        for bad in [
            "",
            "1abc",
            "Outbox",
            "a\"b",
            "a;drop",
            "a b",
            "é",
            &"a".repeat(64),
        ] {
            assert!(
                matches!(SchemaName::new(bad), Err(Error::InvalidSchemaName { .. })),
                "{bad:?} accepted"
            );
        }
    }
}
