//! WireGuard keys as typed values, shared by the engine (`dataplane`), the pure control plane
//! (`control`) and the agent.
//!
//! Public keys print in base64 (as `wg` shows them). Secrets, private and preshared keys alike,
//! are one type, [`SecretKey`]: its `Debug` and `Display` say `<redacted>`, two secrets are
//! compared in constant time, its bytes are wiped when it is dropped, and its text comes only
//! through the explicit [`SecretKey::expose_hex`] and [`SecretKey::expose_base64`], which
//! return text that is wiped when dropped too.

use std::fmt;

use base64::Engine as _;
use subtle::ConstantTimeEq as _;
use x25519_dalek::{PublicKey as DalekPublic, StaticSecret};
use zeroize::{Zeroize as _, Zeroizing};

/// Why a key's text could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The text was neither 64 hex digits nor 44 characters of base64 for 32 bytes.
    #[error("a WireGuard key is 32 bytes as 64 hex digits or 44 base64 characters (got {len} characters)")]
    Malformed {
        /// Length of the rejected text.
        len: usize,
    },
}

fn decode_32(text: &str, allow_base64: bool) -> Result<[u8; 32], KeyError> {
    let text = text.trim();
    let mut out = [0u8; 32];
    if text.len() == 64 && hex::decode_to_slice(text, &mut out).is_ok() {
        return Ok(out);
    }
    if allow_base64 && text.len() == 44 {
        if let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(text) {
            if let Ok(arr) = <[u8; 32]>::try_from(bytes.as_slice()) {
                return Ok(arr);
            }
        }
    }
    Err(KeyError::Malformed { len: text.len() })
}

/// A peer's or this device's public key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey([u8; 32]);

impl PublicKey {
    /// Wraps 32 raw bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Parses 64 hex digits (UAPI) or 44 base64 characters (`wg`, Kilo annotations).
    ///
    /// # Errors
    /// [`KeyError::Malformed`] when the text is neither.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        decode_32(text, true).map(Self)
    }

    /// Parses exactly 64 hex digits, the UAPI encoding.
    ///
    /// # Errors
    /// [`KeyError::Malformed`] otherwise.
    pub fn from_hex(text: &str) -> Result<Self, KeyError> {
        decode_32(text, false).map(Self)
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex, the UAPI encoding.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Standard base64, as `wg` prints keys.
    pub fn to_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.0)
    }

    /// The dalek type boringtun takes.
    pub fn to_dalek(&self) -> DalekPublic {
        DalekPublic::from(self.0)
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({})", self.to_base64())
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_base64())
    }
}

/// A 32-byte secret: a private key or a preshared key. Wiped on drop, compared in constant
/// time, never printed.
#[derive(Clone)]
pub struct SecretKey([u8; 32]);

impl SecretKey {
    /// Wraps 32 raw bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Generates a fresh random X25519 private key (clamped as `wg genkey` does).
    pub fn generate() -> Self {
        let mut bytes = StaticSecret::random_from_rng(rand_core::OsRng).to_bytes();
        bytes[0] &= 248;
        bytes[31] &= 127;
        bytes[31] |= 64;
        Self(bytes)
    }

