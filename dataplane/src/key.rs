//! WireGuard keys as typed values.
//!
//! Public keys print in base64 (as `wg` shows them). Secret keys (private and preshared) never
//! print: their `Debug` says `<redacted>`, and the only way to get their text is the explicit
//! [`SecretKey::to_hex`] used by the UAPI `get` answer, which goes to root only.

use std::fmt;

use base64::Engine as _;
use x25519_dalek::{PublicKey as DalekPublic, StaticSecret};

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

/// A 32-byte secret: a private key or a preshared key. Zeroed on drop; never printed.
#[derive(Clone, PartialEq, Eq)]
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

    /// True for the all-zero key, which UAPI uses to mean "none".
    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|b| *b == 0)
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex. Only the UAPI `get` answer (root-only socket) uses this.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Standard base64, for writing key files.
    pub fn to_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.0)
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
        // Volatile writes so the compiler cannot elide the wipe of a value about to die.
        for byte in &mut self.0 {
            // SAFETY: `byte` is a valid, aligned, exclusive reference into our own array.
            unsafe { std::ptr::write_volatile(byte, 0) };
        }
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(<redacted>)")
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
        let shown = format!("{secret:?}");
        assert!(!shown.contains(&secret.to_hex()));
        assert!(!shown.contains(&secret.to_base64()));
        assert_eq!(shown, "SecretKey(<redacted>)");
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
