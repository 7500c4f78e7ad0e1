//! Applies Kilo's iptables rules with `iptables-restore --noflush`, one atomic transaction per
//! table and family, changing only what differs from `iptables -S`. Works with the nft and legacy
//! back ends alike: [`super::xtables`] picks which commands run.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use control::iptables::{
    is_kilo_rule, normalise_listed, FamilyRules, IptRule, RuleSet, KILO_IPIP, KILO_NAT,
};

/// The built-in chains kg inserts rules into.
const BUILTIN: [(&str, &str); 2] = [("nat", "POSTROUTING"), ("filter", "FORWARD")];

fn tools(v6: bool) -> (String, String) {
    let commands = super::xtables::commands(v6);
    (commands.list, commands.restore)
}

/// `iptables -t TABLE -S CHAIN` as specs (without `-A CHAIN`); `None` when the chain is missing.
fn list(v6: bool, table: &str, chain: &str) -> Result<Option<Vec<String>>> {
    let (bin, _) = tools(v6);
    let out = Command::new(&bin)
        .args(["-w", "5", "-t", table, "-S", chain])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {bin} (is iptables installed?)"))?;
    if !out.status.success() {
        return Ok(None);
    }
    let prefix = format!("-A {chain} ");
    Ok(Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix).map(normalise_listed))
            .collect(),
    ))
}

fn restore(v6: bool, script: &str) -> Result<()> {
    let (_, bin) = tools(v6);
    if let Some(error) = super::feed(&bin, &["-w", "5", "--noflush"], script, "")? {
        bail!("{bin} failed: {error}");
    }
    Ok(())
}

/// True when a chain listed as `have` holds the rules `want` in any order, but for `KILO-NAT`'s
/// last rule (MASQUERADE), which must stay last. An incremental change inserts new rules at the
/// top, so the order is not the order `want` lists them in; with only returns (or only accepts)
/// before a final rule, order does not change which packets they match.
fn same_rules(have: Option<&[String]>, want: &[String], last_fixed: bool) -> bool {
    fn set(rules: &[String]) -> BTreeSet<&String> {
        rules.iter().collect()
    }
    have.is_some_and(|have| {
        have.len() == want.len()
            && (!last_fixed || have.last() == want.last())
            && set(have) == set(want)
    })
}

/// The `iptables-restore` script that takes one family to `desired` (empty when nothing differs).
fn plan(v6: bool, desired: &FamilyRules) -> Result<String> {
    let mut script = String::new();
    for table in ["nat", "filter"] {
        let mut body = String::new();
        if table == "nat"
            && !same_rules(
                list(v6, "nat", KILO_NAT)?.as_deref(),
                &desired.kilo_nat,
                true,
            )
        {
            body.push_str(&format!(":{KILO_NAT} - [0:0]\n"));
            for spec in &desired.kilo_nat {
                body.push_str(&format!("-A {KILO_NAT} {spec}\n"));
            }
        }
        if table == "filter" {
            body.push_str(&plan_ipip(v6, desired)?);
        }
        for (t, chain) in BUILTIN.iter().filter(|(t, _)| *t == table) {
            let want: BTreeSet<&str> = desired
                .builtin
                .iter()
                .filter(|r: &&IptRule| r.table == *t && r.chain == *chain)
                .map(|r| r.spec.as_str())
                .collect();
            let have = list(v6, t, chain)?.unwrap_or_default();
            for spec in have
                .iter()
                .filter(|s| is_kilo_rule(s) && !want.contains(s.as_str()))
            {
                body.push_str(&format!("-D {chain} {spec}\n"));
            }
            for spec in want.iter().filter(|s| !have.iter().any(|h| h == *s)) {
                body.push_str(&format!("-I {chain} 1 {spec}\n"));
            }
        }
        if !body.is_empty() {
            script.push_str(&format!("*{table}\n{body}COMMIT\n"));
        }
    }
    Ok(script)
}

/// The filter-table lines for the IPIP rules: `KILO-IPIP` rewritten when it differs (or
/// removed when unwanted), and kg's `INPUT` rules re-appended in order whenever they are not
/// exactly the wanted sequence (Kilo's append semantics).
fn plan_ipip(v6: bool, desired: &FamilyRules) -> Result<String> {
    let mut body = String::new();
    let have_input: Vec<String> = list(v6, "filter", "INPUT")?
        .unwrap_or_default()
        .into_iter()
        .filter(|s| is_kilo_rule(s))
        .collect();
    let chain = list(v6, "filter", KILO_IPIP)?;
    let input_differs = have_input != desired.input;
    if input_differs {
        for spec in &have_input {
            body.push_str(&format!("-D INPUT {spec}\n"));
        }
    }
    match (&desired.kilo_ipip, &chain) {
        (Some(want), have) if !same_rules(have.as_deref(), want, false) => {
            body.push_str(&format!(":{KILO_IPIP} - [0:0]\n"));
            for spec in want {
                body.push_str(&format!("-A {KILO_IPIP} {spec}\n"));
            }
        }
        (None, Some(_)) => body.push_str(&format!("-F {KILO_IPIP}\n-X {KILO_IPIP}\n")),
        _ => {}
    }
    if input_differs {
        for spec in &desired.input {
            body.push_str(&format!("-A INPUT {spec}\n"));
        }
    }
    Ok(body)
}

