//! The local node as kg fills it in (Kilo's `handleLocal`): endpoint and internal IP from the
//! force annotations or auto-detection, and the annotations to write back.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use control::node::{annotation, AnnotationProblem, Node, WrittenAnnotations};
use control::Endpoint;
use ipnet::IpNet;

use super::ipdetect::Detected;

/// What `force-internal-ip` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForcedInternalIp {
    /// Absent or invalid: auto-detect.
    Detect,
    /// `""` or `-`: no private IP.
    Disabled,
    /// A valid CIDR.
    Forced(IpNet),
}

/// What `force-endpoint` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForcedEndpoint {
    /// Absent or invalid: auto-detect.
    Detect,
    /// `""` or `-`: no endpoint; the node is reached where its handshakes come from.
    Disabled,
    /// A valid endpoint.
    Forced(Endpoint),
}

/// Reads `force-endpoint`.
pub fn forced_endpoint(annotations: &BTreeMap<String, String>) -> ForcedEndpoint {
    match annotations.get(annotation::FORCE_ENDPOINT) {
        None => ForcedEndpoint::Detect,
        Some(v) if control::node::is_no_endpoint(v) => ForcedEndpoint::Disabled,
        Some(v) => Endpoint::parse(v).map_or(ForcedEndpoint::Detect, ForcedEndpoint::Forced),
    }
}

/// Reads `force-internal-ip`.
pub fn forced_internal_ip(annotations: &BTreeMap<String, String>) -> ForcedInternalIp {
    match annotations
        .get(annotation::FORCE_INTERNAL_IP)
        .map(String::as_str)
    {
        None => ForcedInternalIp::Detect,
        Some("") | Some("-") => ForcedInternalIp::Disabled,
        Some(v) => v
            .parse()
            .map_or(ForcedInternalIp::Detect, ForcedInternalIp::Forced),
    }
}

/// Fills the local node: the endpoint is `force-endpoint`, none (`-`), or the detected external
/// IP with `--port` (re-detected every time, where Kilo kept a stale one); the internal IP is the
/// forced one, none, or the detected private IP.
pub fn fill_local(
    node: &mut Node,
    annotations: &BTreeMap<String, String>,
    detected: &Detected,
    prioritise_private: bool,
    port: u16,
) {
    node.endpoint = match forced_endpoint(annotations) {
        ForcedEndpoint::Forced(e) => Some(e),
        ForcedEndpoint::Disabled => None,
        ForcedEndpoint::Detect => {
            let external = match (prioritise_private, detected.private) {
                (true, Some(private)) => private,
                _ => detected.public,
            };
            Some(Endpoint::from_addr(SocketAddr::new(external.addr(), port)))
        }
    };
    match forced_internal_ip(annotations) {
        ForcedInternalIp::Forced(net) => {
            node.internal_ip = Some(net);
            node.no_internal_ip = false;
        }
        ForcedInternalIp::Disabled => {
            node.internal_ip = None;
            node.no_internal_ip = true;
        }
        ForcedInternalIp::Detect => {
            node.internal_ip = detected.private;
            node.no_internal_ip = false;
        }
    }
}

/// The annotation changes that bring `current` to `written` (only differing keys).
pub fn annotation_changes(
    current: &BTreeMap<String, String>,
    written: &WrittenAnnotations,
) -> BTreeMap<String, Option<String>> {
    written
        .to_map()
        .into_iter()
        .filter(|(k, v)| current.get(k) != Some(v))
        .map(|(k, v)| (k, Some(v)))
        .collect()
}

/// Remembers which problems were logged per object, so each is logged once, when it appears.
#[derive(Debug, Default)]
pub struct ProblemLog {
    seen: BTreeMap<String, Vec<String>>,
}

impl ProblemLog {
    /// Returns the problems of `object` not reported last time, and remembers the current set.
    pub fn fresh(&mut self, object: &str, problems: &[AnnotationProblem]) -> Vec<String> {
        let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
        self.fresh_lines(object, lines)
    }

