//! The reconciler with `--ipam`: pod ranges from Calico's blocks.

use super::*;

/// A confirmed Calico block of `node`.
fn block(node: &str, cidr: &str) -> control::ipam::BlockAffinity {
    control::ipam::BlockAffinity {
        node: node.to_string(),
        cidr: cidr.parse().unwrap(),
        confirmed: true,
    }
}

/// The allowed IPs of segment `key` in the topology `log` converged to.
fn allowed_ips(log: &PassLog, key: &str) -> Vec<String> {
    let c = log.converged.as_ref().expect("a convergence");
    let segment = c.topology.segments.iter().find(|s| s.key == key).unwrap();
    segment
        .allowed_ips
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn pod_ranges_follow_calicos_blocks_and_the_cni_configuration_is_left_to_calico() {
    let mut bench = Bench::new(&["--ipam=auto", "--cni=true"]);
    let mut ipam = control::ipam::IpamObjects::default();
    for (node, cidr) in [
        ("a", "10.60.1.0/26"),
        ("b", "10.60.2.0/26"),
        ("c", "10.60.3.0/26"),
    ] {
        ipam.affinities
            .insert(format!("{node}-1"), block(node, cidr));
    }
    bench.snapshot.replace_ipam(ipam.clone());
    // Until every IPAM kind is listed, `auto` decides nothing (and nothing is meshed).
    bench.snapshot.listed.ipam = false;
    assert!(bench.pass(Trigger::Resync).waited);
    assert_eq!(bench.core.ipam_source(), None);
    bench.snapshot.listed.ipam = true;
    let first = bench.pass(Trigger::Resync);
    assert_eq!(
        bench.core.ipam_source(),
        Some(control::ipam::IpamSource::Calico)
    );
    let west = allowed_ips(&first, "location:l2");
    assert!(west.contains(&"10.60.3.0/26".to_string()), "{west:?}");
    assert!(
        !west.contains(&"10.2.3.0/24".to_string()),
        "the Node's own: {west:?}"
    );
    let links = ResolvedLinks {
        kilo: 3,
        ..Default::default()
    };
    let c = first.converged.as_ref().unwrap();
    let want = bench.core.desired(&c.topology, &links).unwrap();
    assert_eq!(want.cni, None, "Calico keeps its own configuration");
    // c takes a second block: the mesh is computed again on the event alone.
    ipam.affinities
        .insert("c-2".into(), block("c", "10.60.3.64/26"));
    bench.snapshot.replace_ipam(ipam);
    let second = bench.pass(Trigger::Event);
    let west = allowed_ips(&second, "location:l2");
    assert!(west.contains(&"10.60.3.64/26".to_string()), "{west:?}");
    // Nothing changed: nothing is computed.
    assert_eq!(bench.pass(Trigger::Event).meshed, None);
}
