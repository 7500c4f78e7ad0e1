//! The iptables rules Kilo installs, as data: the `KILO-NAT` chain (owned entirely, so it
//! is rewritten as a whole) and the rules kg inserts into built-in chains, in the `-S` form
//! iptables prints them, so the kernel's state can be compared line by line.

use ipnet::IpNet;

use crate::topology::{Member, Topology};

/// Kilo's NAT chain.
pub const KILO_NAT: &str = "KILO-NAT";
/// Kilo's chain of accepted IPIP sources (filter table).
pub const KILO_IPIP: &str = "KILO-IPIP";

/// One rule: table, chain, and its spec in `iptables -S` form (without `-A CHAIN`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IptRule {
    /// `nat` or `filter`.
    pub table: &'static str,
    /// The chain.
    pub chain: &'static str,
    /// Everything after `-A CHAIN`.
    pub spec: String,
}

/// The rules of one address family.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FamilyRules {
    /// Rules inserted at the top of built-in chains (`POSTROUTING`, `FORWARD`), a set.
    pub builtin: Vec<IptRule>,
    /// Rules appended to `INPUT`, in this order (the IPIP jump, then the IPIP drop).
    pub input: Vec<String>,
    /// The whole content of `KILO-NAT`, in order.
    pub kilo_nat: Vec<String>,
    /// The whole content of `KILO-IPIP`, in order; `None` when the chain must not exist.
    pub kilo_ipip: Option<Vec<String>>,
}

/// Rules for IPv4 and IPv6.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RuleSet {
    /// IPv4 (`iptables`).
    pub v4: FamilyRules,
    /// IPv6 (`ip6tables`).
    pub v6: FamilyRules,
}

/// What decides the rules besides the topology.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IptablesOptions {
    /// `--cni`: jump from POSTROUTING into KILO-NAT for the local pod CIDR.
    pub cni: bool,
    /// `--iptables-forward-rules`.
    pub forward_rules: bool,
    /// `--service-cidr`s.
    pub service_cidrs: Vec<IpNet>,
    /// IPIP is in use inside the location (`--encapsulate` not `never`, and `--local`): accept
    /// protocol 4 only from the location's private IPs.
    pub ipip: bool,
}

fn comment(text: &str) -> String {
    format!("-m comment --comment \"{text}\"")
}

impl RuleSet {
    fn family(&mut self, net: &IpNet) -> &mut FamilyRules {
        match net {
            IpNet::V4(_) => &mut self.v4,
            IpNet::V6(_) => &mut self.v6,
        }
    }

    /// Adds a rule to a built-in chain (a repeat is dropped by [`RuleSet::dedup`]).
    fn builtin(&mut self, table: &'static str, chain: &'static str, net: &IpNet, spec: String) {
        let rule = IptRule { table, chain, spec };
        self.family(net).builtin.push(rule);
    }

    /// Adds a rule to `KILO-NAT` (a repeat is dropped by [`RuleSet::dedup`]).
    fn kilo_nat(&mut self, net: &IpNet, spec: String) {
        self.family(net).kilo_nat.push(spec);
    }

    /// Keeps the first of equal rules in the built-in chains and `KILO-NAT`, in order. With a
    /// rule or two per Node, a search before each push would be quadratic: at 5,000 Nodes tens
    /// of millions of comparisons on every resync.
    fn dedup(&mut self) {
        for family in [&mut self.v4, &mut self.v6] {
            keep_first(&mut family.builtin);
            keep_first(&mut family.kilo_nat);
        }
    }

    /// `KILO-NAT -d NET -m comment --comment "Kilo: do not NAT packets destined for WHAT" -j RETURN`.
    fn nat_return(&mut self, net: IpNet, what: &str) {
        let net = net.trunc();
        let text = format!("Kilo: do not NAT packets destined for {what}");
        self.kilo_nat(&net, format!("-d {net} {} -j RETURN", comment(&text)));
    }

    /// `POSTROUTING {-s|-d} NET -m comment --comment "Kilo: jump to NAT chain" -j KILO-NAT`.
    fn nat_jump(&mut self, direction: &str, net: IpNet) {
        let net = net.trunc();
        let spec = format!(
            "{direction} {net} {} -j {KILO_NAT}",
            comment("Kilo: jump to NAT chain")
        );
        self.builtin("nat", "POSTROUTING", &net, spec);
    }
}

