//! Kilo's Peer custom resource (`kilo.squat.ai/v1alpha1`, cluster-scoped): its wire form,
//! validation and translation into a [`Peer`].

use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::ip::{is_dns_subdomain, normalise, parse_cidr, Endpoint, Host};
use crate::key::Key;
use crate::node::shortened;
use keys::SecretKey;

/// The Peer CRD's API group.
pub const GROUP: &str = "kilo.squat.ai";
/// The Peer CRD's version.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of a Peer object.
pub const API_VERSION: &str = "kilo.squat.ai/v1alpha1";
/// The plural resource name.
pub const PLURAL: &str = "peers";

/// A Peer object as stored in Kubernetes or in a cluster-dir file.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerObject {
    /// `kilo.squat.ai/v1alpha1`.
    #[serde(default)]
    pub api_version: String,
    /// `Peer`.
    #[serde(default)]
    pub kind: String,
    /// Object metadata; only the name matters.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The peer's WireGuard settings.
    #[serde(default)]
    pub spec: PeerSpec,
}

/// The `spec` of a Peer. Its `Debug` leaves the preshared key out.
#[derive(Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerSpec {
    /// CIDRs routed to this peer.
    #[serde(default, rename = "allowedIPs")]
    pub allowed_ips: Vec<String>,
    /// Where the peer listens, if it listens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<PeerEndpoint>,
    /// Keepalive seconds; above 0 also marks the peer as roaming/NATed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_keepalive: Option<i64>,
    /// Optional preshared key (base64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preshared_key: Option<String>,
    /// The peer's public key (base64).
    #[serde(default)]
    pub public_key: String,
}

impl std::fmt::Debug for PeerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSpec")
            .field("allowed_ips", &self.allowed_ips)
            .field("endpoint", &self.endpoint)
            .field("persistent_keepalive", &self.persistent_keepalive)
            .field(
                "preshared_key",
                &self.preshared_key.as_ref().map(|_| "<redacted>"),
            )
            .field("public_key", &self.public_key)
            .finish()
    }
}

/// A Peer's endpoint: a DNS name or an IP, plus a port.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerEndpoint {
    /// The host.
    #[serde(default, rename = "dnsOrIP")]
    pub dns_or_ip: DnsOrIp,
    /// The UDP port.
    #[serde(default)]
    pub port: u32,
}

/// The host of a [`PeerEndpoint`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DnsOrIp {
    /// A DNS-1123 subdomain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<String>,
    /// An IPv4 or IPv6 address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
}

/// How many characters of an offending value an error quotes (a value may be megabytes).
const ECHO_LIMIT: usize = 120;

/// Why a Peer failed validation. Quoted values are shortened to their first 120 characters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// An allowed IP is not a CIDR.
    #[error("allowedIPs: {0:?} is not a valid CIDR")]
    AllowedIp(String),
    /// An endpoint with neither `ip` nor `dns`.
    #[error("endpoint: either ip or dns must be set")]
    EndpointHost,
    /// `dns` is not a DNS-1123 subdomain.
    #[error("endpoint.dnsOrIP.dns: {0:?} is not a valid DNS name")]
    Dns(String),
    /// `ip` does not parse.
    #[error("endpoint.dnsOrIP.ip: {0:?} is not a valid IP address")]
    Ip(String),
    /// The port is outside 1–65535.
    #[error("endpoint.port: {0} is not in 1-65535")]
    Port(u32),
    /// A negative keepalive.
    #[error("persistentKeepalive: {0} must not be negative")]
    Keepalive(i64),
    /// The public key is not 32 bytes of base64.
    #[error("publicKey: {0:?} is not a valid WireGuard key")]
    PublicKey(String),
    /// The preshared key is not 32 bytes of base64.
    #[error("presharedKey is not a valid WireGuard key")]
    PresharedKey,
}

