//! Which iptables back end kg writes to: nft or legacy.
//!
//! A container image carries its own `iptables`, and the host may keep its rules in either of the
//! kernel's two rule stores. Rules written through the other one would be invisible to the
//! host's tools and evaluated in an order nobody chose, so kg does what kube-proxy-style images
//! do: where both `iptables-legacy` and `iptables-nft` exist, it looks at which store already
//! holds rules and writes there. kubelet's hint chains (`KUBE-IPTABLES-HINT`,
//! `KUBE-KUBELET-CANARY`) decide first; otherwise the store with more rules wins, and nft on a
//! tie (a host with no rules at all). Where only a plain `iptables` exists, kg uses it.
//!
//! The choice is made once at start-up and holds for the life of the process, as the host's
//! choice does.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{bail, Result};

/// `--iptables-backend`: how kg picks the back end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendMode {
    /// Detect from the rules already on the host (kubelet's hint chains, then rule counts).
    Auto,
    /// Always `iptables-legacy`.
    Legacy,
    /// Always `iptables-nft`.
    Nft,
}

/// The back end kg writes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The plain `iptables` commands, whatever they are (only they exist here).
    Plain,
    /// `iptables-legacy` and friends.
    Legacy,
    /// `iptables-nft` and friends.
    Nft,
}

impl Backend {
    /// The name used in logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Plain => "iptables",
            Self::Legacy => "legacy",
            Self::Nft => "nft",
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Self::Plain => "",
            Self::Legacy => "-legacy",
            Self::Nft => "-nft",
        }
    }
}

/// The commands of one family on the chosen back end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commands {
    /// `iptables` (lists and edits).
    pub list: String,
    /// `iptables-restore`.
    pub restore: String,
}

/// What one rule store holds, as far as the choice is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreSummary {
    /// kubelet created one of its hint chains here.
    pub kubelet_hint: bool,
    /// Rules (`-A` lines) in every table, both families.
    pub rules: usize,
}

impl StoreSummary {
    /// Summarises `iptables-save` output (IPv4 and IPv6 concatenated).
    pub fn of_save_output(text: &str) -> Self {
        let mut summary = Self::default();
        for line in text.lines() {
            if line.starts_with("-A ") {
                summary.rules += 1;
            } else if line.starts_with(":KUBE-IPTABLES-HINT ")
                || line.starts_with(":KUBE-KUBELET-CANARY ")
            {
                summary.kubelet_hint = true;
            }
        }
        summary
    }
}

/// The back end to use given what each store holds: kubelet's hint first (nft before legacy,
/// as kubelet itself prefers), then the store with more rules, nft on a tie.
pub fn choose(legacy: StoreSummary, nft: StoreSummary) -> Backend {
    if nft.kubelet_hint {
        Backend::Nft
    } else if legacy.kubelet_hint || legacy.rules > nft.rules {
        Backend::Legacy
    } else {
        Backend::Nft
    }
}

static CHOSEN: OnceLock<Backend> = OnceLock::new();

/// The commands for one family on the back end chosen by [`select`] (the plain commands
/// before any choice, as in tests and tools).
pub fn commands(v6: bool) -> Commands {
    let backend = CHOSEN.get().copied().unwrap_or(Backend::Plain);
    let base = if v6 { "ip6tables" } else { "iptables" };
    Commands {
        list: format!("{base}{}", backend.suffix()),
        restore: format!("{base}{}-restore", backend.suffix()),
    }
}

/// Chooses the back end once for this process and logs why.
pub fn select(mode: BackendMode) -> Result<Backend> {
    let have = |name: &str| on_path(name);
    let both = have("iptables-legacy") && have("iptables-nft");
    let backend = match mode {
        BackendMode::Legacy | BackendMode::Nft => {
            let backend = if mode == BackendMode::Legacy {
                Backend::Legacy
            } else {
                Backend::Nft
            };
            let command = format!("iptables{}", backend.suffix());
            if !have(&command) {
                bail!(
                    "--iptables-backend={}: {command} is not installed",
                    backend.name()
                );
            }
            tracing::info!(backend = backend.name(), "iptables back end set by flag");
            backend
        }
        BackendMode::Auto if !both => {
            tracing::info!("iptables back end: the plain iptables commands (no -legacy and -nft variants here)");
            Backend::Plain
        }
        BackendMode::Auto => {
            let legacy = StoreSummary::of_save_output(&save_output("legacy"));
            let nft = StoreSummary::of_save_output(&save_output("nft"));
            let backend = choose(legacy, nft);
            tracing::info!(
                backend = backend.name(),
                legacy_rules = legacy.rules,
                legacy_kubelet_hint = legacy.kubelet_hint,
                nft_rules = nft.rules,
                nft_kubelet_hint = nft.kubelet_hint,
                "iptables back end chosen from the rules already on the host"
            );
            backend
        }
    };
    Ok(*CHOSEN.get_or_init(|| backend))
}

/// `iptables-X-save` and `ip6tables-X-save` concatenated; a store that cannot be read is empty.
fn save_output(variant: &str) -> String {
    let mut text = String::new();
    for base in ["iptables", "ip6tables"] {
        if let Ok(out) = Command::new(format!("{base}-{variant}-save"))
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
        {
            text.push_str(&String::from_utf8_lossy(&out.stdout));
        }
    }
    text
}

/// True when an executable called `name` is on `PATH`.
fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path).any(|dir| {
        Path::new(&dir)
            .join(name)
            .metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEGACY_WITH_RULES: &str = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n\
        -A INPUT -s 192.0.2.1/32 -j ACCEPT\n-A FORWARD -j DOCKER\nCOMMIT\n";
    const EMPTY: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n";
    const NFT_HINT: &str =
        "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n";

    #[test]
    fn summaries_count_rules_and_see_kubelet_hints() {
        assert_eq!(
            StoreSummary::of_save_output(LEGACY_WITH_RULES),
            StoreSummary {
                kubelet_hint: false,
                rules: 2
            }
        );
        assert_eq!(
            StoreSummary::of_save_output(NFT_HINT),
            StoreSummary {
                kubelet_hint: true,
                rules: 0
            }
        );
        assert_eq!(StoreSummary::of_save_output(EMPTY).rules, 0);
    }

    #[test]
    fn the_store_holding_rules_wins_and_nft_wins_a_tie() {
        let s = StoreSummary::of_save_output;
        assert_eq!(choose(s(LEGACY_WITH_RULES), s(EMPTY)), Backend::Legacy);
        assert_eq!(choose(s(EMPTY), s(LEGACY_WITH_RULES)), Backend::Nft);
        assert_eq!(choose(s(EMPTY), s(EMPTY)), Backend::Nft);
        assert_eq!(choose(s(""), s("")), Backend::Nft);
    }

    #[test]
    fn a_kubelet_hint_outweighs_rule_counts() {
        let s = StoreSummary::of_save_output;
        // kubelet chose legacy although nft holds more rules (say, Docker's).
        assert_eq!(choose(s(NFT_HINT), s(LEGACY_WITH_RULES)), Backend::Legacy);
        // kubelet chose nft although legacy holds more rules.
        assert_eq!(choose(s(LEGACY_WITH_RULES), s(NFT_HINT)), Backend::Nft);
    }

    #[test]
    fn commands_before_any_choice_are_the_plain_ones() {
        // `select` is never called in unit tests, so the process-wide choice is unset.
        assert_eq!(
            commands(true),
            Commands {
                list: "ip6tables".into(),
                restore: "ip6tables-restore".into()
            }
        );
    }
}