    /// Parses 64 hex digits or 44 base64 characters.
    ///
    /// # Errors
    /// [`KeyError::Malformed`] when the text is neither; the error never contains the text.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        decode_32(text, true).map(Self)
    }

    /// Parses exactly 64 hex digits, the UAPI encoding.
    ///
    /// # Errors
    /// [`KeyError::Malformed`] otherwise.
    pub fn from_hex(text: &str) -> Result<Self, KeyError> {
        decode_32(text, false).map(Self)
    }

    /// Parses standard base64 of exactly 32 bytes (surrounding whitespace ignored), the only
    /// form Kilo's Peers and `wg`'s files give a preshared key in.
    ///
    /// # Errors
    /// [`KeyError::Malformed`] otherwise; the error never contains the text.
    pub fn from_base64(text: &str) -> Result<Self, KeyError> {
        let text = text.trim();
        let bytes = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|_| KeyError::Malformed { len: text.len() })?,
        );
        <[u8; 32]>::try_from(bytes.as_slice())
            .map(Self)
            .map_err(|_| KeyError::Malformed { len: text.len() })
    }

    /// True for the all-zero key, which UAPI uses to mean "none".
    pub fn is_zero(&self) -> bool {
        bool::from(self.0.ct_eq(&[0u8; 32]))
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex, the UAPI encoding: for the UAPI `get` answer (a root-only socket) and
    /// the device's configuration. The text is wiped when dropped.
    pub fn expose_hex(&self) -> Zeroizing<String> {
        Zeroizing::new(hex::encode(self.0))
    }

    /// Standard base64, as `wg` and key files write it: for a key file, a configuration the
    /// user asked for (`kgctl showconf`), or the device. The text is wiped when dropped.
    pub fn expose_base64(&self) -> Zeroizing<String> {
        Zeroizing::new(base64::engine::general_purpose::STANDARD.encode(self.0))
    }

    /// The public key of this private key.
    pub fn public_key(&self) -> PublicKey {
        let secret = StaticSecret::from(self.0);
        PublicKey(DalekPublic::from(&secret).to_bytes())
    }

    /// The dalek secret boringtun takes.
    pub fn to_dalek(&self) -> StaticSecret {
        StaticSecret::from(self.0)
    }
}

impl Drop for SecretKey {
    fn drop(&mut self) {
        // zeroize's writes are volatile: the compiler cannot elide the wipe of a dying value.
        self.0.zeroize();
    }
}

impl PartialEq for SecretKey {
    /// In constant time: how long a comparison takes says nothing of where two secrets differ.
    fn eq(&self, other: &Self) -> bool {
        bool::from(self.0.ct_eq(&other.0))
    }
}

impl Eq for SecretKey {}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(<redacted>)")
    }
}

impl fmt::Display for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_base64_parse_to_the_same_key() {
        let secret = SecretKey::generate();
        let public = secret.public_key();
        assert_eq!(PublicKey::parse(&public.to_hex()).unwrap(), public);
        assert_eq!(PublicKey::parse(&public.to_base64()).unwrap(), public);
        assert_eq!(PublicKey::from_hex(&public.to_hex()).unwrap(), public);
        assert!(PublicKey::from_hex(&public.to_base64()).is_err());
    }

    #[test]
    fn malformed_keys_are_rejected_with_their_length() {
        assert_eq!(PublicKey::parse("abc"), Err(KeyError::Malformed { len: 3 }));
        assert!(PublicKey::parse(&"g".repeat(64)).is_err());
        assert!(SecretKey::parse(&"=".repeat(44)).is_err());
    }

    #[test]
    fn secret_keys_never_print() {
        let secret = SecretKey::generate();
        let shown = format!("{secret:?} {secret}");
        assert!(!shown.contains(secret.expose_hex().as_str()));
        assert!(!shown.contains(secret.expose_base64().as_str()));
        assert_eq!(shown, "SecretKey(<redacted>) <redacted>");
    }

    #[test]
    fn secrets_compare_by_value() {
        let a = SecretKey::from_bytes([7; 32]);
        let mut other = [7; 32];
        assert_eq!(a, SecretKey::from_bytes(other));
        other[31] = 8;
        assert_ne!(a, SecretKey::from_bytes(other));
        assert!(SecretKey::from_bytes([0; 32]).is_zero());
        assert!(!a.is_zero());
    }

    #[test]
    fn public_key_matches_wg_pubkey_vector() {
        // `wg pubkey` of this private key, computed with wireguard-tools.
        let secret = SecretKey::parse("YEocP0e2o1WT5GlvBvQzVF7EeR6z9aCk5ANNzgS9tF0=").unwrap();
        assert_eq!(
            secret.public_key().to_base64(),
            "99poomPL4KGtAwJOmHOeNXRBABjHOXxQI7/+vC8iERY="
        );
    }
}
