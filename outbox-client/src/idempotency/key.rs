use std::fmt;

use sha2::{Digest, Sha256};

use super::Error;

/// The longest key accepted, in bytes. Stripe and the IETF draft both leave the
/// exact limit to the server; 255 fits any UUID, ULID or hash a client makes.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1 to [`MAX_KEY_LEN`] visible ASCII characters
/// (`!` to `~`, no spaces), taken exactly as the client sent it.
///
/// A client that follows the IETF draft sends the key as a quoted string
/// (`"8e03978e-..."`); the quotes are then part of the key, which is fine as
/// long as the client sends it the same way on every retry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates `key`.
    pub fn new(key: &str) -> Result<Self, Error> {
        if key.is_empty() {
            return Err(Error::InvalidKey { reason: "empty" });
        }
        if key.len() > MAX_KEY_LEN {
            return Err(Error::InvalidKey {
                reason: "longer than 255 characters",
            });
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::InvalidKey {
                reason: "only visible ASCII characters are allowed, no spaces",
            });
        }
        Ok(IdempotencyKey(key.to_owned()))
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        IdempotencyKey::new(s)
    }
}

/// SHA-256 over a request's method, path (with query) and body.
///
/// Stored with the key so that the same key sent with a *different* request is
/// recognised ([`Begin::Mismatch`](super::Begin::Mismatch)) instead of being
/// answered with another request's response. Each part is length-prefixed, so
/// moving bytes between path and body changes the fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of one request.
    pub fn new(method: &str, path_and_query: &str, body: &[u8]) -> Self {
        let mut h = Sha256::new();
        for part in [method.as_bytes(), path_and_query.as_bytes(), body] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        Fingerprint(h.finalize().into())
    }

    /// A fingerprint computed elsewhere (e.g. over a canonical form of the body).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_length_and_charset_rules() {
        for ok in [
            "a",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
            "\"quoted\"",
            &"k".repeat(255),
        ] {
            assert_eq!(
                IdempotencyKey::new(ok).map(|k| k.0).ok().as_deref(),
                Some(ok)
            );
        }
        for bad in ["", " ", "a b", "tab\t", "é", "nul\0", &"k".repeat(256)] {
            assert!(
                matches!(IdempotencyKey::new(bad), Err(Error::InvalidKey { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn fingerprint_separates_every_part() {
        let base = Fingerprint::new("POST", "/credits", b"{\"amount\":100}");
        assert_eq!(
            base,
            Fingerprint::new("POST", "/credits", b"{\"amount\":100}")
        );
        assert_ne!(
            base,
            Fingerprint::new("PUT", "/credits", b"{\"amount\":100}")
        );
        assert_ne!(
            base,
            Fingerprint::new("POST", "/credits?x=1", b"{\"amount\":100}")
        );
        assert_ne!(
            base,
            Fingerprint::new("POST", "/credits", b"{\"amount\":101}")
        );
        // Length prefixes: the same bytes split differently are different requests.
        assert_ne!(
            Fingerprint::new("POST", "/ab", b"c"),
            Fingerprint::new("POST", "/a", b"bc")
        );
    }
}
