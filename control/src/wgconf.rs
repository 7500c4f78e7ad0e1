//! WireGuard configurations derived from a [`Topology`]: what a leader applies, what a
//! Peer is given, what a node looks like as a Peer, and Kilo's INI rendering.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use ipnet::IpNet;

use crate::ip::Endpoint;
use crate::key::Key;
use crate::topology::Topology;
use keys::SecretKey;

/// One WireGuard peer of a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgPeer {
    /// The peer's public key.
    pub public_key: Key,
    /// Canonical allowed IPs, in Kilo's order.
    pub allowed_ips: Vec<IpNet>,
    /// Where to send (DNS name kept for display; its resolution is what is pushed).
    pub endpoint: Option<Endpoint>,
    /// Keepalive seconds; 0 is off.
    pub persistent_keepalive: u16,
    /// Optional preshared key.
    pub preshared_key: Option<SecretKey>,
    /// The key this peer replaces while its node rotates its key (see `crate::rotation`).
    pub replaces: Option<Key>,
}

/// A WireGuard configuration: an optional listen port and the peers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Conf {
    /// `ListenPort` of the `[Interface]` section, when there is one.
    pub listen_port: Option<u16>,
    /// Peers in Kilo's order.
    pub peers: Vec<WgPeer>,
}

/// Canonicalises `ips` and drops any prefix in `claimed`, claiming the rest. This is the fix for
/// Kilo's host-bit CIDRs, and it guarantees no prefix is routed to two peers.
fn claim(ips: impl IntoIterator<Item = IpNet>, claimed: &mut BTreeSet<IpNet>) -> Vec<IpNet> {
    ips.into_iter()
        .map(|n| n.trunc())
        .filter(|n| claimed.insert(*n))
        .collect()
}

impl Topology {
    /// A segment as one WireGuard peer: its leader's key and (possibly discovered) endpoint, its
    /// allowed IPs then allowed-location-ips, minus prefixes already `claimed`.
    fn segment_peer(
        &self,
        s: &crate::topology::Segment,
        persistent_keepalive: u16,
        preshared_key: Option<SecretKey>,
        claimed: &mut BTreeSet<IpNet>,
    ) -> WgPeer {
        let ips = s.allowed_ips.iter().chain(&s.allowed_location_ips).copied();
        WgPeer {
            public_key: s.public_key,
            allowed_ips: claim(ips, claimed),
            endpoint: self.effective_endpoint(
                s.endpoint.as_ref(),
                &s.public_key,
                s.persistent_keepalive,
            ),
            persistent_keepalive,
            preshared_key,
            replaces: None,
        }
    }

    /// A Peer as one WireGuard peer: its key, its (possibly discovered) endpoint and its allowed
    /// IPs minus prefixes already `claimed`.
    fn peer_peer(
        &self,
        p: &crate::peer::Peer,
        key: Key,
        persistent_keepalive: u16,
        preshared_key: Option<SecretKey>,
        claimed: &mut BTreeSet<IpNet>,
    ) -> WgPeer {
        WgPeer {
            public_key: key,
            allowed_ips: claim(p.allowed_ips.iter().copied(), claimed),
            endpoint: self.effective_endpoint(p.endpoint.as_ref(), &key, p.persistent_keepalive),
            persistent_keepalive,
            preshared_key,
            replaces: None,
        }
    }

