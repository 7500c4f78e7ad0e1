//! Kilo's firewall as one nftables table whose address lists are sets.
//!
//! Kilo's iptables rules ([`crate::iptables`]) match on lists of networks: the sources and
//! destinations that enter `KILO-NAT`, the destinations it leaves alone, the location's private
//! IPs allowed to send IPIP. [`FirewallSets::of`] reads those lists back out of a [`RuleSet`],
//! so both back ends take their semantics from one place; [`full_script`] renders them as the
//! table `inet kilo`, and [`change_script`] takes the table from one value to the next by adding
//! and removing set elements, so the cost of a change follows the change, not the cluster.
//!
//! A set with `flags interval` refuses overlapping elements, and CIDRs either nest or are
//! disjoint: every set holds only the networks no other element covers ([`disjoint`]), which
//! matches exactly the same addresses.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use ipnet::IpNet;

use crate::iptables::{FamilyRules, RuleSet, KILO_IPIP, KILO_NAT};

/// The table's name (family `inet`: one table for IPv4 and IPv6).
pub const TABLE: &str = "kilo";

/// The networks Kilo's rules of one family match on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FamilySets {
    /// Sources whose packets enter the NAT chain (pods with `--cni`, Peers' allowed IPs).
    pub nat_from: BTreeSet<IpNet>,
    /// Destinations whose packets enter the NAT chain (the local location's allowed IPs).
    pub nat_to: BTreeSet<IpNet>,
    /// Destinations the NAT chain leaves alone (WireGuard IPs, allowed IPs, Peers, services).
    pub no_nat: BTreeSet<IpNet>,
    /// Networks whose traffic to themselves keeps its source (allowed location IPs).
    pub within: BTreeSet<IpNet>,
    /// Sources forwarded (`--iptables-forward-rules`).
    pub forward_from: BTreeSet<IpNet>,
    /// Destinations forwarded (`--iptables-forward-rules`).
    pub forward_to: BTreeSet<IpNet>,
    /// The sources allowed to send IPIP; `None` when kg guards no IPIP.
    pub ipip: Option<BTreeSet<IpNet>>,
}

/// Both families' sets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FirewallSets {
    /// IPv4.
    pub v4: FamilySets,
    /// IPv6.
    pub v6: FamilySets,
}

/// A rule of a [`RuleSet`] that no set stands for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no nftables set stands for the iptables rule `{chain} {spec}`")]
pub struct UnknownRule {
    /// The rule's chain.
    pub chain: String,
    /// The rule's spec.
    pub spec: String,
}

/// The network after `flag` (`-s` or `-d`) in an iptables spec.
fn net_after(spec: &str, flag: &str) -> Option<IpNet> {
    let mut words = spec.split_whitespace();
    while let Some(word) = words.next() {
        if word == flag {
            let text = words.next()?;
            return text
                .parse()
                .ok()
                .or_else(|| text.parse::<std::net::IpAddr>().ok().map(IpNet::from));
        }
        if word == "-m" {
            // Options of matches (a comment's text) come after the addresses.
            return None;
        }
    }
    None
}

fn target(spec: &str) -> &str {
    spec.rsplit_once("-j ").map_or("", |(_, t)| t.trim())
}

impl FamilySets {
    fn of(rules: &FamilyRules) -> Result<Self, UnknownRule> {
        let mut sets = FamilySets::default();
        let unknown = |chain: &str, spec: &str| UnknownRule {
            chain: chain.to_string(),
            spec: spec.to_string(),
        };
        for rule in &rules.builtin {
            let (from, to) = (net_after(&rule.spec, "-s"), net_after(&rule.spec, "-d"));
            let set = match (rule.chain, target(&rule.spec), from, to) {
                ("POSTROUTING", KILO_NAT, Some(net), None) => (&mut sets.nat_from, net),
                ("POSTROUTING", KILO_NAT, None, Some(net)) => (&mut sets.nat_to, net),
                ("FORWARD", "ACCEPT", Some(net), None) => (&mut sets.forward_from, net),
                ("FORWARD", "ACCEPT", None, Some(net)) => (&mut sets.forward_to, net),
                _ => return Err(unknown(rule.chain, &rule.spec)),
            };
            set.0.insert(set.1.trunc());
        }
        for spec in &rules.kilo_nat {
            let (from, to) = (net_after(spec, "-s"), net_after(spec, "-d"));
            match (target(spec), from, to) {
                ("RETURN", None, Some(net)) => sets.no_nat.insert(net.trunc()),
                ("RETURN", Some(a), Some(b)) if a == b => sets.within.insert(a.trunc()),
                ("MASQUERADE", None, None) => true,
                _ => return Err(unknown(KILO_NAT, spec)),
            };
        }
        if !rules.input.is_empty() || rules.kilo_ipip.is_some() {
            let mut allowed = BTreeSet::new();
            for spec in rules.kilo_ipip.iter().flatten() {
                match (target(spec), net_after(spec, "-s")) {
                    ("ACCEPT", Some(net)) => allowed.insert(net.trunc()),
                    _ => return Err(unknown(KILO_IPIP, spec)),
                };
            }
            sets.ipip = Some(allowed);
        }
        for set in [
            &mut sets.nat_from,
            &mut sets.nat_to,
            &mut sets.no_nat,
            &mut sets.forward_from,
            &mut sets.forward_to,
        ] {
            *set = disjoint(set);
        }
        if let Some(ipip) = sets.ipip.as_mut() {
            *ipip = disjoint(ipip);
        }
        Ok(sets)
    }
}