/// The `iptables-restore` script that takes one family from `from` (the rules last applied)
/// to `to` without listing anything: rules removed with `-D`, added with `-I … 1` (`KILO-NAT`
/// returns before its final MASQUERADE, and their order among themselves does not matter).
/// `None` when the IPIP rules' shape changes (their chain created or removed, `INPUT`'s
/// sequence): that rare change takes the listing path.
fn change(from: &FamilyRules, to: &FamilyRules) -> Option<String> {
    if from.input != to.input || from.kilo_ipip.is_some() != to.kilo_ipip.is_some() {
        return None;
    }
    let set = |rules: &[String]| rules.iter().cloned().collect::<BTreeSet<String>>();
    let mut script = String::new();
    for table in ["nat", "filter"] {
        let mut body = String::new();
        let builtin = |rules: &[IptRule]| {
            rules
                .iter()
                .filter(|r| r.table == table)
                .map(|r| (r.chain, r.spec.clone()))
                .collect::<BTreeSet<_>>()
        };
        let (was, now) = (builtin(&from.builtin), builtin(&to.builtin));
        for (chain, spec) in was.difference(&now) {
            body.push_str(&format!("-D {chain} {spec}\n"));
        }
        for (chain, spec) in now.difference(&was) {
            body.push_str(&format!("-I {chain} 1 {spec}\n"));
        }
        let (chain, was, now) = match table {
            "nat" => (KILO_NAT, set(&from.kilo_nat), set(&to.kilo_nat)),
            _ => (
                KILO_IPIP,
                set(from.kilo_ipip.as_deref().unwrap_or_default()),
                set(to.kilo_ipip.as_deref().unwrap_or_default()),
            ),
        };
        for spec in was.difference(&now) {
            body.push_str(&format!("-D {chain} {spec}\n"));
        }
        for spec in now.difference(&was) {
            body.push_str(&format!("-I {chain} 1 {spec}\n"));
        }
        if !body.is_empty() {
            script.push_str(&format!("*{table}\n{body}COMMIT\n"));
        }
    }
    Some(script)
}

/// Brings both families to `rules`. With `previous` (the rules last applied) only the
/// difference is written, without listing the chains; without it (at start, on a resync), or
/// when that fails (someone else removed a rule), the chains are listed and compared. Returns
/// true when something was changed. IPv6 is skipped (`v6_available` false) where the kernel has
/// no IPv6 NAT.
pub fn reconcile(rules: &RuleSet, previous: Option<&RuleSet>, v6_available: bool) -> Result<bool> {
    let mut changed = false;
    for (v6, family) in [(false, &rules.v4), (true, &rules.v6)] {
        if v6 && !v6_available {
            continue;
        }
        let before = previous.map(|p| if v6 { &p.v6 } else { &p.v4 });
        if let Some(script) = before.and_then(|b| change(b, family)) {
            if script.is_empty() {
                continue;
            }
            match restore(v6, &script) {
                Ok(()) => {
                    changed = true;
                    continue;
                }
                Err(e) => tracing::warn!(
                    error = format!("{e:#}"),
                    "an incremental iptables change failed; comparing the chains"
                ),
            }
        }
        let script = plan(v6, family)?;
        if !script.is_empty() {
            restore(v6, &script)?;
            changed = true;
        }
    }
    Ok(changed)
}

/// What [`reconcile`] would change to reach `rules`, one line per command, naming the tool and
/// table (`iptables -t nat -I POSTROUTING 1 …`); empty when the host has every rule.
pub fn drift(rules: &RuleSet, v6_available: bool) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for (v6, family) in [(false, &rules.v4), (true, &rules.v6)] {
        if v6 && !v6_available {
            continue;
        }
        let tool = if v6 { "ip6tables" } else { "iptables" };
        let mut table = "";
        for line in plan(v6, family)?.lines() {
            if let Some(t) = line.strip_prefix('*') {
                table = if t == "nat" { "nat" } else { "filter" };
            } else if let Some(chain) = line.strip_prefix(':') {
                let chain = chain.split_whitespace().next().unwrap_or_default();
                lines.push(format!(
                    "{tool} -t {table}: chain {chain} is missing or differs"
                ));
            } else if line != "COMMIT" {
                lines.push(format!("{tool} -t {table} {line}"));
            }
        }
    }
    Ok(lines)
}

/// True when `ip6tables` can list the nat table here.
pub fn v6_available() -> bool {
    list(true, "nat", "POSTROUTING").is_ok_and(|l| l.is_some())
}

/// Removes every rule kg added and the `KILO-NAT` and `KILO-IPIP` chains.
pub fn clean_up(v6_available: bool) -> Result<()> {
    for v6 in [false, true] {
        if v6 && !v6_available {
            continue;
        }
        let mut script = String::new();
        for table in ["nat", "filter"] {
            let mut body = String::new();
            if table == "filter" {
                body.push_str(&plan_ipip(v6, &FamilyRules::default())?);
            }
            for (t, chain) in BUILTIN.iter().filter(|(t, _)| *t == table) {
                for spec in list(v6, t, chain)?
                    .unwrap_or_default()
                    .iter()
                    .filter(|s| is_kilo_rule(s))
                {
                    body.push_str(&format!("-D {chain} {spec}\n"));
                }
            }
            if table == "nat" && list(v6, "nat", KILO_NAT)?.is_some() {
                body.push_str(&format!("-F {KILO_NAT}\n-X {KILO_NAT}\n"));
            }
            if !body.is_empty() {
                script.push_str(&format!("*{table}\n{body}COMMIT\n"));
            }
        }
        if !script.is_empty() {
            restore(v6, &script)?;
        }
    }
    Ok(())
}
