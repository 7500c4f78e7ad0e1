//! WireGuard keys: the `keys` crate's types, which the engine, the control plane and the agent
//! share.

pub use keys::{KeyError, PublicKey, SecretKey};