impl FirewallSets {
    /// The sets that match what `rules` match.
    pub fn of(rules: &RuleSet) -> Result<Self, UnknownRule> {
        Ok(Self {
            v4: FamilySets::of(&rules.v4)?,
            v6: FamilySets::of(&rules.v6)?,
        })
    }
}

/// `nets` without the networks another element covers: the same addresses, no overlaps.
pub fn disjoint(nets: &BTreeSet<IpNet>) -> BTreeSet<IpNet> {
    // Ordered by address, then by prefix length (the wider first): a covered network comes
    // after the one that covers it, with only networks inside that one in between.
    let mut kept: BTreeSet<IpNet> = BTreeSet::new();
    let mut last: Option<IpNet> = None;
    for net in nets.iter().map(IpNet::trunc) {
        if last.is_some_and(|l| l.contains(&net)) {
            continue;
        }
        last = Some(net);
        kept.insert(net);
    }
    kept
}

/// One set of the table: its name and address type, and how to read it from a family.
struct SetSpec {
    name: &'static str,
    members: fn(&FamilySets) -> Option<&BTreeSet<IpNet>>,
}

const SETS: [SetSpec; 6] = [
    SetSpec {
        name: "nat_from",
        members: |f| Some(&f.nat_from),
    },
    SetSpec {
        name: "nat_to",
        members: |f| Some(&f.nat_to),
    },
    SetSpec {
        name: "no_nat",
        members: |f| Some(&f.no_nat),
    },
    SetSpec {
        name: "forward_from",
        members: |f| Some(&f.forward_from),
    },
    SetSpec {
        name: "forward_to",
        members: |f| Some(&f.forward_to),
    },
    SetSpec {
        name: "ipip_from",
        members: |f| f.ipip.as_ref(),
    },
];

/// The families kg manages: `(suffix, address type, match keyword, sets)`.
fn families(
    sets: &FirewallSets,
    v6: bool,
) -> Vec<(&'static str, &'static str, &'static str, &FamilySets)> {
    let mut out = vec![("4", "ipv4_addr", "ip", &sets.v4)];
    if v6 {
        out.push(("6", "ipv6_addr", "ip6", &sets.v6));
    }
    out
}

fn elements(nets: &BTreeSet<IpNet>) -> String {
    let list: Vec<String> = nets.iter().map(IpNet::to_string).collect();
    list.join(", ")
}

