//! The host's firewall: the nftables table `inet kilo` ([`super::nftables`]) where the host's
//! rules are in nf_tables, iptables ([`super::iptables`], nft or legacy back end) where they are
//! in legacy iptables or nftables cannot be used. Chosen once, at start.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use anyhow::{bail, Result};
use control::iptables::RuleSet;

use super::{iptables, nftables, xtables, Firewall};

/// `--firewall`: where kg writes Kilo's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FirewallChoice {
    /// nftables where the host's rules are in nf_tables and the kernel takes the table;
    /// iptables otherwise, and with `--iptables-forward-rules` (an nftables accept cannot
    /// override a DROP policy in iptables' FORWARD chain).
    Auto,
    /// The nftables table `inet kilo`; an error at start if the kernel refuses it.
    Nftables,
    /// iptables, with the back end `--iptables-backend` picks.
    Iptables,
}

/// What kg writes to, once chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chosen {
    /// The nftables table `inet kilo`.
    Nftables,
    /// iptables (`iptables-restore`).
    Iptables,
}

impl Chosen {
    /// The name used in logs and `/status`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nftables => "nftables",
            Self::Iptables => "iptables",
        }
    }
}

static CHOSEN: OnceLock<Chosen> = OnceLock::new();
/// Set once Kilo's iptables chains were removed after the nftables table was first written.
static IPTABLES_CLEARED: AtomicBool = AtomicBool::new(false);

/// The firewall kg writes to; `None` before [`HostFirewall`] was prepared.
pub fn chosen() -> Option<Chosen> {
    CHOSEN.get().copied()
}

/// The host's firewall, as `--firewall`, `--iptables-backend` and `--iptables-forward-rules`
/// say.
#[derive(Debug, Clone, Copy)]
pub struct HostFirewall {
    /// `--firewall`.
    pub choice: FirewallChoice,
    /// `--iptables-backend`.
    pub iptables_mode: xtables::BackendMode,
    /// `--iptables-forward-rules`.
    pub forward_rules: bool,
}

impl HostFirewall {
    fn choose(&self) -> Result<Chosen> {
        match self.choice {
            FirewallChoice::Iptables => {
                xtables::select(self.iptables_mode)?;
                Ok(Chosen::Iptables)
            }
            FirewallChoice::Nftables => match nftables::probe() {
                Ok(()) => Ok(Chosen::Nftables),
                Err(e) => bail!("--firewall=nftables: {e:#}"),
            },
            FirewallChoice::Auto => {
                let backend = xtables::select(self.iptables_mode)?;
                let why = if self.forward_rules {
                    "--iptables-forward-rules is set".to_string()
                } else if backend == xtables::Backend::Legacy {
                    "the host's rules are in legacy iptables".to_string()
                } else {
                    match nftables::probe() {
                        Ok(()) => return Ok(Chosen::Nftables),
                        Err(e) => format!("nftables cannot be used here: {e:#}"),
                    }
                };
                tracing::info!("--firewall=auto: writing Kilo's rules to iptables: {why}");
                Ok(Chosen::Iptables)
            }
        }
    }
}

impl Firewall for HostFirewall {
    fn prepare(&self) -> Result<()> {
        let chosen = self.choose()?;
        let _ = CHOSEN.set(chosen);
        // What the other firewall holds from an earlier agent (Kilo's chains, or a kg that
        // chose differently) would apply Kilo's rules twice: removed once the first rules of
        // this run are in place (Firewall::reconcile), not before, so the node is never left
        // without them. Here only the nftables table goes, whose rules iptables would repeat.
        if chosen == Chosen::Iptables {
            if let Err(e) = nftables::clean_up() {
                tracing::debug!(error = format!("{e:#}"), "no nftables table to remove");
            }
        }
        tracing::info!("writing Kilo's rules to {}", chosen.name());
        Ok(())
    }

    fn drift(&self, rules: &RuleSet, v6: bool) -> Result<Vec<String>> {
        drift(rules, v6)
    }

    fn reconcile(&self, rules: &RuleSet, previous: Option<&RuleSet>, v6: bool) -> Result<bool> {
        match chosen() {
            Some(Chosen::Nftables) => {
                let changed = nftables::reconcile(rules, previous, v6)?;
                // Kilo's iptables chains, left by Kilo's agent or an earlier kg: once, after
                // the table is first in place (not at every resync: that lists iptables).
                if !IPTABLES_CLEARED.load(Ordering::Relaxed) {
                    iptables::clean_up(iptables::v6_available())?;
                    IPTABLES_CLEARED.store(true, Ordering::Relaxed);
                }
                Ok(changed)
            }
            _ => iptables::reconcile(rules, previous, v6),
        }
    }

    fn clean_up(&self, v6: bool) -> Result<()> {
        match chosen() {
            Some(Chosen::Nftables) => nftables::clean_up(),
            _ => iptables::clean_up(v6),
        }
    }

    fn v6_available(&self) -> bool {
        v6_available()
    }
}

/// True when the chosen firewall manages IPv6 here.
pub fn v6_available() -> bool {
    match chosen() {
        // The probe created IPv6 sets and NAT rules.
        Some(Chosen::Nftables) => true,
        _ => iptables::v6_available(),
    }
}

/// What differs between the host's firewall and `rules`, one line per difference.
pub fn drift(rules: &RuleSet, v6: bool) -> Result<Vec<String>> {
    match chosen() {
        Some(Chosen::Nftables) => nftables::drift(rules, v6),
        _ => iptables::drift(rules, v6),
    }
}

/// Starts `work` on a clone of `firewall` and returns its result to await: on a blocking
/// thread, started at once, when its calls wait on child processes ([`Firewall::blocks`]), so
/// the caller and the event loop's other tasks go on meanwhile; run here otherwise (the twin,
/// which needs no runtime).
pub fn off_loop<F: Firewall, T: Send + 'static>(
    firewall: &F,
    work: impl FnOnce(F) -> anyhow::Result<T> + Send + 'static,
) -> impl std::future::Future<Output = anyhow::Result<T>> {
    let firewall = firewall.clone();
    let started = if firewall.blocks() {
        Started::Running(tokio::task::spawn_blocking(move || work(firewall)))
    } else {
        Started::Done(work(firewall))
    };
    async move {
        match started {
            Started::Running(handle) => handle.await.map_err(anyhow::Error::from)?,
            Started::Done(result) => result,
        }
    }
}

/// Work [`off_loop`] started.
enum Started<T> {
    Running(tokio::task::JoinHandle<anyhow::Result<T>>),
    Done(anyhow::Result<T>),
}