    /// What the local leader applies: one peer per other segment, then one per Peer,
    /// all with the local keepalive. Entries whose key is `local_key` or already listed are
    /// skipped, so the device never gets itself or a duplicate as a peer.
    pub fn conf(&self, local_key: Option<&Key>) -> Conf {
        let mut keys: BTreeSet<Key> = local_key.copied().into_iter().collect();
        let mut claimed = BTreeSet::new();
        let mut peers = Vec::with_capacity(self.segments.len() + self.peers.len());
        let mut relayed = Vec::new();
        for s in self.segments.iter().filter(|s| !self.in_local_location(s)) {
            if let Some(relay) = self.relay_for(s) {
                relayed.push((s, relay.public_key));
                continue;
            }
            if !keys.insert(s.public_key) {
                continue;
            }
            peers.push(self.segment_peer(s, self.persistent_keepalive, None, &mut claimed));
        }
        // A segment reached through a relay is no peer of its own: its addresses go to the
        // relay's peer, which forwards them.
        for (s, relay) in relayed {
            let ips = s.allowed_ips.iter().chain(&s.allowed_location_ips).copied();
            let ips = claim(ips, &mut claimed);
            if let Some(peer) = peers.iter_mut().find(|p| p.public_key == relay) {
                peer.allowed_ips.extend(ips);
            }
        }
        for p in &self.peers {
            let Some(key) = p.public_key else { continue };
            if !keys.insert(key) {
                continue;
            }
            peers.push(self.peer_peer(
                p,
                key,
                self.persistent_keepalive,
                p.preshared_key.clone(),
                &mut claimed,
            ));
        }
        peers.extend(self.standby_peers(&mut keys));
        self.add_successors(&mut peers);
        Conf {
            listen_port: Some(self.port),
            peers,
        }
    }

    /// What the Peer called `name` is given: every segment (with the Peer's own
    /// keepalive and preshared key), then every other Peer.
    pub fn peer_conf(&self, name: &str) -> Conf {
        let me = self.peers.iter().find(|p| p.name == name);
        let keepalive = me.map_or(0, |p| p.persistent_keepalive);
        let psk = me.and_then(|p| p.preshared_key.clone());
        let mut claimed = BTreeSet::new();
        let mut peers = Vec::new();
        for s in &self.segments {
            peers.push(self.segment_peer(s, keepalive, psk.clone(), &mut claimed));
        }
        for p in self.peers.iter().filter(|p| p.name != name) {
            let Some(key) = p.public_key else { continue };
            peers.push(self.peer_peer(p, key, keepalive, None, &mut claimed));
        }
        Conf {
            listen_port: None,
            peers,
        }
    }

    /// The local segment as one WireGuard peer: its allowed IPs without the
    /// allowed-location-ips, the leader's key and endpoint.
    pub fn as_peer(&self) -> Option<WgPeer> {
        let s = self.local_segment()?;
        Some(WgPeer {
            public_key: s.public_key,
            allowed_ips: s.allowed_ips.iter().map(|n| n.trunc()).collect(),
            endpoint: s.endpoint.clone(),
            persistent_keepalive: 0,
            preshared_key: None,
            replaces: None,
        })
    }
}

impl Conf {
    /// Kilo's INI rendering. `private_key` (base64) goes in `[Interface]` when given.
    pub fn to_ini(&self, private_key: Option<&str>) -> String {
        let mut out = String::new();
        if self.listen_port.is_some() || private_key.is_some() {
            out.push_str("[Interface]\n");
            if let Some(k) = private_key {
                let _ = writeln!(out, "PrivateKey = {k}");
            }
            if let Some(port) = self.listen_port {
                let _ = writeln!(out, "ListenPort = {port}");
            }
        }
        for peer in &self.peers {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(&peer.to_ini());
        }
        out
    }
}

impl WgPeer {
    /// One `[Peer]` section in Kilo's field order.
    pub fn to_ini(&self) -> String {
        let mut out = String::from("[Peer]\n");
        let ips: Vec<String> = self.allowed_ips.iter().map(ToString::to_string).collect();
        let _ = writeln!(out, "AllowedIPs = {}", ips.join(", "));
        if let Some(e) = &self.endpoint {
            let _ = writeln!(out, "Endpoint = {e}");
        }
        let _ = writeln!(out, "PersistentKeepalive = {}", self.persistent_keepalive);
        if let Some(psk) = &self.preshared_key {
            let _ = writeln!(out, "PresharedKey = {}", psk.expose_base64().as_str());
        }
        let _ = writeln!(out, "PublicKey = {}", self.public_key);
        out
    }
}

