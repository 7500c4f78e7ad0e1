//! How kg stops: what it undoes on SIGTERM (routes, rules, annotations, the engine), and what
//! it leaves to a successor that replaces it.

use std::collections::BTreeMap;

use control::journal::Reason;
use control::node::annotation;
use control::routes::{diff, RoutePlan};

use super::shells::Firewall;
use super::Agent;

impl Agent {
    /// Undoes what kg set up: routes and rules, the annotations it wrote (with `--clean-up`),
    /// and the engine. When another kg replaces this one (`--keep-on-replace` and a backend
    /// that says so), only the engine stops: the node keeps everything else for its successor.
    pub async fn shut_down(mut self) {
        let cleaning = self.settings.args.clean_up || self.settings.args.clean_up_interface;
        if cleaning && self.settings.args.keep_on_replace {
            let (reason, message) = match self.backend.departure().await {
                crate::backend::Departure::Replaced { by } => (
                    Reason::Replaced,
                    format!("{by} replaces this kg: keeping the node's annotations, routes, rules and link for the next one"),
                ),
                crate::backend::Departure::Removed { why } => {
                    (Reason::Removed, format!("cleaning up: {why}"))
                }
            };
            let hostname = self.settings.hostname.clone();
            self.core.journal().record(reason, hostname, message);
            self.publish_events(super::read_clock());
            if reason == Reason::Replaced {
                return self.stop_engine(false).await;
            }
        }
        if self.settings.args.clean_up {
            // A back end that could not be chosen holds none of kg's rules.
            if let Ok(Some(v6)) = self.firewall_ready.wait(&self.firewall).await {
                let firewall = self.firewall;
                match tokio::task::spawn_blocking(move || firewall.clean_up(v6)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(error = format!("{e:#}"), "removing iptables rules failed")
                    }
                    Err(e) => tracing::warn!(error = %e, "removing iptables rules failed"),
                }
            }
            if let Ok(observed) = self.netlink.observe().await {
                let ops = diff(
                    &RoutePlan::default(),
                    &observed,
                    self.core.owned_routes(),
                    self.kilo_index,
                );
                let failed = self.netlink.apply(&ops).await;
                for e in &failed {
                    tracing::warn!(error = format!("{e:#}"), "removing a route failed");
                }
                if failed.is_empty() {
                    let _ = super::shells::state::save_routes(
                        &self.settings.args.key_file,
                        &RoutePlan::default(),
                    );
                }
            }
            let removal: BTreeMap<String, Option<String>> = annotation::WRITTEN
                .iter()
                .filter(|a| **a != annotation::CNI_COMPATIBILITY_IP)
                // The rotation request last carried out stays: without it, the next kg would
                // take the request still on the Node for a new one and rotate again.
                .filter(|a| **a != annotation::KEY_ROTATED)
                .map(|a| (a.to_string(), None))
                .collect();
            if let Err(e) = self
                .backend
                .patch_annotations(&self.settings.hostname, &removal)
                .await
            {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "removing the node's annotations failed"
                );
            }
        }
        if let Some(name) = self
            .tunnel
            .ipv6_outer()
            .filter(|_| self.settings.args.clean_up_interface)
        {
            if let Ok(Some(link)) = self.netlink.link_by_name(name).await {
                if let Err(e) = self.netlink.delete_link(link.index).await {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        link = name,
                        "deleting the link failed"
                    );
                }
            }
        }
        let delete_link = self.settings.args.clean_up_interface;
        self.stop_engine(delete_link).await;
    }

    /// Stops the engine, and deletes its link with `delete_link` when the link is its own.
    async fn stop_engine(self, delete_link: bool) {
        let index = self.kilo_index;
        // The HTTP handlers hold the engine too: it stops all the same (see `WireGuard::shutdown`).
        if self.wg.shutdown(delete_link) {
            if let Err(e) = self.netlink.delete_link(index).await {
                tracing::warn!(error = format!("{e:#}"), "deleting the interface failed");
            }
        }
    }
}
