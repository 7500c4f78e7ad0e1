//! The firewall's back end, chosen off the event loop at start ([`Firewall::prepare`]: the
//! iptables variant from the rules on the host, or nftables). Its child processes take up to a
//! second on a slow machine, so the engine, the link and the routes do not wait for it: the
//! first pass brings them up and awaits the choice only before it writes the first rule.

use std::future::Future;
use std::pin::Pin;

use anyhow::{Context, Result};

use super::shells::Firewall;

/// The choice under way, or made.
pub(super) enum FirewallReady {
    /// [`Firewall::prepare`] runs; its result is awaited at the first firewall write.
    Choosing(Pin<Box<dyn Future<Output = Result<()>> + Send>>),
    /// Chosen: whether the chosen firewall manages IPv6 here.
    Chosen { v6: bool },
    /// The choice failed (the error was handed to the driver, which stops kg).
    Failed,
}

impl FirewallReady {
    /// Starts the choice on a clone of `firewall` ([`super::shells::firewall::off_loop`]).
    pub(super) fn start<F: Firewall>(firewall: &F) -> Self {
        let choosing = super::shells::firewall::off_loop(firewall, |f| f.prepare());
        Self::Choosing(Box::pin(choosing))
    }

    /// Waits for the choice: `Some(v6)` once made, `None` when it failed; the failure is
    /// returned once, the first time.
    pub(super) async fn wait<F: Firewall>(&mut self, firewall: &F) -> Result<Option<bool>> {
        if let Self::Choosing(choosing) = self {
            match choosing.as_mut().await.context("preparing the firewall") {
                Ok(()) => {
                    *self = Self::Chosen {
                        v6: firewall.v6_available(),
                    }
                }
                Err(e) => {
                    *self = Self::Failed;
                    return Err(e);
                }
            }
        }
        Ok(match self {
            Self::Chosen { v6 } => Some(*v6),
            _ => None,
        })
    }
}
