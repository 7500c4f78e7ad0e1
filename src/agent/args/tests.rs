use super::*;

fn parse(args: &[&str]) -> Result<Settings> {
    let mut full = vec!["kg", "--hostname=n1"];
    full.extend_from_slice(args);
    KgArgs::try_parse_from(full)?.settings()
}

#[test]
fn version_names_the_target_it_was_built_for() {
    use clap::CommandFactory;
    let version = KgArgs::command().render_version();
    assert!(version.starts_with("kg "), "{version}");
    assert!(version.contains(crate::TARGET), "{version}");
    // The triple is the one this binary runs as (under qemu-user too).
    // (armv7-… and armv6-… triples both run as "arm".)
    let arch = std::env::consts::ARCH;
    assert!(
        crate::TARGET.starts_with(arch),
        "{} vs {arch}",
        crate::TARGET
    );
}

#[test]
fn defaults_match_kilo() {
    let s = parse(&[]).unwrap();
    assert_eq!(s.args.backend, BackendKind::Kubernetes);
    assert!(s.args.clean_up && s.args.cni && s.args.create_interface && s.args.local);
    assert_eq!(s.args.wireguard, WireGuardChoice::Embedded);
    assert!(!s.args.clean_up_interface && !s.args.iptables_forward_rules);
    assert_eq!(s.args.interface, "kilo0");
    assert_eq!(s.args.listen, ":1107");
    assert_eq!(s.args.port, 51820);
    assert_eq!(s.subnet.to_string(), "10.4.0.0/16");
    assert_eq!(s.resync, Duration::from_secs(30));
    assert_eq!(s.mtu, Mtu::Auto);
    assert_eq!(s.granularity, Granularity::Location);
    assert_eq!(s.encapsulate, Encapsulate::Always);
    assert_eq!(s.args.topology_label, "topology.kubernetes.io/region");
    assert_eq!(
        s.args.cni_path,
        PathBuf::from("/etc/cni/net.d/10-kilo.conflist")
    );
}

#[test]
fn go_style_booleans_and_repeatable_flags() {
    let s = parse(&[
        "--local=false",
        "--cni=false",
        "--clean-up",
        "--internal-cidr=10.0.0.0/8",
        "--internal-cidr",
        "192.168.0.0/16",
    ])
    .unwrap();
    assert!(!s.args.local && !s.args.cni && s.args.clean_up);
    assert_eq!(s.internal_cidrs.len(), 2);
}

#[test]
fn internal_cidrs_take_ipv6_prefixes() {
    let s = parse(&["--internal-cidr=fd50::/64", "--internal-cidr=2001:db8::/32"]).unwrap();
    assert_eq!(
        s.internal_cidrs,
        [
            "fd50::/64".parse::<IpNet>().unwrap(),
            "2001:db8::/32".parse().unwrap()
        ]
    );
    for bad in ["--internal-cidr=fd50::zz/64", "--internal-cidr=fd50::/129"] {
        let err = format!("{:#}", parse(&[bad]).unwrap_err());
        assert!(err.contains("--internal-cidr"), "{bad}: {err}");
    }
}

#[test]
fn bad_flags_are_named() {
    for (args, needle) in [
        (vec!["--mesh-granularity=crisscross"], "--mesh-granularity"),
        (vec!["--encapsulate=sometimes"], "--encapsulate"),
        (vec!["--subnet=10.4.0.0"], "--subnet"),
        (vec!["--resync-period=soon"], "--resync-period"),
        (vec!["--mtu=9"], "--mtu"),
        (vec!["--compatibility=calico"], "--compatibility"),
        (vec!["--backend=file"], "--cluster-dir"),
        (vec!["--service-cidr=nope"], "--service-cidr"),
        (vec!["--interface=this-name-is-far-too-long"], "--interface"),
        (vec!["--key-rotation-period=30s"], "--key-rotation-period"),
        (vec!["--key-rotation-period=soon"], "--key-rotation-period"),
        (vec!["--psk-rotation-period=1s"], "--psk-rotation-period"),
    ] {
        let err = format!("{:#}", parse(&args).unwrap_err());
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn the_key_rotation_period_is_off_unless_given() {
    assert_eq!(parse(&[]).unwrap().key_rotation, None);
    let s = parse(&["--key-rotation-period=24h"]).unwrap();
    assert_eq!(s.key_rotation, Some(Duration::from_secs(86_400)));
}

#[test]
fn go_durations_parse() {
    assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
    assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
    assert!(parse_duration("30").is_err());
    let too_long = parse_duration("100000000000000000000h")
        .unwrap_err()
        .to_string();
    assert!(too_long.contains("too long"), "{too_long}");
}