/// The rules of the chains that depend on more than set contents (`kilo_nat`'s own-range
/// returns, the IPIP guard), as `add rule` lines for `chain`.
fn chain_rules(sets: &FirewallSets, v6: bool, chain: &str) -> Vec<String> {
    let mut rules = Vec::new();
    for (n, _, ip, f) in families(sets, v6) {
        match chain {
            "postrouting" => {
                rules.push(format!(
                    "{ip} saddr @nat_from{n} jump kilo_nat comment \"Kilo: jump to NAT chain\""
                ));
                rules.push(format!(
                    "{ip} daddr @nat_to{n} jump kilo_nat comment \"Kilo: jump to NAT chain\""
                ));
            }
            "kilo_nat" => {
                rules.push(format!(
                    "{ip} daddr @no_nat{n} return comment \"Kilo: do not NAT packets destined for known IPs\""
                ));
                for net in &f.within {
                    rules.push(format!(
                        "{ip} saddr {net} {ip} daddr {net} return comment \"Kilo: do not NAT packets within {net}\""
                    ));
                }
            }
            "forward" => {
                rules.push(format!(
                    "{ip} saddr @forward_from{n} accept comment \"Kilo: forward packets from known IPs\""
                ));
                rules.push(format!(
                    "{ip} daddr @forward_to{n} accept comment \"Kilo: forward packets to known IPs\""
                ));
            }
            "input" if f.ipip.is_some() => {
                let l4 = if n == "4" {
                    "ip protocol 4"
                } else {
                    "meta l4proto 4"
                };
                rules.push(format!(
                    "{l4} {ip} saddr @ipip_from{n} accept comment \"Kilo: allow IPIP traffic\""
                ));
            }
            _ => {}
        }
    }
    match chain {
        "kilo_nat" => rules.push("masquerade comment \"Kilo: NAT remaining packets\"".into()),
        "input" if families(sets, v6).iter().any(|f| f.3.ipip.is_some()) => {
            rules.push("meta l4proto 4 drop comment \"Kilo: reject other IPIP traffic\"".into())
        }
        _ => {}
    }
    rules
}

/// The chains: name and, for a base chain, its hook declaration.
const CHAINS: [(&str, Option<&str>); 4] = [
    (
        "postrouting",
        Some("type nat hook postrouting priority srcnat - 1; policy accept;"),
    ),
    ("kilo_nat", None),
    (
        "forward",
        Some("type filter hook forward priority filter - 1; policy accept;"),
    ),
    (
        "input",
        Some("type filter hook input priority filter - 1; policy accept;"),
    ),
];

/// The `nft -f` script that replaces the table with one holding `sets`, in one transaction
/// (`v6`: whether the IPv6 family is managed). Creating the table first makes the delete
/// succeed whether or not it existed.
pub fn full_script(sets: &FirewallSets, v6: bool) -> String {
    let mut s = format!("table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
    for (n, kind, _, f) in families(sets, v6) {
        for spec in &SETS {
            let _ = write!(
                s,
                "  set {}{n} {{\n    type {kind}\n    flags interval\n",
                spec.name
            );
            match (spec.members)(f) {
                Some(nets) if !nets.is_empty() => {
                    let _ = writeln!(s, "    elements = {{ {} }}", elements(nets));
                }
                _ => {}
            }
            s.push_str("  }\n");
        }
    }
    for (chain, hook) in CHAINS {
        let _ = writeln!(s, "  chain {chain} {{");
        if let Some(hook) = hook {
            let _ = writeln!(s, "    {hook}");
        }
        for rule in chain_rules(sets, v6, chain) {
            let _ = writeln!(s, "    {rule}");
        }
        s.push_str("  }\n");
    }
    s.push_str("}\n");
    s
}

/// Above this many elements leaving one set, [`change_script`] flushes the set and adds what
/// stays instead of deleting them: nft 1.0.6 took 2 s of CPU to delete 1,000 elements of a
/// 5,000-element interval set and 25 s for the Nodes of a 5,000-node cluster expiring at once,
/// against 0.01 to 0.04 s for a flush and a re-add.
pub const FLUSH_OVER: usize = 64;

/// The `nft -f` script that takes the table from `from` to `to` (empty when they match): set
/// elements removed, then added (so a network that replaces one it covers never overlaps it),
/// or, when more than [`FLUSH_OVER`] leave a set, the set flushed and filled again, and a chain
/// rewritten only when its rules differ. It is one transaction either way.
pub fn change_script(from: &FirewallSets, to: &FirewallSets, v6: bool) -> String {
    let mut deletes = String::new();
    let mut adds = String::new();
    let old = families(from, v6);
    for (i, (n, _, _, f)) in families(to, v6).into_iter().enumerate() {
        let before = old[i].3;
        for spec in &SETS {
            let empty = BTreeSet::new();
            let was = (spec.members)(before).unwrap_or(&empty);
            let now = (spec.members)(f).unwrap_or(&empty);
            let gone: BTreeSet<IpNet> = was.difference(now).copied().collect();
            if gone.len() > FLUSH_OVER {
                // nft removes interval elements one by one, slowly (seconds for a thousand):
                // emptied and filled again instead, in the same transaction.
                let _ = writeln!(deletes, "flush set inet {TABLE} {}{n}", spec.name);
                if !now.is_empty() {
                    let _ = writeln!(
                        adds,
                        "add element inet {TABLE} {}{n} {{ {} }}",
                        spec.name,
                        elements(now)
                    );
                }
                continue;
            }
            let new: BTreeSet<IpNet> = now.difference(was).copied().collect();
            if !gone.is_empty() {
                let _ = writeln!(
                    deletes,
                    "delete element inet {TABLE} {}{n} {{ {} }}",
                    spec.name,
                    elements(&gone)
                );
            }
            if !new.is_empty() {
                let _ = writeln!(
                    adds,
                    "add element inet {TABLE} {}{n} {{ {} }}",
                    spec.name,
                    elements(&new)
                );
            }
        }
    }
    let mut chains = String::new();
    for (chain, _) in CHAINS {
        let rules = chain_rules(to, v6, chain);
        if rules != chain_rules(from, v6, chain) {
            let _ = writeln!(chains, "flush chain inet {TABLE} {chain}");
            for rule in rules {
                let _ = writeln!(chains, "add rule inet {TABLE} {chain} {rule}");
            }
        }
    }
    deletes + &adds + &chains
}

/// What the table must hold, in the form [`crate::nftables`] compares with a listing: each
/// set's elements and each chain's rule comments, in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TableView {
    /// Set name (with its family suffix) → elements.
    pub sets: std::collections::BTreeMap<String, BTreeSet<IpNet>>,
    /// Chain name → its rules' comments, in order.
    pub chains: std::collections::BTreeMap<String, Vec<String>>,
}

