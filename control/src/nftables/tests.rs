use super::*;
use crate::fixtures::{f1_params, synthetic_cluster};
use crate::iptables::tests::rules as f1_rules;
use crate::iptables::IptablesOptions;
use crate::node::Granularity;
use crate::topology::{Topology, TopologyParams};

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn nets(list: &[&str]) -> BTreeSet<IpNet> {
    list.iter().map(|s| net(s)).collect()
}

fn every_option() -> IptablesOptions {
    IptablesOptions {
        cni: true,
        forward_rules: true,
        service_cidrs: vec![net("10.96.0.0/12"), net("fd00:96::/108")],
        ipip: true,
    }
}

#[test]
fn every_rule_kilo_writes_has_a_set() {
    for host in ["a", "b", "c", "d"] {
        for o in [IptablesOptions::default(), every_option()] {
            let rules = f1_rules(host, &o);
            let sets = FirewallSets::of(&rules).unwrap_or_else(|e| panic!("{host}: {e}"));
            // Every network of the iptables rules is matched by its set (possibly through a
            // wider element).
            let covered = |set: &BTreeSet<IpNet>, n: IpNet| set.iter().any(|s| s.contains(&n));
            for spec in &rules.v4.kilo_nat {
                if let (None, Some(d)) = (net_after(spec, "-s"), net_after(spec, "-d")) {
                    assert!(covered(&sets.v4.no_nat, d), "{host}: {spec}");
                }
            }
            assert_eq!(sets.v4.ipip.is_some(), o.ipip, "{host}");
            assert_eq!(
                !sets.v4.forward_from.is_empty(),
                o.forward_rules && o.cni,
                "{host}"
            );
        }
    }
}

#[test]
fn the_sets_say_what_kilo_nat_says() {
    // b leads location 2 with c; c's pods are 10.2.3.0/24 (F1).
    let sets = FirewallSets::of(&f1_rules("b", &every_option())).unwrap();
    assert!(sets.v4.no_nat.contains(&net("10.96.0.0/12")), "{sets:#?}");
    assert!(sets.v6.no_nat.contains(&net("fd00:96::/108")));
    assert_eq!(sets.v4.within, nets(&["192.168.178.3/32"]));
    assert_eq!(sets.v4.nat_to, nets(&["192.168.178.3/32"]));
    assert_eq!(
        sets.v4.ipip,
        Some(nets(&["192.168.0.1/32", "192.168.0.2/32"]))
    );
}

#[test]
fn a_rule_no_set_stands_for_is_an_error_naming_it() {
    let mut rules = f1_rules("a", &IptablesOptions::default());
    rules.v4.kilo_nat.insert(0, "-p tcp -j RETURN".into());
    let e = FirewallSets::of(&rules).unwrap_err();
    assert_eq!(e.chain, KILO_NAT);
    assert!(e.to_string().contains("-p tcp -j RETURN"), "{e}");
}

#[test]
fn disjoint_keeps_only_what_nothing_else_covers() {
    let input = nets(&[
        "10.0.0.0/8",
        "10.1.2.0/24",
        "10.255.0.1/32",
        "192.168.0.0/25",
        "192.168.0.128/25",
        "192.168.0.7/32",
        "fd00::/64",
        "fd00::1/128",
        "fd01::1/128",
    ]);
    assert_eq!(
        disjoint(&input),
        nets(&[
            "10.0.0.0/8",
            "192.168.0.0/25",
            "192.168.0.128/25",
            "fd00::/64",
            "fd01::1/128"
        ])
    );
    // Host bits are cleared, as nft would refuse them in a prefix.
    assert_eq!(disjoint(&nets(&["10.1.2.3/24"])), nets(&["10.1.2.0/24"]));
}