impl PeerObject {
    /// Kilo's `Validate`: every rule, first failure reported. (Kilo treats a bad preshared
    /// key as absent in translation; validation here rejects it, which the webhook reports.)
    pub fn validate(&self) -> Result<(), PeerError> {
        let spec = &self.spec;
        for ip in &spec.allowed_ips {
            if parse_cidr(ip).is_none() {
                return Err(PeerError::AllowedIp(shortened(ip, ECHO_LIMIT)));
            }
        }
        if let Some(endpoint) = &spec.endpoint {
            let host = &endpoint.dns_or_ip;
            if host.ip.as_deref().unwrap_or("").is_empty()
                && host.dns.as_deref().unwrap_or("").is_empty()
            {
                return Err(PeerError::EndpointHost);
            }
            if let Some(dns) = host.dns.as_deref().filter(|d| !d.is_empty()) {
                if !is_dns_subdomain(dns) {
                    return Err(PeerError::Dns(shortened(dns, ECHO_LIMIT)));
                }
            }
            if let Some(ip) = host.ip.as_deref().filter(|i| !i.is_empty()) {
                if ip.parse::<IpAddr>().is_err() {
                    return Err(PeerError::Ip(shortened(ip, ECHO_LIMIT)));
                }
            }
            if endpoint.port == 0 || endpoint.port > 65535 {
                return Err(PeerError::Port(endpoint.port));
            }
        }
        if let Some(k) = spec.persistent_keepalive {
            if k < 0 {
                return Err(PeerError::Keepalive(k));
            }
        }
        match Key::parse(&spec.public_key) {
            Ok(_) => {}
            Err(_) => {
                return Err(PeerError::PublicKey(shortened(
                    &spec.public_key,
                    ECHO_LIMIT,
                )))
            }
        }
        if let Some(psk) = spec.preshared_key.as_deref().filter(|p| !p.is_empty()) {
            if SecretKey::from_base64(psk).is_err() {
                return Err(PeerError::PresharedKey);
            }
        }
        Ok(())
    }
}

/// A Peer translated for the topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The object's name.
    pub name: String,
    /// Allowed IPs, host bits kept as written (canonicalised when pushed).
    pub allowed_ips: Vec<IpNet>,
    /// The public key; `None` when empty or invalid.
    pub public_key: Option<Key>,
    /// The endpoint, built only when the port is above 0; DNS wins over IP.
    pub endpoint: Option<Endpoint>,
    /// Keepalive seconds (always set, 0 when absent or negative).
    pub persistent_keepalive: u16,
    /// The preshared key, if valid.
    pub preshared_key: Option<SecretKey>,
}

impl Peer {
    /// Kilo's Peer readiness: at least one allowed IP and a public key.
    pub fn is_ready(&self) -> bool {
        !self.allowed_ips.is_empty() && self.public_key.is_some()
    }
}

