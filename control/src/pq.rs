//! Post-quantum preshared keys: an ML-KEM-768 exchange per WireGuard link, through the tunnel,
//! that gives both ends one preshared key bound to both WireGuard keys and both ML-KEM keys.
//!
//! This module is the pure part: a node's ML-KEM identity ([`PqIdentity`]), the wire format
//! ([`message`]), the derivation ([`derive`]) and one link's state machine ([`link::PqLink`]),
//! which takes messages and `now` in and gives messages and the preshared key out. Nothing
//! here reads a clock, a socket or a random source: randomness comes in as bytes.
//! The design, its costs and its failure modes: `docs/design/keys.md`.

use blake2::{Blake2s256, Digest};
use hmac::{Mac, SimpleHmac};
use ml_kem::kem::{Decapsulate, KeyExport};
use ml_kem::ml_kem_768::{Ciphertext, DecapsulationKey, EncapsulationKey};

use keys::SecretKey;
use zeroize::Zeroizing;

use crate::key::Key;

pub mod book;
pub mod link;
pub mod message;

/// Bytes of an ML-KEM-768 encapsulation key.
pub const EK_LEN: usize = 1184;
/// Bytes of an ML-KEM-768 ciphertext.
pub const CT_LEN: usize = 1088;
/// Bytes of a decapsulation key's seed, the form it is kept in.
pub const SEED_LEN: usize = 64;
/// The UDP port kg's exchanges listen on, on every node that runs with `--post-quantum`.
pub const PQ_PORT: u16 = 51821;

/// HMAC-BLAKE2s, WireGuard's own primitive.
type HmacBlake2s = SimpleHmac<Blake2s256>;

/// HMAC-BLAKE2s of the concatenated `parts` under `key`.
pub(crate) fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = <HmacBlake2s as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

/// BLAKE2s-256 of `data`.
pub(crate) fn blake2s(data: &[u8]) -> [u8; 32] {
    Blake2s256::digest(data).into()
}

/// The fingerprint a node publishes for its encapsulation key: BLAKE2s-256 of the key's bytes.
pub fn fingerprint(ek: &[u8]) -> [u8; 32] {
    blake2s(ek)
}

/// What a node publishes in `kilotun.io/pq`: `v1:<base64 fingerprint>`, then `,fallback` when
/// its device counts failed handshakes, so that it drops a key that handshakes fail under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PqAnnouncement {
    /// The fingerprint of its encapsulation key.
    pub fingerprint: [u8; 32],
    /// True when it falls back (see [`link::PqLink::note_failed_handshakes`]).
    pub falls_back: bool,
}

impl PqAnnouncement {
    /// The annotation's value.
    pub fn format(&self) -> String {
        let flag = if self.falls_back { ",fallback" } else { "" };
        format!("v1:{}{flag}", Key(self.fingerprint).to_base64())
    }

    /// The announcement in an annotation's value, if it is one (flags it does not know are
    /// ignored, for the versions after this one).
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.strip_prefix("v1:")?.split(',');
        let fingerprint = Key::parse(parts.next()?).ok()?.0;
        let falls_back = parts.any(|flag| flag == "fallback");
        Some(Self {
            fingerprint,
            falls_back,
        })
    }
}

/// A node's ML-KEM-768 key pair, kept as its 64-byte seed.
pub struct PqIdentity {
    dk: DecapsulationKey,
    ek: Vec<u8>,
    fingerprint: [u8; 32],
}

impl std::fmt::Debug for PqIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PqIdentity")
            .field("fingerprint", &Key(self.fingerprint))
            .finish_non_exhaustive()
    }
}

impl PqIdentity {
    /// The key pair of `seed` (64 random bytes, kept secret).
    pub fn from_seed(seed: &[u8; SEED_LEN]) -> Self {
        let dk = DecapsulationKey::from_seed((*seed).into());
        let ek = dk.encapsulation_key().to_bytes().to_vec();
        let fingerprint = fingerprint(&ek);
        Self {
            dk,
            ek,
            fingerprint,
        }
    }

    /// The encapsulation key's bytes, sent to peers that ask.
    pub fn encapsulation_key(&self) -> &[u8] {
        &self.ek
    }

    /// The fingerprint published as `kilotun.io/pq`.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// The shared secret in `ct`, wiped when dropped. A tampered ciphertext gives an unrelated
    /// secret (implicit rejection): only the key confirmation shows it.
    fn decapsulate(&self, ct: &[u8; CT_LEN]) -> Zeroizing<[u8; 32]> {
        let ct: Ciphertext = (*ct).into();
        Zeroizing::new(self.dk.decapsulate(&ct).into())
    }
}