impl TableView {
    /// The view of a table holding `sets`.
    pub fn wanted(sets: &FirewallSets, v6: bool) -> Self {
        let mut view = TableView::default();
        for (n, _, _, f) in families(sets, v6) {
            for spec in &SETS {
                let nets = (spec.members)(f).cloned().unwrap_or_default();
                view.sets.insert(format!("{}{n}", spec.name), nets);
            }
        }
        for (chain, _) in CHAINS {
            let comments = chain_rules(sets, v6, chain)
                .iter()
                .map(|r| {
                    r.rsplit_once("comment \"")
                        .map_or("", |(_, c)| c.trim_end_matches('"'))
                        .to_string()
                })
                .collect();
            view.chains.insert(chain.to_string(), comments);
        }
        view
    }
}

/// A listing that is not what `nft -j list table` prints.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unexpected `nft -j list table inet {TABLE}` output: {0}")]
pub struct BadListing(pub String);

/// An element of a set as `nft -j` prints it: an address, or a prefix.
fn element(value: &serde_json::Value) -> Result<IpNet, BadListing> {
    let bad = || BadListing(format!("set element {value}"));
    if let Some(text) = value.as_str() {
        return text
            .parse::<std::net::IpAddr>()
            .map(IpNet::from)
            .map_err(|_| bad());
    }
    let prefix = &value["prefix"];
    let addr: std::net::IpAddr = prefix["addr"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .ok_or_else(bad)?;
    let len = prefix["len"].as_u64().ok_or_else(bad)?;
    IpNet::new(addr, u8::try_from(len).map_err(|_| bad())?).map_err(|_| bad())
}

impl TableView {
    /// The view of the table in `nft -j list table inet kilo`'s output.
    pub fn from_listing(json: &str) -> Result<Self, BadListing> {
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|e| BadListing(e.to_string()))?;
        let items = value["nftables"]
            .as_array()
            .ok_or_else(|| BadListing("no \"nftables\" array".into()))?;
        let mut view = TableView::default();
        for item in items {
            if let Some(set) = item.get("set") {
                let name = set["name"].as_str().unwrap_or_default().to_string();
                let mut nets = BTreeSet::new();
                for elem in set["elem"].as_array().into_iter().flatten() {
                    nets.insert(element(elem)?);
                }
                view.sets.insert(name, nets);
            } else if let Some(chain) = item.get("chain") {
                let name = chain["name"].as_str().unwrap_or_default().to_string();
                view.chains.entry(name).or_default();
            } else if let Some(rule) = item.get("rule") {
                let chain = rule["chain"].as_str().unwrap_or_default().to_string();
                let comment = rule["comment"].as_str().unwrap_or_default().to_string();
                view.chains.entry(chain).or_default().push(comment);
            }
        }
        Ok(view)
    }
}

#[cfg(test)]
mod tests;