/// Translates a Peer object (Kilo's `translatePeer`): invalid allowed IPs are dropped, the
/// endpoint exists only with a port above 0, DNS overrides IP, negative keepalive is 0.
pub fn translate_peer(object: &PeerObject) -> Peer {
    let spec = &object.spec;
    let allowed_ips = spec
        .allowed_ips
        .iter()
        .filter_map(|s| parse_cidr(s).map(normalise))
        .collect();
    let endpoint = spec.endpoint.as_ref().and_then(|e| {
        let port = u16::try_from(e.port).ok().filter(|p| *p > 0)?;
        let dns = e.dns_or_ip.dns.as_deref().filter(|d| !d.is_empty());
        let ip = e
            .dns_or_ip
            .ip
            .as_deref()
            .and_then(|i| i.parse::<IpAddr>().ok());
        let host = match (dns, ip) {
            (Some(name), _) => Host::Dns {
                name: name.to_string(),
                resolved: None,
            },
            (None, Some(ip)) => Host::Ip(ip),
            (None, None) => return None,
        };
        Some(Endpoint { host, port })
    });
    let persistent_keepalive = spec
        .persistent_keepalive
        .map_or(0, |k| k.clamp(0, i64::from(u16::MAX)) as u16);
    Peer {
        name: object.metadata.name.clone().unwrap_or_default(),
        allowed_ips,
        public_key: Key::parse(&spec.public_key).ok().filter(|k| !k.is_zero()),
        endpoint,
        persistent_keepalive,
        preshared_key: spec
            .preshared_key
            .as_deref()
            .and_then(|p| SecretKey::from_base64(p).ok()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(spec: PeerSpec) -> PeerObject {
        PeerObject {
            api_version: API_VERSION.into(),
            kind: "Peer".into(),
            metadata: ObjectMeta {
                name: Some("p".into()),
                ..Default::default()
            },
            spec,
        }
    }

    fn endpoint(dns: Option<&str>, ip: Option<&str>, port: u32) -> Option<PeerEndpoint> {
        Some(PeerEndpoint {
            dns_or_ip: DnsOrIp {
                dns: dns.map(Into::into),
                ip: ip.map(Into::into),
            },
            port,
        })
    }

    fn key() -> String {
        Key::padded("key1").to_base64()
    }

    #[test]
    fn translation_matches_kilos_vectors() {
        let p = translate_peer(&object(PeerSpec {
            allowed_ips: vec!["10.0.0.1".into(), "foo".into()],
            ..Default::default()
        }));
        assert!(p.allowed_ips.is_empty());
        let p = translate_peer(&object(PeerSpec {
            allowed_ips: vec!["10.0.0.1/24".into(), "10.0.0.2/32".into()],
            ..Default::default()
        }));
        assert_eq!(
            p.allowed_ips[0].to_string(),
            "10.0.0.1/24",
            "host bits kept"
        );
        assert_eq!(p.allowed_ips[1].to_string(), "10.0.0.2/32");
        let with = |e| {
            translate_peer(&object(PeerSpec {
                endpoint: e,
                ..Default::default()
            }))
            .endpoint
        };
        assert_eq!(with(endpoint(None, Some("foo"), 51820)), None);
        assert_eq!(with(endpoint(None, None, 51820)), None);
        assert_eq!(
            with(endpoint(None, Some("10.0.0.1"), 51820))
                .unwrap()
                .to_string(),
            "10.0.0.1:51820"
        );
        assert_eq!(
            with(endpoint(None, Some("ff60::2"), 51820))
                .unwrap()
                .to_string(),
            "[ff60::2]:51820"
        );
        assert_eq!(
            with(endpoint(Some("example.com"), None, 51820))
                .unwrap()
                .to_string(),
            "example.com:51820"
        );
        assert_eq!(
            with(endpoint(Some("example.com"), Some("10.0.0.1"), 51820))
                .unwrap()
                .to_string(),
            "example.com:51820",
            "DNS wins, as in Kilo's code"
        );
        assert_eq!(with(endpoint(None, Some("10.0.0.1"), 0)), None);
        assert_eq!(
            translate_peer(&object(PeerSpec::default())).public_key,
            None
        );
        let keepalive = |k| {
            translate_peer(&object(PeerSpec {
                persistent_keepalive: k,
                ..Default::default()
            }))
            .persistent_keepalive
        };
        assert_eq!(keepalive(Some(-1)), 0);
        assert_eq!(keepalive(Some(1)), 1);
        assert_eq!(keepalive(None), 0);
        let psk = Key::padded("psk").to_base64();
        let p = translate_peer(&object(PeerSpec {
            preshared_key: Some(psk),
            ..Default::default()
        }));
        assert_eq!(
            p.preshared_key,
            Some(SecretKey::from_bytes(Key::padded("psk").0))
        );
    }

    #[test]
    fn validation_rejects_each_bad_field() {
        let good = PeerSpec {
            allowed_ips: vec!["10.5.0.1/32".into()],
            public_key: key(),
            endpoint: endpoint(None, Some("1.2.3.4"), 51820),
            persistent_keepalive: Some(10),
            preshared_key: None,
        };
        assert_eq!(object(good.clone()).validate(), Ok(()));
        let cases: Vec<(PeerSpec, PeerError)> = vec![
            (
                PeerSpec {
                    allowed_ips: vec!["10.5.0.1".into()],
                    ..good.clone()
                },
                PeerError::AllowedIp("10.5.0.1".into()),
            ),
            (
                PeerSpec {
                    allowed_ips: vec!["fd00::1/128".into(), "fd00::zz/64".into()],
                    ..good.clone()
                },
                PeerError::AllowedIp("fd00::zz/64".into()),
            ),
            (
                PeerSpec {
                    allowed_ips: vec!["fd00::/200".into()],
                    ..good.clone()
                },
                PeerError::AllowedIp("fd00::/200".into()),
            ),
            (
                PeerSpec {
                    allowed_ips: vec!["fd00::1".into()],
                    ..good.clone()
                },
                PeerError::AllowedIp("fd00::1".into()),
            ),
            (
                PeerSpec {
                    endpoint: endpoint(None, None, 1),
                    ..good.clone()
                },
                PeerError::EndpointHost,
            ),
            (
                PeerSpec {
                    endpoint: endpoint(Some("Bad_Name"), None, 1),
                    ..good.clone()
                },
                PeerError::Dns("Bad_Name".into()),
            ),
            (
                PeerSpec {
                    endpoint: endpoint(None, Some("1.2.3"), 1),
                    ..good.clone()
                },
                PeerError::Ip("1.2.3".into()),
            ),
            (
                PeerSpec {
                    endpoint: endpoint(None, Some("1.2.3.4"), 70000),
                    ..good.clone()
                },
                PeerError::Port(70000),
            ),
            (
                PeerSpec {
                    persistent_keepalive: Some(-1),
                    ..good.clone()
                },
                PeerError::Keepalive(-1),
            ),
            (
                PeerSpec {
                    public_key: "".into(),
                    ..good.clone()
                },
                PeerError::PublicKey("".into()),
            ),
            (
                PeerSpec {
                    preshared_key: Some("xx".into()),
                    ..good
                },
                PeerError::PresharedKey,
            ),
        ];
        for (spec, want) in cases {
            assert_eq!(object(spec).validate(), Err(want));
        }
    }

    #[test]
    fn errors_quote_over_long_and_unicode_values_shortened() {
        let long = "9".repeat(100_000);
        let spec = |allowed: &str, key: &str| PeerSpec {
            allowed_ips: vec![allowed.into()],
            public_key: key.into(),
            endpoint: None,
            persistent_keepalive: None,
            preshared_key: None,
        };
        let e = object(spec(&long, &key())).validate().unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("allowedIPs: \"999"), "{text}");
        assert!(text.len() < 300, "{} bytes", text.len());
        let e = object(spec("10.0.0.0/8", &"ключ".repeat(100)))
            .validate()
            .unwrap_err();
        assert!(e.to_string().starts_with("publicKey: \"ключключ"), "{e}");
        assert!(e.to_string().contains('…'), "{e}");
    }

    #[test]
    fn peer_objects_round_trip_through_yaml_in_kubernetes_form() {
        let text = r#"
apiVersion: kilo.squat.ai/v1alpha1
kind: Peer
metadata:
  name: squat
spec:
  allowedIPs:
  - 10.5.0.1/32
  endpoint:
    dnsOrIP:
      ip: 1.1.1.1
    port: 51820
  persistentKeepalive: 10
  publicKey: a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=
"#;
        let obj: PeerObject = serde_saphyr::from_str(text).unwrap();
        assert_eq!(obj.validate(), Ok(()));
        let peer = translate_peer(&obj);
        assert_eq!(peer.name, "squat");
        assert_eq!(peer.endpoint.unwrap().to_string(), "1.1.1.1:51820");
        assert_eq!(peer.persistent_keepalive, 10);
        assert!(translate_peer(&obj).is_ready());
    }
}