impl Topology {
    /// Kilo's iptables rules for this node, without the IPIP ones.
    pub fn iptables_rules(&self, o: &IptablesOptions) -> RuleSet {
        let mut r = RuleSet::default();
        if o.cni {
            for pods in self.local_pod_cidrs() {
                let pods = pods.trunc();
                r.builtin(
                    "nat",
                    "POSTROUTING",
                    &pods,
                    format!(
                        "-s {pods} {} -j {KILO_NAT}",
                        comment("Kilo: jump to KILO-NAT chain")
                    ),
                );
            }
            if o.forward_rules {
                let mut forward = |net: IpNet, what: &str| {
                    let net = net.trunc();
                    r.builtin(
                        "filter",
                        "FORWARD",
                        &net,
                        format!(
                            "-s {net} {} -j ACCEPT",
                            comment(&format!("Kilo: forward packets from {what}"))
                        ),
                    );
                    r.builtin(
                        "filter",
                        "FORWARD",
                        &net,
                        format!(
                            "-d {net} {} -j ACCEPT",
                            comment(&format!("Kilo: forward packets to {what}"))
                        ),
                    );
                };
                match self.local_segment().filter(|_| self.leader) {
                    Some(s) => {
                        for pods in s.members.iter().flat_map(Member::pod_cidrs) {
                            forward(pods, "the pod subnet");
                        }
                        for net in &s.allowed_location_ips {
                            forward(*net, "allowed location IPs");
                        }
                        for ip in s.private_ips() {
                            forward(IpNet::from(ip), "private IPs");
                        }
                    }
                    None => {
                        for pods in self.local_pod_cidrs() {
                            forward(pods, "the node's pod subnet");
                        }
                    }
                }
            }
        }
        for s in &self.segments {
            r.nat_return(IpNet::from(s.wireguard_ip), "WireGuared IPs");
            for net in &s.allowed_ips {
                r.nat_return(*net, "known IPs");
            }
            if self.in_local_location(s) {
                for net in &s.allowed_location_ips {
                    r.nat_jump("-d", *net);
                    // Traffic inside the location's own range keeps its source (a virtual IP
                    // in that range answered from it, as etcd's on Talos).
                    let net = net.trunc();
                    r.kilo_nat(
                        &net,
                        format!(
                            "-s {net} -d {net} {} -j RETURN",
                            comment("Kilo: do not NAT packets within allowed location IPs")
                        ),
                    );
                }
            }
        }
        for p in &self.peers {
            for net in &p.allowed_ips {
                r.nat_jump("-s", *net);
                r.nat_return(*net, "peers");
            }
        }
        for net in &o.service_cidrs {
            r.nat_return(*net, "service CIDRs");
        }
        r.dedup();
        let tail = format!("{} -j MASQUERADE", comment("Kilo: NAT remaining packets"));
        r.v4.kilo_nat.push(tail.clone());
        r.v6.kilo_nat.push(tail);
        if o.ipip {
            self.ipip_rules(&mut r);
        }
        r
    }

    /// The IPIP rules (`pkg/encapsulation/ipip.go`): `INPUT` sends protocol 4 to
    /// `KILO-IPIP`, which accepts the private IPs of the local location; the rest is dropped.
    /// They guard the kernel's `tunl0` and the userspace IPIP socket alike, since both receive
    /// after `INPUT`.
    fn ipip_rules(&self, r: &mut RuleSet) {
        for family in [&mut r.v4, &mut r.v6] {
            family.kilo_ipip = Some(Vec::new());
            family.input = vec![
                format!(
                    "-p 4 {} -j {KILO_IPIP}",
                    comment("Kilo: jump to IPIP chain")
                ),
                format!(
                    "-p 4 {} -j DROP",
                    comment("Kilo: reject other IPIP traffic")
                ),
            ];
        }
        // Every node of the location may send IPIP: its own segment's, and the location's
        // other shares' (or, in `cross`, every node of the location).
        for ip in self.local_location_private_ips() {
            let net = IpNet::from(ip);
            let spec = format!("-s {net} {} -j ACCEPT", comment("Kilo: allow IPIP traffic"));
            let chain = r.family(&net).kilo_ipip.get_or_insert_with(Vec::new);
            if !chain.contains(&spec) {
                chain.push(spec);
            }
        }
    }
}

