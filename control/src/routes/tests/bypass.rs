//! Endpoint bypasses: an endpoint inside a tunnel route keeps to the underlay.

use super::*;

fn underlay(lines: &[(&str, Option<&str>, u32)]) -> Vec<Route> {
    lines
        .iter()
        .map(|(dst, gw, link)| Route {
            table: MAIN_TABLE,
            dst: dst.parse().unwrap(),
            gateway: gw.map(|g| g.parse().unwrap()),
            link: *link,
            src: None,
            onlink: false,
        })
        .collect()
}

#[test]
fn an_endpoint_inside_a_peers_allowed_ips_keeps_to_the_underlay() {
    // Peer a claims 10.1.0.0/16, which holds every other location's endpoint (10.1.0.x).
    let mut peers = f1_peers();
    peers[0].allowed_ips.push("10.1.0.0/16".parse().unwrap());
    let t = Topology::new(&f1_nodes(), &peers, &f1_params("b", Granularity::Location)).unwrap();
    assert!(t.leader);
    let mut plan = t.route_plan(&options(true, Encapsulate::Never));
    assert!(show(&plan).contains(&"10.1.0.0/16 dev 1 src 192.168.0.1".to_string()));
    let host = underlay(&[
        ("0.0.0.0/0", Some("192.168.0.254"), PRIV),
        ("10.1.0.0/24", Some("192.168.0.253"), PRIV),
        ("192.168.0.0/24", None, PRIV),
        // A route on the WireGuard link itself never carries WireGuard's packets.
        ("10.1.0.3/32", None, KILO),
    ]);
    let bypasses = t.bypass_endpoints(&mut plan, KILO, &host);
    let mut got: Vec<String> = bypasses
        .iter()
        .map(|b| format!("{} {} {}", b.owner, b.endpoint, b.covered_by))
        .collect();
    got.sort();
    // F1's Peer b has node a's private IP as its endpoint, which b routes into the tunnel
    // towards a's location: kept on the underlay too.
    assert_eq!(
        got,
        [
            "node a 10.1.0.1 10.1.0.0/16",
            "node d 10.1.0.4 10.1.0.0/16",
            "peer b 192.168.0.1 192.168.0.1/32"
        ]
    );
    let routes = show(&plan);
    // The longest underlay prefix wins; the tunnel route itself stays.
    assert_has_route(&routes, "10.1.0.1/32 via 192.168.0.253 dev 2 onlink");
    assert_has_route(&routes, "192.168.0.1/32 dev 2");
    assert!(
        !routes.iter().any(|r| r.starts_with("192.168.0.1/32 via")),
        "{routes:?}"
    );
    assert_has_route(&routes, "10.1.0.4/32 via 192.168.0.253 dev 2 onlink");
    assert!(routes.contains(&"10.1.0.0/16 dev 1 src 192.168.0.1".to_string()));
    assert!(bypasses[0].to_string().contains("inside 10.1.0.0/16"));
}

#[test]
fn no_bypass_without_a_covering_tunnel_route_or_on_a_non_leader() {
    let mut quiet = f1_peers();
    quiet[1].endpoint = None;
    let t = Topology::new(&f1_nodes(), &quiet, &f1_params("b", Granularity::Location)).unwrap();
    let mut plan = t.route_plan(&options(true, Encapsulate::Never));
    let before = plan.clone();
    let host = underlay(&[("0.0.0.0/0", Some("192.168.0.254"), PRIV)]);
    assert!(t.bypass_endpoints(&mut plan, KILO, &host).is_empty());
    assert_eq!(plan, before);
    let mut peers = f1_peers();
    peers[0].allowed_ips.push("10.1.0.0/16".parse().unwrap());
    let member =
        Topology::new(&f1_nodes(), &peers, &f1_params("c", Granularity::Location)).unwrap();
    assert!(!member.leader);
    let mut plan = member.route_plan(&options(true, Encapsulate::Never));
    assert!(member.bypass_endpoints(&mut plan, KILO, &host).is_empty());
}
