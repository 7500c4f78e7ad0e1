//! The pure mapping from the control plane's WireGuard configuration to the engine's.

use control::wgconf::Conf;
use dataplane::{DeviceConfig, InterfaceConfig, PeerConfig, PublicKey, SecretKey};

/// The engine configuration for `conf`, with this node's private key. Peers whose DNS endpoint
/// has not resolved yet get no endpoint (they can still reach us).
pub fn device_config(conf: &Conf, private_key: &SecretKey) -> DeviceConfig {
    DeviceConfig {
        interface: InterfaceConfig {
            private_key: Some(private_key.clone()),
            listen_port: conf.listen_port.unwrap_or(0),
            fwmark: 0,
        },
        peers: conf
            .peers
            .iter()
            .map(|p| PeerConfig {
                public_key: PublicKey::from_bytes(p.public_key.0),
                preshared_key: p.preshared_key.clone(),
                endpoint: p.endpoint.as_ref().and_then(control::Endpoint::addr),
                persistent_keepalive: p.persistent_keepalive,
                allowed_ips: p.allowed_ips.iter().map(|n| n.trunc()).collect(),
                replaces: p.replaces.map(|k| PublicKey::from_bytes(k.0)),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use control::fixtures::{f1_nodes, f1_params, f1_peers};
    use control::{Granularity, Topology, TopologyParams};

    #[test]
    fn keys_endpoints_and_prefixes_carry_over() {
        let params = TopologyParams {
            port: 51821,
            persistent_keepalive: 25,
            leaders_per_location: 1,
            kept_out: Default::default(),
            ..f1_params("a", Granularity::Full)
        };
        let t = Topology::new(&f1_nodes(), &f1_peers(), &params).unwrap();
        let conf = t.conf(None);
        let key = SecretKey::generate();
        let dc = device_config(&conf, &key);
        assert_eq!(dc.interface.listen_port, 51821);
        assert_eq!(dc.peers.len(), conf.peers.len());
        for (p, c) in dc.peers.iter().zip(&conf.peers) {
            assert_eq!(p.public_key.as_bytes(), &c.public_key.0);
            assert_eq!(p.allowed_ips, c.allowed_ips);
            assert_eq!(p.persistent_keepalive, 25);
            assert_eq!(p.endpoint, c.endpoint.as_ref().and_then(|e| e.addr()));
        }
    }
}
