//! The topology as a Graphviz DOT graph, drawn the way Kilo's `kgctl graph` draws it:
//! one dashed cluster per segment with its leader ranked first, leader-to-member edges, an edge
//! between every pair of leaders, and Peers in their own cluster joined to every leader.

use std::fmt::Write as _;

use crate::node::Granularity;
use crate::routes::Withheld;
use crate::topology::Topology;

/// Quotes `text` as a DOT string.
fn quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl Topology {
    /// The DOT source of the mesh.
    pub fn dot(&self) -> String {
        let mut out = String::from("digraph kilo {\n");
        let _ = writeln!(
            out,
            "\tlabel={};",
            quote(&self.kilo_subnet.trunc().to_string())
        );
        out.push_str("\tlabelloc=t;\n\toutputorder=nodesfirst;\n\toverlap=false;\n");
        for s in &self.segments {
            let _ = writeln!(
                out,
                "\tsubgraph {} {{",
                quote(&format!("cluster_location_{}", s.key))
            );
            let _ = writeln!(out, "\t\tlabel={};", quote(&s.key));
            out.push_str("\t\tstyle=\"dashed,rounded\";\n");
            for (i, m) in s.members.iter().enumerate() {
                let mut label = vec![s.key.clone(), m.name.clone()];
                label.extend(m.pod_cidrs().map(|n| n.to_string()));
                if let Some(ip) = m.private_ip {
                    label.push(ip.addr().to_string());
                }
                let leader = i == s.leader;
                if leader {
                    label.push(s.wireguard_ip.to_string());
                    if let Some(e) = &s.endpoint {
                        label.push(e.to_string());
                    }
                }
                let rank = if leader { ", rank=1" } else { "" };
                let _ = writeln!(
                    out,
                    "\t\t{} [label={}{rank}, shape=ellipse];",
                    quote(&m.name),
                    quote(&label.join("\n"))
                );
            }
            let head = &s.leader_member().name;
            for (i, m) in s.members.iter().enumerate() {
                if i != s.leader {
                    let _ = writeln!(out, "\t\t{} -> {} [dir=both];", quote(head), quote(&m.name));
                }
            }
            out.push_str("\t}\n");
        }
        for (i, a) in self.segments.iter().enumerate() {
            for b in &self.segments[i + 1..] {
                // `cross`: no tunnel between the nodes of one location, nor between the shares
                // of a location with several leaders.
                if a.location == b.location
                    && (self.granularity == Granularity::Cross || (a.shared && b.shared))
                {
                    continue;
                }
                if let Some(relay) = self.relay_between(a, b) {
                    let _ = writeln!(
                        out,
                        "\t{} -> {} [dir=both, style=dotted, label={}];",
                        quote(&a.leader_member().name),
                        quote(&b.leader_member().name),
                        quote(&format!("via {}", relay.leader_member().name))
                    );
                    continue;
                }
                let _ = writeln!(
                    out,
                    "\t{} -> {} [dir=both];",
                    quote(&a.leader_member().name),
                    quote(&b.leader_member().name)
                );
            }
        }
        if !self.peers.is_empty() {
            out.push_str("\tsubgraph \"cluster_peers\" {\n\t\tlabel=\"peers\";\n\t\tstyle=\"dashed,rounded\";\n");
            for p in &self.peers {
                let endpoint = p
                    .endpoint
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "\t\t{} [label={}, shape=ellipse];",
                    quote(&p.name),
                    quote(&format!("{}\n{endpoint}\n", p.name))
                );
            }
            out.push_str("\t}\n");
            for s in &self.segments {
                for p in &self.peers {
                    let _ = writeln!(
                        out,
                        "\t{} -> {} [dir=both, style=dashed];",
                        quote(&s.leader_member().name),
                        quote(&p.name)
                    );
                }
            }
        }
        out.push_str("}\n");
        out
    }

    /// [`Topology::dot`] with the CIDRs withheld on this node (see
    /// [`Topology::guarded_route_plan`]) marked: a red note per CIDR, joined to its owner.
    pub fn dot_with_withheld(&self, withheld: &[Withheld]) -> String {
        let mut out = self.dot();
        if withheld.is_empty() {
            return out;
        }
        out.truncate(out.len() - "}\n".len());
        for w in withheld {
            let owner = match w.owner.split_once(' ') {
                Some(("location", key)) => self
                    .segments
                    .iter()
                    .find(|s| s.key == key)
                    .map_or(key, |s| s.leader_member().name.as_str()),
                Some((_, name)) => name,
                None => w.owner.as_str(),
            };
            let id = quote(&format!("withheld {} {}", w.owner, w.cidr));
            let label = format!(
                "not routed on {}:\n{} {}\ncontains connected {}",
                self.hostname, w.field, w.cidr, w.connected
            );
            let _ = writeln!(
                out,
                "\t{id} [label={}, shape=note, color=red, fontcolor=red];",
                quote(&label)
            );
            let _ = writeln!(
                out,
                "\t{} -> {id} [style=dotted, color=red, arrowhead=none];",
                quote(owner)
            );
        }
        out.push_str("}\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{f1_nodes, f1_params, f1_peers};
    use crate::node::Granularity;
    use crate::topology::Topology;

    #[test]
    fn the_graph_has_a_cluster_per_segment_leader_edges_and_peers() {
        let params = f1_params("c", Granularity::Location);
        let t = Topology::new(&f1_nodes(), &f1_peers(), &params).unwrap();
        let dot = t.dot();
        assert!(dot.starts_with("digraph kilo {\n\tlabel=\"10.4.0.0/16\";\n\tlabelloc=t;\n\toutputorder=nodesfirst;\n\toverlap=false;\n"));
        assert!(dot.contains("\tsubgraph \"cluster_location_location:2\" {\n\t\tlabel=\"location:2\";\n\t\tstyle=\"dashed,rounded\";\n"));
        assert!(dot.contains("\"b\" [label=\"location:2\\nb\\n10.2.2.0/24\\n192.168.0.1\\n10.4.0.2\\n10.1.0.2:51820\", rank=1, shape=ellipse];"), "{dot}");
        assert!(dot.contains(
            "\"c\" [label=\"location:2\\nc\\n10.2.3.0/24\\n192.168.0.2\", shape=ellipse];"
        ));
        assert!(dot.contains("\t\t\"b\" -> \"c\" [dir=both];"));
        for (a, b) in [("a", "b"), ("a", "d"), ("b", "d")] {
            assert!(
                dot.contains(&format!("\t\"{a}\" -> \"{b}\" [dir=both];")),
                "{a}-{b}"
            );
        }
        assert!(
            dot.contains("\"b\" [label=\"b\\n192.168.0.1:51820\\n\", shape=ellipse];"),
            "peers end with a newline, as Kilo's"
        );
        assert!(dot.contains("\t\"d\" -> \"a\" [dir=both, style=dashed];"));
        assert!(dot.ends_with("}\n"));
    }

    #[test]
    fn withheld_cidrs_are_marked_on_their_owner() {
        use crate::routes::{Withheld, FIELD_ALLOWED_LOCATION_IPS};
        let params = f1_params("c", Granularity::Location);
        let t = Topology::new(&f1_nodes(), &f1_peers(), &params).unwrap();
        assert_eq!(t.dot_with_withheld(&[]), t.dot());
        let dot = t.dot_with_withheld(&[Withheld {
            owner: "node b".into(),
            field: FIELD_ALLOWED_LOCATION_IPS,
            cidr: "192.168.178.3/32".parse().unwrap(),
            connected: "192.168.178.3/32".parse().unwrap(),
        }]);
        assert!(dot.starts_with(t.dot().trim_end_matches("}\n")), "{dot}");
        assert!(dot.contains("\t\"withheld node b 192.168.178.3/32\" [label=\"not routed on c:\\nkilo.squat.ai/allowed-location-ips 192.168.178.3/32\\ncontains connected 192.168.178.3/32\", shape=note, color=red, fontcolor=red];\n"), "{dot}");
        assert!(dot.contains("\t\"b\" -> \"withheld node b 192.168.178.3/32\" [style=dotted, color=red, arrowhead=none];\n}\n"), "{dot}");
    }
}