/// Removes every item equal to an earlier one, keeping the order (`O(n log n)`, no copies).
fn keep_first<T: Ord>(items: &mut Vec<T>) {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_unstable_by(|&a, &b| items[a].cmp(&items[b]).then(a.cmp(&b)));
    let mut repeat = vec![false; items.len()];
    for pair in order.windows(2) {
        if items[pair[0]] == items[pair[1]] {
            repeat[pair[1]] = true;
        }
    }
    let mut index = 0;
    items.retain(|_| {
        let keep = !repeat[index];
        index += 1;
        keep
    });
}

/// Rewrites the protocol of an `iptables -S` line to its number: iptables prints protocol 4 as
/// `ipencap` or `ipv4`, depending on `/etc/protocols`.
pub fn normalise_listed(spec: &str) -> String {
    for name in ["-p ipencap ", "-p ipv4 ", "-p ipip "] {
        if let Some(rest) = spec.strip_prefix(name) {
            return format!("-p 4 {rest}");
        }
    }
    spec.to_string()
}

/// True for a rule kg owns in a built-in chain: its comment starts with `Kilo: `.
pub fn is_kilo_rule(spec: &str) -> bool {
    spec.contains("--comment \"Kilo: ")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::fixtures::{f1_nodes, f1_params, f1_peers};
    use crate::node::Granularity;

    /// F1's rules for `host` in location granularity.
    pub(crate) fn rules(host: &str, o: &IptablesOptions) -> RuleSet {
        Topology::new(
            &f1_nodes(),
            &f1_peers(),
            &f1_params(host, Granularity::Location),
        )
        .unwrap()
        .iptables_rules(o)
    }

    #[test]
    fn traffic_within_the_locations_allowed_ips_keeps_its_source() {
        // F1's b announces 192.168.178.3/32 for location 2 (b and c).
        let keep = "-s 192.168.178.3/32 -d 192.168.178.3/32 -m comment --comment \"Kilo: do not NAT packets within allowed location IPs\" -j RETURN";
        for host in ["b", "c"] {
            let nat = rules(host, &IptablesOptions::default()).v4.kilo_nat;
            let at = nat.iter().position(|r| r == keep).expect(host);
            assert!(at < nat.len() - 1, "before MASQUERADE: {nat:?}");
        }
        let nat = rules("a", &IptablesOptions::default()).v4.kilo_nat;
        assert!(
            !nat.iter().any(|r| r == keep),
            "another location's range: {nat:?}"
        );
    }

    #[test]
    fn kilo_nat_returns_for_known_ips_then_masquerades() {
        let o = IptablesOptions {
            cni: true,
            forward_rules: false,
            service_cidrs: vec!["10.43.0.0/16".parse().unwrap()],
            ipip: false,
        };
        let r = rules("b", &o);
        assert_eq!(r.v4.kilo_nat.first().unwrap(), "-d 10.4.0.1/32 -m comment --comment \"Kilo: do not NAT packets destined for WireGuared IPs\" -j RETURN");
        assert!(r.v4.kilo_nat.contains(&"-d 10.2.3.0/24 -m comment --comment \"Kilo: do not NAT packets destined for known IPs\" -j RETURN".to_string()));
        assert!(r.v4.kilo_nat.contains(&"-d 10.5.0.0/24 -m comment --comment \"Kilo: do not NAT packets destined for peers\" -j RETURN".to_string()));
        let n = r.v4.kilo_nat.len();
        assert_eq!(r.v4.kilo_nat[n - 2], "-d 10.43.0.0/16 -m comment --comment \"Kilo: do not NAT packets destined for service CIDRs\" -j RETURN");
        assert_eq!(
            r.v4.kilo_nat[n - 1],
            "-m comment --comment \"Kilo: NAT remaining packets\" -j MASQUERADE"
        );
        assert_eq!(
            r.v6.kilo_nat,
            vec!["-m comment --comment \"Kilo: NAT remaining packets\" -j MASQUERADE".to_string()]
        );
        let jumps: Vec<&str> = r.v4.builtin.iter().map(|x| x.spec.as_str()).collect();
        assert!(jumps.contains(
            &"-s 10.2.2.0/24 -m comment --comment \"Kilo: jump to KILO-NAT chain\" -j KILO-NAT"
        ));
        assert!(
            jumps.contains(
                &"-d 192.168.178.3/32 -m comment --comment \"Kilo: jump to NAT chain\" -j KILO-NAT"
            ),
            "b's location IP"
        );
        assert!(
            jumps.contains(
                &"-s 10.5.0.0/24 -m comment --comment \"Kilo: jump to NAT chain\" -j KILO-NAT"
            ),
            "peer range"
        );
        assert!(r
            .v4
            .builtin
            .iter()
            .all(|x| x.table == "nat" && x.chain == "POSTROUTING"));
    }

    #[test]
    fn forward_rules_cover_a_leaders_segment_or_a_non_leaders_pods() {
        let o = IptablesOptions {
            cni: true,
            forward_rules: true,
            service_cidrs: vec![],
            ipip: false,
        };
        let leader = rules("b", &o);
        let forward: Vec<&str> = leader
            .v4
            .builtin
            .iter()
            .filter(|x| x.chain == "FORWARD")
            .map(|x| x.spec.as_str())
            .collect();
        assert!(forward.contains(&"-s 10.2.3.0/24 -m comment --comment \"Kilo: forward packets from the pod subnet\" -j ACCEPT"));
        assert!(forward.contains(&"-d 192.168.0.2/32 -m comment --comment \"Kilo: forward packets to private IPs\" -j ACCEPT"));
        assert!(forward.contains(&"-s 192.168.178.3/32 -m comment --comment \"Kilo: forward packets from allowed location IPs\" -j ACCEPT"));
        let other = rules("c", &o);
        let forward: Vec<&str> = other
            .v4
            .builtin
            .iter()
            .filter(|x| x.chain == "FORWARD")
            .map(|x| x.spec.as_str())
            .collect();
        assert_eq!(
            forward,
            [
                "-s 10.2.3.0/24 -m comment --comment \"Kilo: forward packets from the node's pod subnet\" -j ACCEPT",
                "-d 10.2.3.0/24 -m comment --comment \"Kilo: forward packets to the node's pod subnet\" -j ACCEPT",
            ]
        );
        let no_cni = rules("c", &IptablesOptions::default());
        assert!(no_cni
            .v4
            .builtin
            .iter()
            .all(|x| !x.spec.contains("KILO-NAT chain")));
    }

    #[test]
    fn ipip_rules_accept_the_locations_private_ips_and_drop_the_rest() {
        let o = IptablesOptions {
            ipip: true,
            ..Default::default()
        };
        // b leads location 2 with c; both have private IPs.
        let r = rules("c", &o);
        assert_eq!(
            r.v4.kilo_ipip.as_deref().unwrap(),
            [
                "-s 192.168.0.1/32 -m comment --comment \"Kilo: allow IPIP traffic\" -j ACCEPT",
                "-s 192.168.0.2/32 -m comment --comment \"Kilo: allow IPIP traffic\" -j ACCEPT",
            ]
        );
        assert_eq!(
            r.v4.input,
            [
                "-p 4 -m comment --comment \"Kilo: jump to IPIP chain\" -j KILO-IPIP",
                "-p 4 -m comment --comment \"Kilo: reject other IPIP traffic\" -j DROP",
            ]
        );
        assert_eq!(
            r.v6.kilo_ipip.as_deref(),
            Some(&[][..]),
            "v6 has the chain, empty"
        );
        assert_eq!(r.v6.input.len(), 2);
        let none = rules("c", &IptablesOptions::default());
        assert!(none.v4.kilo_ipip.is_none() && none.v4.input.is_empty());
        assert_eq!(
            normalise_listed(
                "-p ipencap -m comment --comment \"Kilo: jump to IPIP chain\" -j KILO-IPIP"
            ),
            r.v4.input[0]
        );
        assert_eq!(
            normalise_listed("-s 1.2.3.4/32 -j ACCEPT"),
            "-s 1.2.3.4/32 -j ACCEPT"
        );
    }

    #[test]
    fn kilo_rules_are_recognised_by_their_comment() {
        assert!(is_kilo_rule(
            "-s 10.2.2.0/24 -m comment --comment \"Kilo: jump to KILO-NAT chain\" -j KILO-NAT"
        ));
        assert!(!is_kilo_rule("-s 10.2.2.0/24 -j MASQUERADE"));
        assert!(!is_kilo_rule(
            "-m comment --comment \"Kilometres\" -j ACCEPT"
        ));
    }

    #[test]
    fn keep_first_drops_later_repeats_in_order() {
        let mut items = vec!["b", "a", "b", "c", "a", "a", "d"];
        keep_first(&mut items);
        assert_eq!(items, ["b", "a", "c", "d"]);
        let mut empty: Vec<String> = Vec::new();
        keep_first(&mut empty);
        assert!(empty.is_empty());
    }
}
