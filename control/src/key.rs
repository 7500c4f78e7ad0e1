//! WireGuard public keys as Kilo writes them: 32 bytes, standard base64. Secrets (preshared
//! keys) are `keys::SecretKey`, which never prints.

use std::fmt;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A WireGuard public key: 32 raw bytes.
///
/// Kilo treats an unparsable key as the all-zero key, which makes the node not ready; here that
/// case is `Option<Key>::None` instead.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(pub [u8; 32]);

/// Why a key did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The text is not standard base64.
    #[error("not base64")]
    NotBase64,
    /// The decoded key does not have 32 bytes.
    #[error("decodes to {0} bytes, want 32")]
    WrongLength(usize),
}

impl Key {
    /// Parses standard base64 of exactly 32 bytes (surrounding whitespace ignored).
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let bytes = STANDARD
            .decode(text.trim())
            .map_err(|_| KeyError::NotBase64)?;
        let raw: [u8; 32] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| KeyError::WrongLength(bytes.len()))?;
        Ok(Self(raw))
    }

    /// The key as standard base64, the form Kilo's annotations and `wg` use.
    pub fn to_base64(&self) -> String {
        STANDARD.encode(self.0)
    }

    /// True for the all-zero key, which Kilo treats as "no key".
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 32]
    }

    /// A key made of `text`'s bytes padded with zeros, as Kilo's test fixtures build them.
    pub fn padded(text: &str) -> Self {
        let mut raw = [0u8; 32];
        let n = text.len().min(32);
        raw[..n].copy_from_slice(&text.as_bytes()[..n]);
        Self(raw)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_base64())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.to_base64())
    }
}

impl Serialize for Key {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_base64())
    }
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Key::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_keys_match_kilos_fixture_encoding() {
        assert_eq!(
            Key::padded("key1").to_base64(),
            "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
        );
        assert_eq!(
            Key::padded("priv").to_base64(),
            "cHJpdgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
        );
    }

    #[test]
    fn parse_rejects_garbage_and_wrong_lengths() {
        assert_eq!(Key::parse("not base64!"), Err(KeyError::NotBase64));
        assert_eq!(Key::parse("AAAA"), Err(KeyError::WrongLength(3)));
        let key = Key::padded("abc");
        assert_eq!(Key::parse(&key.to_base64()), Ok(key));
    }
}
