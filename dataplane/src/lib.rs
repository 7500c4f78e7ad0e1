//! kilotun's userspace WireGuard dataplane.
//!
//! * [`Engine`]: the packet logic around boringtun's noise layer. It owns no file descriptor and
//!   no thread, and takes `now` as an argument.
//! * [`uapi`]: the text protocol `wg` speaks, parsed and rendered without I/O.
//! * [`io`]: the TUN and UDP seams, with Linux implementations and in-memory twins.
//! * [`device`]: a running device: worker threads moving packets between the seams and the
//!   engine, a timer thread, and the UAPI socket.

pub mod allowed_ips;
pub mod config;
pub mod device;
pub mod endpoint;
pub mod engine;
mod eventfd;
pub mod fuzzing;
pub mod gro;
pub mod helpers;
pub mod io;
pub mod ipip;
pub mod key;
pub mod outbox;
pub mod packet;
pub mod stats;
pub mod testing;
pub mod uapi;
pub mod uapi_diff;
pub mod uapi_server;

pub use config::{ApplyReport, DeviceConfig, InterfaceConfig, PeerConfig};
pub use endpoint::{Endpoint, LocalAddr};
pub use engine::{Engine, GaveUp};
pub use key::{KeyError, PublicKey, SecretKey};
pub use outbox::Outbox;
pub use stats::{DropReason, PeerStats, RejectedHandshake};