#[test]
fn a_change_adds_and_removes_only_the_elements_that_changed() {
    let mut from = FirewallSets::default();
    from.v4.no_nat = nets(&["10.4.0.1/32", "10.2.1.0/24"]);
    from.v4.nat_from = nets(&["10.2.1.0/24"]);
    let mut to = from.clone();
    to.v4.no_nat = nets(&["10.4.0.1/32", "10.2.9.0/24"]);
    let script = change_script(&from, &to, true);
    assert_eq!(
        script,
        "delete element inet kilo no_nat4 { 10.2.1.0/24 }\n\
         add element inet kilo no_nat4 { 10.2.9.0/24 }\n"
    );
    assert_eq!(change_script(&to, &to, true), "");
    // Deletes come first: a /16 replacing a /24 it covers never overlaps it.
    let mut wider = to.clone();
    wider.v4.no_nat = nets(&["10.4.0.1/32", "10.2.0.0/16"]);
    let script = change_script(&to, &wider, true);
    let (delete, add) = (
        script.find("delete element").unwrap(),
        script.find("add element").unwrap(),
    );
    assert!(delete < add, "{script}");
}

#[test]
fn a_set_losing_many_elements_is_flushed_and_filled_again() {
    let many = |count: u32| -> std::collections::BTreeSet<ipnet::IpNet> {
        (0..count)
            .map(|i| {
                format!("10.{}.{}.0/24", 100 + i / 256, i % 256)
                    .parse()
                    .unwrap()
            })
            .collect()
    };
    let mut from = FirewallSets::default();
    from.v4.no_nat = many(1000);
    let mut to = from.clone();
    to.v4.no_nat = many(10);
    let script = change_script(&from, &to, false);
    assert!(!script.contains("delete element"), "{script}");
    let flush = script.find("flush set inet kilo no_nat4\n").expect(&script);
    let add = script
        .find("add element inet kilo no_nat4 { ")
        .expect(&script);
    assert!(flush < add, "{script}");
    // What stays is all there: the ten networks, in one add.
    assert_eq!(script.matches("add element").count(), 1, "{script}");
    for net in &to.v4.no_nat {
        assert!(script.contains(&net.to_string()), "{net} missing: {script}");
    }
    // Everything leaving: a flush and nothing to add.
    to.v4.no_nat.clear();
    let script = change_script(&from, &to, false);
    assert_eq!(script, "flush set inet kilo no_nat4\n");
    // At the threshold, still element by element.
    to.v4.no_nat = from.v4.no_nat.iter().skip(FLUSH_OVER).copied().collect();
    let script = change_script(&from, &to, false);
    assert!(script.starts_with("delete element"), "{script}");
}

#[test]
fn a_chain_is_rewritten_only_when_its_rules_change() {
    let mut from = FirewallSets::default();
    let mut to = from.clone();
    to.v4.within = nets(&["192.168.178.3/32"]);
    let script = change_script(&from, &to, false);
    assert!(
        script.starts_with("flush chain inet kilo kilo_nat\n"),
        "{script}"
    );
    assert!(script.contains(
        "add rule inet kilo kilo_nat ip saddr 192.168.178.3/32 ip daddr 192.168.178.3/32 return"
    ));
    assert!(script.ends_with(
        "add rule inet kilo kilo_nat masquerade comment \"Kilo: NAT remaining packets\"\n"
    ));
    assert!(!script.contains("chain inet kilo input"), "{script}");
    // IPIP turned on rewrites the input chain.
    from = to.clone();
    to.v4.ipip = Some(nets(&["192.168.0.1/32"]));
    to.v6.ipip = Some(BTreeSet::new());
    let script = change_script(&from, &to, true);
    assert!(script.contains("add element inet kilo ipip_from4 { 192.168.0.1/32 }"));
    assert!(script.contains("flush chain inet kilo input"));
    assert!(script.contains("add rule inet kilo input meta l4proto 4 drop"));
}

#[test]
fn the_full_table_declares_every_set_and_chain() {
    let sets = FirewallSets::of(&f1_rules("b", &every_option())).unwrap();
    let script = full_script(&sets, true);
    assert!(script.starts_with("table inet kilo\ndelete table inet kilo\ntable inet kilo {\n"));
    for name in [
        "nat_from",
        "nat_to",
        "no_nat",
        "forward_from",
        "forward_to",
        "ipip_from",
    ] {
        for n in ["4", "6"] {
            assert!(
                script.contains(&format!("  set {name}{n} {{\n")),
                "{name}{n}"
            );
        }
    }
    assert!(script.contains(" 10.96.0.0/12, "), "{script}");
    assert!(script.contains("type nat hook postrouting priority srcnat - 1; policy accept;"));
    // Without IPv6 no set or rule names it.
    let v4 = full_script(&sets, false);
    assert!(!v4.contains("ip6") && !v4.contains("no_nat6"), "{v4}");
}

