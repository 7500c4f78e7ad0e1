//! Kilo's firewall as the nftables table `inet kilo` ([`control::nftables`]), applied with
//! `nft -f -`: one atomic transaction per change, adding and removing set elements only, and a
//! whole table written only at start or when a resync finds it changed by someone else.

use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use control::iptables::RuleSet;
use control::nftables::{change_script, full_script, FirewallSets, TableView, TABLE};

/// The `nft` binary (`KILOTUN_NFT` overrides it, for a test that wants another one).
fn nft() -> String {
    std::env::var("KILOTUN_NFT").unwrap_or_else(|_| "nft".to_string())
}

/// Runs `nft -f -` with `script` as one transaction.
fn run(script: &str) -> Result<()> {
    let bin = nft();
    if let Some(error) = super::feed(&bin, &["-f", "-"], script, " (is nftables installed?)")? {
        bail!("{bin} -f refused the transaction: {error}");
    }
    Ok(())
}

/// The table as the kernel holds it; `None` when there is none.
pub fn view() -> Result<Option<TableView>> {
    let bin = nft();
    let out = Command::new(&bin)
        .args(["-j", "list", "table", "inet", TABLE])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {bin}"))?;
    if !out.status.success() {
        return Ok(None);
    }
    Ok(Some(TableView::from_listing(&String::from_utf8_lossy(
        &out.stdout,
    ))?))
}

/// Checks that the kernel takes every construct the table uses (interval sets of both
/// families, a NAT chain that masquerades, filter chains) in one transaction that creates a
/// scratch table and deletes it again: nothing stays behind either way.
pub fn probe() -> Result<()> {
    let scratch = full_script(&FirewallSets::default(), true)
        .replace(&format!("inet {TABLE}"), &format!("inet {TABLE}_probe"));
    run(&format!("{scratch}delete table inet {TABLE}_probe\n"))
}

/// Takes the table to `rules`. With `previous` (the rules last applied) only the difference is
/// sent; without it (at start, on a resync) the kernel's table is listed and rewritten whole
/// when it differs. Returns true when something was changed.
pub fn reconcile(rules: &RuleSet, previous: Option<&RuleSet>, v6: bool) -> Result<bool> {
    let sets = FirewallSets::of(rules)?;
    if let Some(previous) = previous {
        let script = change_script(&FirewallSets::of(previous)?, &sets, v6);
        if script.is_empty() {
            return Ok(false);
        }
        match run(&script) {
            Ok(()) => return Ok(true),
            // Someone else changed the table (an element already gone): write it whole.
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "an incremental nftables change failed; rewriting the table"
            ),
        }
    } else if view()? == Some(TableView::wanted(&sets, v6)) {
        return Ok(false);
    }
    run(&full_script(&sets, v6))?;
    Ok(true)
}

/// What [`reconcile`] would change, one line per difference; empty when the table is as wanted.
pub fn drift(rules: &RuleSet, v6: bool) -> Result<Vec<String>> {
    let wanted = TableView::wanted(&FirewallSets::of(rules)?, v6);
    let Some(have) = view()? else {
        return Ok(vec![format!("nft: table inet {TABLE} is missing")]);
    };
    let mut lines = Vec::new();
    for (name, nets) in &wanted.sets {
        let empty = Default::default();
        let held = have.sets.get(name).unwrap_or(&empty);
        for net in nets.difference(held) {
            lines.push(format!("nft: set {name} lacks {net}"));
        }
        for net in held.difference(nets) {
            lines.push(format!("nft: set {name} holds {net}, which kg did not add"));
        }
    }
    for (chain, rules) in &wanted.chains {
        if have.chains.get(chain) != Some(rules) {
            lines.push(format!("nft: chain {chain} is missing or differs"));
        }
    }
    Ok(lines)
}

/// Deletes the table, if there is one.
pub fn clean_up() -> Result<()> {
    if view().ok().flatten().is_some() {
        run(&format!("delete table inet {TABLE}\n"))?;
    }
    Ok(())
}
