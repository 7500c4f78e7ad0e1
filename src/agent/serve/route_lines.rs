//! Route and rule changes written as the `ip` command would say them, for `/status`'s drift
//! lines.

use std::collections::BTreeMap;

use control::routes::RouteOp;

/// Describes a route or rule change as the `ip` command would.
pub fn describe(op: &RouteOp, names: &BTreeMap<u32, String>) -> String {
    let dev = |index: u32| {
        names
            .get(&index)
            .cloned()
            .unwrap_or_else(|| format!("#{index}"))
    };
    match op {
        RouteOp::ReplaceRoute(r) | RouteOp::DeleteRoute(r) => {
            let verb = if matches!(op, RouteOp::ReplaceRoute(_)) {
                "missing or different: ip route replace"
            } else {
                "unexpected: ip route del"
            };
            let mut line = format!("{verb} {}", r.dst);
            if let Some(gw) = r.gateway {
                line.push_str(&format!(" via {gw}"));
            }
            line.push_str(&format!(" dev {}", dev(r.link)));
            if let Some(src) = r.src {
                line.push_str(&format!(" src {src}"));
            }
            if r.onlink {
                line.push_str(" onlink");
            }
            if r.table != 254 {
                line.push_str(&format!(" table {}", r.table));
            }
            line
        }
        RouteOp::AddRule(rule) | RouteOp::DeleteRule(rule) => {
            let verb = if matches!(op, RouteOp::AddRule(_)) {
                "missing: ip rule add"
            } else {
                "unexpected: ip rule del"
            };
            let mut line = verb.to_string();
            if let Some(g) = rule.guard {
                let family = if g.ipv6 { " -6" } else { "" };
                let action = if rule.is_unreachable() {
                    "unreachable".to_string()
                } else {
                    format!("lookup {}", rule.table)
                };
                let verb = verb.replacen("ip rule", &format!("ip{family} rule"), 1);
                return format!(
                    "{verb} pref {} fwmark {:#x}/{:#x} {action}",
                    g.priority, g.mark, g.mark
                );
            }
            if let Some(src) = rule.src {
                line.push_str(&format!(" from {src}"));
            }
            if let Some(dst) = rule.dst {
                line.push_str(&format!(" to {dst}"));
            }
            if let Some(iif) = &rule.iif {
                line.push_str(&format!(" iif {iif}"));
            }
            line.push_str(&format!(" lookup {}", rule.table));
            line
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use control::routes::{Route, Rule};

    #[test]
    fn describes_changes_as_ip_commands() {
        let names = BTreeMap::from([(5, "kilo0".to_string())]);
        let route = Route {
            table: 1107,
            dst: "10.42.3.0/24".parse().unwrap(),
            gateway: Some("10.4.0.2".parse().unwrap()),
            link: 5,
            src: None,
            onlink: true,
        };
        assert_eq!(
            describe(&RouteOp::ReplaceRoute(route.clone()), &names),
            "missing or different: ip route replace 10.42.3.0/24 via 10.4.0.2 dev kilo0 onlink table 1107"
        );
        let rule = Rule {
            src: None,
            dst: Some("192.168.10.2/32".parse().unwrap()),
            iif: Some("kilo0".into()),
            table: 1107,
            guard: None,
        };
        assert_eq!(
            describe(&RouteOp::AddRule(rule), &names),
            "missing: ip rule add to 192.168.10.2/32 iif kilo0 lookup 1107"
        );
        let unnamed = Route { link: 9, ..route };
        assert!(describe(&RouteOp::DeleteRoute(unnamed), &names).contains("dev #9"));
    }

    #[test]
    fn guard_rules_are_described_with_their_mark_and_priority() {
        let names = BTreeMap::new();
        assert_eq!(
            describe(
                &RouteOp::AddRule(Rule::guard(1100, 0x1000, true, 1108)),
                &names
            ),
            "missing: ip -6 rule add pref 1100 fwmark 0x1000/0x1000 lookup 1108"
        );
        assert_eq!(
            describe(
                &RouteOp::DeleteRule(Rule::guard(1101, 0x1000, false, 0)),
                &names
            ),
            "unexpected: ip rule del pref 1101 fwmark 0x1000/0x1000 unreachable"
        );
    }
}