#[test]
fn a_listing_reads_back_into_the_view_the_sets_want() {
    let mut sets = FirewallSets::default();
    sets.v4.no_nat = nets(&["10.4.0.1/32", "10.2.1.0/24"]);
    sets.v4.ipip = Some(nets(&["192.168.0.1/32"]));
    let wanted = TableView::wanted(&sets, false);
    // What `nft -j list table inet kilo` prints for that table (nft 1.0.6), abridged to the
    // fields the view reads.
    let mut items = vec![serde_json::json!({"metainfo": {"version": "1.0.6"}})];
    for (name, elems) in &wanted.sets {
        let elem: Vec<serde_json::Value> = elems
            .iter()
            .map(|n| {
                if n.prefix_len() == n.max_prefix_len() {
                    serde_json::json!(n.addr().to_string())
                } else {
                    serde_json::json!({"prefix": {"addr": n.addr().to_string(), "len": n.prefix_len()}})
                }
            })
            .collect();
        let mut set = serde_json::json!({"family": "inet", "name": name, "table": "kilo", "type": "ipv4_addr", "flags": ["interval"]});
        if !elem.is_empty() {
            set["elem"] = serde_json::json!(elem);
        }
        items.push(serde_json::json!({ "set": set }));
    }
    for (chain, comments) in &wanted.chains {
        items
            .push(serde_json::json!({"chain": {"family": "inet", "table": "kilo", "name": chain}}));
        for c in comments {
            items.push(serde_json::json!({"rule": {"family": "inet", "table": "kilo", "chain": chain, "comment": c, "expr": []}}));
        }
    }
    let listing = serde_json::json!({ "nftables": items }).to_string();
    assert_eq!(TableView::from_listing(&listing).unwrap(), wanted);
    // A rule or element removed by someone else shows.
    let mut changed = sets;
    changed.v4.no_nat.remove(&net("10.2.1.0/24"));
    assert_ne!(TableView::wanted(&changed, false), wanted);
    assert!(TableView::from_listing("{}").is_err());
}

#[test]
fn a_leader_move_at_scale_changes_a_handful_of_elements() {
    // 5,000 nodes in 500 locations of 10: the sets hold thousands of networks, and a location
    // changing its leader changes the script by the networks that moved, not by the table.
    let nodes = synthetic_cluster(5000, 500);
    let params = |host: &str| TopologyParams {
        hostname: host.into(),
        ..f1_params(host, Granularity::Location)
    };
    let sets_of = |nodes: &[crate::node::Node]| {
        let t = Topology::new(nodes, &[], &params("node-00000")).unwrap();
        FirewallSets::of(&t.iptables_rules(&every_option())).unwrap()
    };
    let before = sets_of(&nodes);
    assert!(before.v4.no_nat.len() > 1000, "{}", before.v4.no_nat.len());
    // A remote leader (node 7 leads loc-007) moving to another location: every network it
    // brings stays known, so the sets do not change at all.
    let mut moved = nodes.clone();
    moved[7].location = moved[8].location.clone();
    assert_eq!(change_script(&before, &sets_of(&moved), true), "");
    // A node leaving this node's location (node 500 is in loc-000, led by node 0): its pod
    // CIDR is no longer forwarded as the segment's.
    let mut left = nodes.clone();
    left[500].location = "loc-001".into();
    let script = change_script(&before, &sets_of(&left), true);
    assert!(!script.is_empty());
    assert!(script.lines().count() < 10, "{script}");
    assert!(script.len() < 1000, "{} bytes", script.len());
    // A new node (node 5000, in loc-000): its pod CIDR and private IP join the sets of this
    // location, one element each.
    let mut grown = nodes;
    grown.extend(synthetic_cluster(5001, 500).pop());
    let script = change_script(&before, &sets_of(&grown), true);
    assert_eq!(
        script,
        "add element inet kilo no_nat4 { 10.83.136.0/24, 172.16.19.136/32 }\n\
         add element inet kilo forward_from4 { 10.83.136.0/24, 172.16.19.136/32 }\n\
         add element inet kilo forward_to4 { 10.83.136.0/24, 172.16.19.136/32 }\n\
         add element inet kilo ipip_from4 { 172.16.19.136/32 }\n"
    );
}
