//! What every agent of the model runs with: how leaders are chosen, the family of the nodes'
//! addresses, and the flags.

use control::node::Granularity;

use super::sim::RESYNC;

/// How the agents choose their locations' leaders (`--leader-election`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Election {
    /// By lease: the elected leader holds its location's lease, a cut-off holder hands over.
    Lease,
    /// By Kilo's rule alone: the annotated node first, then the first by name, among the ready.
    Kilo,
}

/// The family of the nodes' addresses and pod CIDRs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// IPv4: `192.168.0.0/16` on every `eth0`, a `10.42.x.0/24` per node.
    V4,
    /// IPv6 only: `fd00::/64` on every `eth0`, an `fd42:0:0:x::/64` per node (the WireGuard
    /// subnet stays Kilo's IPv4 one, carried over IPv6 endpoints).
    V6,
}

/// The flags every model agent runs with: Kilo's defaults but the leader election, the
/// granularity and the leaders per location asked for, no CNI file and no encapsulation inside
/// a location (the twins have no tunnel).
pub(super) fn agent_args(
    name: &str,
    key_file: &std::path::Path,
    election: Election,
    granularity: Granularity,
    leaders_per_location: u16,
    post_quantum: bool,
) -> Vec<String> {
    let mut args = vec![
        // (The backend is given to the agent directly; the flags must only parse.)
        "--backend=file".to_string(),
        format!(
            "--cluster-dir={}",
            key_file.parent().unwrap_or(key_file).display()
        ),
        format!("--hostname={name}"),
        format!("--key-file={}", key_file.display()),
        "--cni=false".to_string(),
        match election {
            Election::Lease => "--leader-election=lease",
            Election::Kilo => "--leader-election=kilo",
        }
        .to_string(),
        format!("--mesh-granularity={}", granularity.as_str()),
        "--encapsulate=never".to_string(),
        format!("--resync-period={}s", RESYNC.as_secs()),
        format!("--leaders-per-location={leaders_per_location}"),
    ];
    if post_quantum {
        args.push("--post-quantum".to_string());
        args.push(format!("--psk-rotation-period={}s", PSK_ROTATION.as_secs()));
    }
    args
}

/// The agents' `--psk-rotation-period` with `--post-quantum`.
pub const PSK_ROTATION: std::time::Duration = std::time::Duration::from_secs(30);