/// A WireGuard peer as a Peer object named `name` (`kgctl showconf --as-peer -o yaml|json`, the
/// multi-cluster recipe). Unlike Kilo, the keepalive is in seconds, as the CRD documents, and a
/// peer without an endpoint has no `endpoint` (Kilo writes `ip: "<nil>"`).
pub fn peer_object(name: &str, peer: &WgPeer) -> crate::peer::PeerObject {
    let endpoint = peer.endpoint.as_ref().map(|e| crate::peer::PeerEndpoint {
        dns_or_ip: match &e.host {
            crate::ip::Host::Ip(ip) => crate::peer::DnsOrIp {
                dns: None,
                ip: Some(ip.to_string()),
            },
            crate::ip::Host::Dns { name, .. } => crate::peer::DnsOrIp {
                dns: Some(name.clone()),
                ip: None,
            },
        },
        port: u32::from(e.port),
    });
    crate::peer::PeerObject {
        api_version: crate::peer::API_VERSION.into(),
        kind: "Peer".into(),
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        spec: crate::peer::PeerSpec {
            allowed_ips: peer.allowed_ips.iter().map(ToString::to_string).collect(),
            endpoint,
            persistent_keepalive: (peer.persistent_keepalive > 0)
                .then_some(i64::from(peer.persistent_keepalive)),
            preshared_key: peer
                .preshared_key
                .as_ref()
                .map(|k| k.expose_base64().to_string()),
            public_key: peer.public_key.to_base64(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_object_round_trips_through_translation() {
        let wg = WgPeer {
            public_key: Key::padded("key1"),
            allowed_ips: vec![
                "10.4.0.1/32".parse().unwrap(),
                "10.2.1.0/24".parse().unwrap(),
            ],
            endpoint: Some(crate::ip::Endpoint {
                host: crate::ip::Host::Dns {
                    name: "a.example.com".into(),
                    resolved: None,
                },
                port: 51820,
            }),
            persistent_keepalive: 25,
            preshared_key: Some(SecretKey::from_bytes(Key::padded("psk").0)),
            replaces: None,
        };
        let object = peer_object("gcp-leader", &wg);
        assert_eq!(object.validate(), Ok(()));
        assert_eq!(object.spec.persistent_keepalive, Some(25));
        let back = crate::peer::translate_peer(&object);
        assert_eq!(back.name, "gcp-leader");
        assert_eq!(back.allowed_ips, wg.allowed_ips);
        assert_eq!(back.endpoint, wg.endpoint);
        assert_eq!(back.persistent_keepalive, 25);
        assert_eq!(back.preshared_key, wg.preshared_key);
        assert_eq!(back.public_key, Some(wg.public_key));
        let bare = peer_object(
            "x",
            &WgPeer {
                endpoint: None,
                persistent_keepalive: 0,
                ..wg
            },
        );
        assert!(bare.spec.endpoint.is_none() && bare.spec.persistent_keepalive.is_none());
    }

    use crate::fixtures::{f1_nodes, f1_params, f1_peers};
    use crate::node::Granularity;
    use crate::topology::TopologyParams;

    fn topology(host: &str, granularity: Granularity, keepalive: u16) -> Topology {
        let params = TopologyParams {
            persistent_keepalive: keepalive,
            leaders_per_location: 1,
            kept_out: Default::default(),
            ..f1_params(host, granularity)
        };
        Topology::new(&f1_nodes(), &f1_peers(), &params).unwrap()
    }

    #[test]
    fn leader_conf_lists_other_segments_then_peers_with_canonical_ips() {
        let t = topology("b", Granularity::Location, 0);
        let conf = t.conf(Some(&Key::padded("key2")));
        let expected = "\
[Interface]
ListenPort = 51820

[Peer]
AllowedIPs = 10.2.1.0/24, 192.168.0.1/32, 10.4.0.1/32
Endpoint = 10.1.0.1:51820
PersistentKeepalive = 0
PublicKey = a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=

[Peer]
AllowedIPs = 10.2.4.0/24, 10.4.0.3/32
Endpoint = 10.1.0.4:51820
PersistentKeepalive = 0
PublicKey = a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=

[Peer]
AllowedIPs = 10.5.0.0/24
Endpoint = 192.168.0.1:51820
PersistentKeepalive = 0
PublicKey = a2V5NQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=
";
        // Peer a shares node d's key (a fixture quirk): it is listed once, as the segment.
        // 192.168.0.1/32 is claimed by segment location:1 first (a and b share it in F1).
        assert_eq!(conf.to_ini(None), expected);
        assert_eq!(conf.peers.len(), 3);
        assert_eq!(conf.peers[1].public_key, Key::padded("key4"));
        assert_eq!(
            conf.peers[2].allowed_ips,
            vec!["10.5.0.0/24".parse::<IpNet>().unwrap()],
            "host bits cleared"
        );
    }

    #[test]
    fn the_local_keepalive_applies_to_every_peer() {
        let t = topology("a", Granularity::Full, 25);
        let conf = t.conf(Some(&Key::padded("key1")));
        assert_eq!(
            conf.peers.len(),
            4,
            "three nodes and peer b (peer a shares d's key)"
        );
        assert!(conf.peers.iter().all(|p| p.persistent_keepalive == 25));
        assert!(
            conf.peers
                .iter()
                .all(|p| p.public_key != Key::padded("key1")),
            "never itself"
        );
    }

    #[test]
    fn no_prefix_is_routed_to_two_peers() {
        let t = topology("c", Granularity::Full, 0);
        let conf = t.conf(Some(&Key::padded("key3")));
        let mut seen = BTreeSet::new();
        for p in &conf.peers {
            for ip in &p.allowed_ips {
                assert!(seen.insert(*ip), "{ip} twice");
            }
        }
    }

    #[test]
    fn nat_targets_use_discovered_endpoints() {
        let mut nodes = f1_nodes();
        nodes[1]
            .discovered_endpoints
            .insert(Key::padded("key1"), "1.2.3.4:9999".parse().unwrap());
        let params = f1_params("b", Granularity::Location);
        let t = Topology::new(&nodes, &[], &params).unwrap();
        let conf = t.conf(None);
        assert_eq!(
            conf.peers[0].endpoint.as_ref().unwrap().to_string(),
            "1.2.3.4:9999",
            "a has keepalive 25"
        );
        nodes[0].persistent_keepalive = 0;
        let t = Topology::new(&nodes, &[], &params).unwrap();
        assert_eq!(
            t.conf(None).peers[0].endpoint.as_ref().unwrap().to_string(),
            "10.1.0.1:51820"
        );
    }

    #[test]
    fn peer_conf_lists_every_segment_and_the_other_peers() {
        let mut peers = f1_peers();
        peers[1].persistent_keepalive = 10;
        peers[1].preshared_key = Some(SecretKey::from_bytes(Key::padded("psk").0));
        let params = f1_params("a", Granularity::Location);
        let t = Topology::new(&f1_nodes(), &peers, &params).unwrap();
        let conf = t.peer_conf("b");
        assert_eq!(conf.listen_port, None);
        assert_eq!(conf.peers.len(), 4);
        assert!(conf.peers[..3].iter().all(|p| p.persistent_keepalive == 10
            && p.preshared_key == Some(SecretKey::from_bytes(Key::padded("psk").0))));
        assert_eq!(conf.peers[3].public_key, Key::padded("key4"));
        assert_eq!(conf.peers[3].preshared_key, None);
        let ini = conf.to_ini(None);
        assert!(ini.starts_with("[Peer]\nAllowedIPs = 10.2.1.0/24, 192.168.0.1/32, 10.4.0.1/32\nEndpoint = 10.1.0.1:51820\nPersistentKeepalive = 10\nPresharedKey = "), "{ini}");
        assert!(ini.contains("\n\n[Peer]\n"));
        // The configuration a Peer is given carries its preshared key itself, never a stand-in.
        let psk_line = format!("PresharedKey = {}\n", Key::padded("psk").to_base64());
        assert_eq!(ini.matches(&psk_line).count(), 3, "{ini}");
    }

    #[test]
    fn as_peer_is_the_local_segment_without_location_ips() {
        let t = topology("c", Granularity::Location, 0);
        let p = t.as_peer().unwrap();
        assert_eq!(p.public_key, Key::padded("key2"));
        assert_eq!(p.allowed_ips.len(), 5);
        assert_eq!(p.endpoint.unwrap().to_string(), "10.1.0.2:51820");
    }
}