    /// As [`ProblemLog::fresh`], for already formatted lines.
    pub fn fresh_lines(&mut self, object: &str, lines: Vec<String>) -> Vec<String> {
        let previous = self.seen.get(object).cloned().unwrap_or_default();
        let new: Vec<String> = lines
            .iter()
            .filter(|l| !previous.contains(l))
            .cloned()
            .collect();
        if lines.is_empty() {
            self.seen.remove(object);
        } else {
            self.seen.insert(object.to_string(), lines);
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use control::node::Granularity;
    use control::Key;

    fn detected() -> Detected {
        Detected {
            private: Some("192.168.0.5/24".parse().unwrap()),
            public: "203.0.113.5/24".parse().unwrap(),
        }
    }

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn auto_values_come_from_detection() {
        let mut n = Node::default();
        fill_local(&mut n, &BTreeMap::new(), &detected(), false, 51820);
        assert_eq!(n.endpoint.unwrap().to_string(), "203.0.113.5:51820");
        assert_eq!(n.internal_ip, Some("192.168.0.5/24".parse().unwrap()));
        let mut n = Node::default();
        fill_local(&mut n, &BTreeMap::new(), &detected(), true, 51821);
        assert_eq!(
            n.endpoint.unwrap().to_string(),
            "192.168.0.5:51821",
            "--prioritise-private-addresses"
        );
    }

    #[test]
    fn force_annotations_win_and_bad_ones_fall_back() {
        let mut n = Node::default();
        let a = annotations(&[
            (annotation::FORCE_ENDPOINT, "node.example.com:4000"),
            (annotation::FORCE_INTERNAL_IP, "-"),
        ]);
        fill_local(&mut n, &a, &detected(), false, 51820);
        assert_eq!(n.endpoint.unwrap().to_string(), "node.example.com:4000");
        assert_eq!(n.internal_ip, None);
        assert!(n.no_internal_ip);
        let a = annotations(&[
            (annotation::FORCE_ENDPOINT, "bad"),
            (annotation::FORCE_INTERNAL_IP, "bad"),
        ]);
        let mut n = Node::default();
        fill_local(&mut n, &a, &detected(), false, 51820);
        assert_eq!(n.endpoint.unwrap().to_string(), "203.0.113.5:51820");
        assert_eq!(n.internal_ip, Some("192.168.0.5/24".parse().unwrap()));
        for none in ["-", ""] {
            let mut n = Node::default();
            let a = annotations(&[(annotation::FORCE_ENDPOINT, none)]);
            fill_local(&mut n, &a, &detected(), false, 51820);
            assert_eq!(n.endpoint, None, "{none:?}");
        }
    }

    #[test]
    fn only_differing_annotations_are_patched() {
        let written = WrittenAnnotations {
            endpoint: Some(Endpoint::parse("1.2.3.4:51820").unwrap()),
            internal_ip: None,
            key: Key::padded("k"),
            last_seen: 7,
            wireguard_ip: None,
            discovered_endpoints: BTreeMap::new(),
            granularity: Granularity::Location,
            cni_compatibility_ip: None,
            leader_election: false,
        };
        let mut current: BTreeMap<String, String> = written.to_map();
        assert!(annotation_changes(&current, &written).is_empty());
        current.insert(annotation::LAST_SEEN.into(), "6".into());
        let changes = annotation_changes(&current, &written);
        assert_eq!(
            changes,
            BTreeMap::from([(annotation::LAST_SEEN.to_string(), Some("7".to_string()))])
        );
    }

    #[test]
    fn problems_are_reported_once_until_they_change() {
        let mut log = ProblemLog::default();
        assert_eq!(log.fresh_lines("n", vec!["x".into()]).len(), 1);
        assert!(log.fresh_lines("n", vec!["x".into()]).is_empty());
        assert_eq!(log.fresh_lines("n", vec!["x".into(), "y".into()]), ["y"]);
        assert!(log.fresh_lines("n", vec![]).is_empty());
        assert_eq!(
            log.fresh_lines("n", vec!["x".into()]).len(),
            1,
            "reported again after it was fixed"
        );
    }
}
