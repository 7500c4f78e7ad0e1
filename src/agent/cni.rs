//! The CNI configuration kg keeps in step with the node (Kilo's `--cni`).

use ipnet::IpNet;

use super::shells::{Engine, Firewall, Kernel};
use super::{write_file, Agent};

impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// Keeps the CNI conflist's IPAM ranges on the pod CIDRs (one set per family) and its MTU
    /// on the link's. A missing or unreadable file is a warning, never a failure.
    pub(super) fn sync_cni(&mut self, pod_cidrs: &[IpNet], mtu: u32) {
        let path = self.s.args.cni_path.clone();
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                self.warn_once(
                    "cni",
                    &format!(
                        "cannot read the CNI configuration {}: {e}; not managing it",
                        path.display()
                    ),
                );
                return;
            }
        };
        match control::cni::update_conflist(&text, pod_cidrs, Some(mtu)) {
            Ok(None) => {}
            Ok(Some(updated)) => match write_file(&path, &updated, 0o644) {
                Ok(()) => {
                    tracing::info!(path = %path.display(), pod_cidrs = ?pod_cidrs, mtu, "CNI configuration updated")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = format!("{e:#}"), "writing the CNI configuration failed")
                }
            },
            Err(e) => self.warn_once(
                "cni",
                &format!("CNI configuration {}: {e}; not managing it", path.display()),
            ),
        }
    }
}
