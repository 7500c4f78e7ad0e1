//! The CNI configuration kg keeps in step with the node (Kilo's `--cni`): the conflist's IPAM
//! ranges on the pod CIDRs and its MTU on the link's.

use ipnet::IpNet;

use super::shells::{Device, Firewall, Kernel};
use super::Agent;

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Keeps the CNI conflist's IPAM ranges on the pod CIDRs (one set per family) and its MTU
    /// on the link's. A missing or unreadable file is a warning, never a failure.
    pub(super) fn sync_cni(&mut self, pod_cidrs: &[IpNet], mtu: u32) {
        let path = self.cni_file.path().display().to_string();
        let text = match self.cni_file.read() {
            Ok(t) => t,
            Err(e) => {
                self.problems.warn_once(
                    "cni",
                    &format!("cannot read the CNI configuration {path}: {e}; not managing it"),
                );
                return;
            }
        };
        match control::cni::update_conflist(&text, pod_cidrs, Some(mtu)) {
            Ok(None) => {}
            Ok(Some(updated)) => match self.cni_file.write(&updated) {
                Ok(()) => {
                    tracing::info!(path, pod_cidrs = ?pod_cidrs, mtu, "CNI configuration updated")
                }
                Err(e) => {
                    tracing::warn!(
                        path,
                        error = format!("{e:#}"),
                        "writing the CNI configuration failed"
                    )
                }
            },
            Err(e) => self.problems.warn_once(
                "cni",
                &format!("CNI configuration {path}: {e}; not managing it"),
            ),
        }
    }
}
