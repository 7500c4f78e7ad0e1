//! The exchange's messages on the wire: a type byte, fixed fields, and a 16-byte tag (the first
//! half of HMAC-BLAKE2s under the link's tag key over everything before it). Each type has one
//! exact length; anything else is refused before the tag is checked.

use keys::SecretKey;

use super::{hmac, CT_LEN, EK_LEN};

/// Bytes of a message's tag.
pub const TAG_LEN: usize = 16;

/// One message of the exchange.
#[derive(Clone, PartialEq, Eq)]
pub enum Message {
    /// The initiator asks for the responder's encapsulation key.
    KeyRequest,
    /// The responder's encapsulation key.
    Key {
        /// Its bytes (checked against the published fingerprint by the receiver).
        ek: Box<[u8; EK_LEN]>,
    },
    /// The initiator's ciphertext for epoch `epoch`.
    Init {
        /// The exchange's epoch: above every one the responder accepted.
        epoch: u64,
        /// The initiator's nonce.
        nonce: [u8; 16],
        /// The ciphertext, encapsulated to the responder's key.
        ct: Box<[u8; CT_LEN]>,
    },
    /// The responder derived a key: its nonce and the key confirmation.
    Ack {
        /// The epoch answered.
        epoch: u64,
        /// The responder's nonce.
        nonce: [u8; 16],
        /// Shows the responder derived the initiator's key.
        confirmation: [u8; 16],
    },
    /// The initiator asks the responder to use the key of `epoch`.
    Commit {
        /// The epoch.
        epoch: u64,
    },
    /// The responder uses the key of `epoch`.
    Done {
        /// The epoch.
        epoch: u64,
    },
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::KeyRequest => f.write_str("KeyRequest"),
            Self::Key { .. } => f.write_str("Key"),
            Self::Init { epoch, .. } => write!(f, "Init({epoch})"),
            Self::Ack { epoch, .. } => write!(f, "Ack({epoch})"),
            Self::Commit { epoch } => write!(f, "Commit({epoch})"),
            Self::Done { epoch } => write!(f, "Done({epoch})"),
        }
    }
}

/// Why a datagram was refused before any state changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, thiserror::Error)]
pub enum Malformed {
    /// Empty, or a type byte kg does not know.
    #[error("unknown message type")]
    Type,
    /// Not the exact length of its type.
    #[error("wrong length for its type")]
    Length,
    /// The tag is not the link's.
    #[error("tag does not verify")]
    Tag,
}

impl Malformed {
    /// A label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Self::Type => "type",
            Self::Length => "length",
            Self::Tag => "tag",
        }
    }
}

const KEY_REQUEST: u8 = 1;
const KEY: u8 = 2;
const INIT: u8 = 3;
const ACK: u8 = 4;
const COMMIT: u8 = 5;
const DONE: u8 = 6;

/// The length of a whole message of type `kind`, tag included.
fn length_of(kind: u8) -> Option<usize> {
    let body = match kind {
        KEY_REQUEST => 0,
        KEY => EK_LEN,
        INIT => 8 + 16 + CT_LEN,
        ACK => 8 + 16 + 16,
        COMMIT | DONE => 8,
        _ => return None,
    };
    Some(1 + body + TAG_LEN)
}

fn tag(key: &[u8; 32], data: &[u8]) -> [u8; TAG_LEN] {
    let mut out = [0u8; TAG_LEN];
    out.copy_from_slice(&hmac(key, &[data])[..TAG_LEN]);
    out
}

impl Message {
    /// The datagram carrying this message, tagged under `key`.
    pub fn encode(&self, key: &SecretKey) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + EK_LEN + TAG_LEN);
        match self {
            Self::KeyRequest => out.push(KEY_REQUEST),
            Self::Key { ek } => {
                out.push(KEY);
                out.extend_from_slice(&ek[..]);
            }
            Self::Init { epoch, nonce, ct } => {
                out.push(INIT);
                out.extend_from_slice(&epoch.to_be_bytes());
                out.extend_from_slice(nonce);
                out.extend_from_slice(&ct[..]);
            }
            Self::Ack {
                epoch,
                nonce,
                confirmation,
            } => {
                out.push(ACK);
                out.extend_from_slice(&epoch.to_be_bytes());
                out.extend_from_slice(nonce);
                out.extend_from_slice(confirmation);
            }
            Self::Commit { epoch } | Self::Done { epoch } => {
                out.push(if matches!(self, Self::Commit { .. }) {
                    COMMIT
                } else {
                    DONE
                });
                out.extend_from_slice(&epoch.to_be_bytes());
            }
        }
        let t = tag(key.as_bytes(), &out);
        out.extend_from_slice(&t);
        out
    }

    /// The message in `datagram`, if its type, length and tag (under `key`) are right.
    pub fn decode(datagram: &[u8], key: &SecretKey) -> Result<Self, Malformed> {
        let kind = *datagram.first().ok_or(Malformed::Type)?;
        let len = length_of(kind).ok_or(Malformed::Type)?;
        if datagram.len() != len {
            return Err(Malformed::Length);
        }
        let (data, given) = datagram.split_at(len - TAG_LEN);
        // Not secret-dependent timing that matters here: the tag key is per link and the
        // message is dropped either way, but compare without an early exit all the same.
        let expected = tag(key.as_bytes(), data);
        if expected
            .iter()
            .zip(given)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            != 0
        {
            return Err(Malformed::Tag);
        }
        let body = &data[1..];
        let epoch = || u64::from_be_bytes(body[..8].try_into().expect("length checked"));
        let bytes16 = |at: usize| -> [u8; 16] { body[at..at + 16].try_into().expect("checked") };
        Ok(match kind {
            KEY_REQUEST => Self::KeyRequest,
            KEY => Self::Key {
                ek: Box::new(body.try_into().expect("length checked")),
            },
            INIT => Self::Init {
                epoch: epoch(),
                nonce: bytes16(8),
                ct: Box::new(body[24..].try_into().expect("length checked")),
            },
            ACK => Self::Ack {
                epoch: epoch(),
                nonce: bytes16(8),
                confirmation: bytes16(24),
            },
            COMMIT => Self::Commit { epoch: epoch() },
            _ => Self::Done { epoch: epoch() },
        })
    }
}