/// A peer's encapsulation key, checked: its fingerprint is the one the peer published and
/// its coefficients are in range.
pub struct PeerEk(EncapsulationKey);

/// Why a peer's encapsulation key was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EkRefused {
    /// Not 1,184 bytes.
    #[error("an ML-KEM-768 encapsulation key is 1184 bytes")]
    Length,
    /// Its fingerprint is not the published one.
    #[error("its fingerprint is not the one the peer published")]
    Fingerprint,
    /// It does not decode (a coefficient out of range).
    #[error("it is not a valid ML-KEM-768 encapsulation key")]
    Invalid,
}

impl PeerEk {
    /// `bytes` as the encapsulation key of a peer that published `published` as its fingerprint.
    pub fn check(bytes: &[u8], published: &[u8; 32]) -> Result<Self, EkRefused> {
        let array: [u8; EK_LEN] = bytes.try_into().map_err(|_| EkRefused::Length)?;
        if fingerprint(&array) != *published {
            return Err(EkRefused::Fingerprint);
        }
        EncapsulationKey::new(&array.into())
            .map(Self)
            .map_err(|_| EkRefused::Invalid)
    }

    /// A ciphertext and its shared secret (wiped when dropped), from 32 uniformly random bytes.
    fn encapsulate(&self, randomness: &[u8; 32]) -> ([u8; CT_LEN], Zeroizing<[u8; 32]>) {
        let (ct, shared) = self.0.encapsulate_deterministic(&(*randomness).into());
        (ct.into(), Zeroizing::new(shared.into()))
    }
}

/// What one exchange binds its key to: both WireGuard keys and both fingerprints (the
/// initiator's first), its epoch and both nonces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The initiator's WireGuard public key (the lower of the two).
    pub initiator: Key,
    /// The responder's.
    pub responder: Key,
    /// The initiator's ML-KEM fingerprint.
    pub initiator_fp: [u8; 32],
    /// The responder's.
    pub responder_fp: [u8; 32],
    /// The exchange's epoch.
    pub epoch: u64,
    /// The initiator's nonce.
    pub initiator_nonce: [u8; 16],
    /// The responder's nonce.
    pub responder_nonce: [u8; 16],
}

/// What an exchange derives: the preshared key and the key confirmation.
#[derive(Clone, PartialEq, Eq)]
pub struct Derived {
    /// The link's next preshared key.
    pub psk: SecretKey,
    /// What the responder sends to show it derived the same key.
    pub confirmation: [u8; 16],
}

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Derived { .. }")
    }
}

/// The preshared key and confirmation of the exchange with shared secret `shared`,
/// ciphertext `ct` and binding `b`.
pub fn derive(shared: &[u8; 32], ct: &[u8], b: &Binding) -> Derived {
    // The intermediate keys are wiped when dropped, as the results are.
    let prk = Zeroizing::new(hmac(b"kilotun-pqpsk-v1", &[shared, &blake2s(ct)]));
    let epoch = b.epoch.to_be_bytes();
    let info: [&[u8]; 7] = [
        &b.initiator.0,
        &b.responder.0,
        &b.initiator_fp,
        &b.responder_fp,
        &epoch,
        &b.initiator_nonce,
        &b.responder_nonce,
    ];
    let with = |label: u8| {
        let mut parts = info.to_vec();
        let label = [label];
        parts.push(&label);
        Zeroizing::new(hmac(&*prk, &parts))
    };
    let confirm_key = with(2);
    let mut confirmation = [0u8; 16];
    confirmation.copy_from_slice(&hmac(&*confirm_key, &[b"confirm"])[..16]);
    Derived {
        psk: SecretKey::from_bytes(*with(1)),
        confirmation,
    }
}

/// The key every message of a link is tagged with, from the X25519 agreement of the two
/// nodes' WireGuard keys (which only the two nodes can compute): a pod behind either cannot
/// forge a message even from the node's WireGuard IP.
pub fn tag_key(static_agreement: &[u8; 32]) -> SecretKey {
    SecretKey::from_bytes(hmac(b"kilotun-pq-tag-v1", &[static_agreement]))
}

#[cfg(test)]
#[path = "pq/tests.rs"]
mod tests;

#[cfg(test)]
#[path = "pq/model_tests.rs"]
mod model_tests;
