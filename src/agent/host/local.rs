//! The local node as kg fills it in (Kilo's `handleLocal`): endpoint and internal IP from the
//! force annotations or auto-detection, and the annotations to write back.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use control::node::{annotation, AnnotationProblem, Node, WrittenAnnotations};
use control::Endpoint;
use ipnet::IpNet;

use super::ipdetect::{Detected, Families};

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

/// A `force-internal-ip` kg refuses on its own node: the host has no usable address of that
/// family (an IPv6 internal IP forced on an IPv4-only host, say), so nothing could leave from it
/// and the routes other nodes build to it would lead nowhere.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "node {node}: {annotation}=\"{value}\" refused: this host has no usable {family} address (it has {families}); using the detected internal IP {fallback} instead",
    annotation = annotation::FORCE_INTERNAL_IP,
    family = if value.addr().is_ipv4() { "IPv4" } else { "IPv6" },
    fallback = fallback.map_or_else(|| "(none)".to_string(), |f| f.to_string()),
)]
pub struct RefusedInternalIp {
    /// The node's name.
    pub node: String,
    /// The annotation's value.
    pub value: IpNet,
    /// The families the host has addresses of.
    pub families: Families,
    /// The internal IP used instead: the detected one.
    pub fallback: Option<IpNet>,
}

/// Fills the local node: the endpoint is `force-endpoint`, none (`-`), or the detected external
/// IP with `--port` (re-detected every time, where Kilo kept a stale one); the internal IP is the
/// forced one, none, or the detected private IP.
///
/// A forced internal IP of a family the host has no address of is refused and the detected
/// private IP used instead (returned as the refusal, for the caller to report). Detection
/// rather than the last good value: detection always yields an address the host holds, so the
/// node stays on the mesh with routes that work, from the first start on (when there is no last
/// good value) and across restarts; and it is what Kilo does with a `force-internal-ip` it
/// cannot parse. Fixing the annotation takes effect at the next reconcile.
pub fn fill_local(
    node: &mut Node,
    annotations: &BTreeMap<String, String>,
    detected: &Detected,
    prioritise_private: bool,
    port: u16,
) -> Option<RefusedInternalIp> {
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
        ForcedInternalIp::Forced(net) if !detected.families.holds_family_of(net.addr()) => {
            node.internal_ip = detected.private;
            node.no_internal_ip = false;
            return Some(RefusedInternalIp {
                node: node.name.clone(),
                value: net,
                families: detected.families,
                fallback: detected.private,
            });
        }
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
    None
}

/// The annotation changes that bring `current` to `written` (only differing keys).
pub fn annotation_changes(
    current: &BTreeMap<String, String>,
    written: &WrittenAnnotations,
) -> BTreeMap<String, Option<String>> {
    let map = written.to_map();
    // An annotation kg writes only in some runs (`kilotun.io/leader-election`,
    // `kilotun.io/leader-shares`, and an earlier kilotun's `kilotun.io/leaders-per-location`)
    // goes when this run does not write it: a run left on the Node by another configuration
    // would speak for this one.
    let gone = control::node::annotation::WRITTEN
        .iter()
        .filter(|k| !map.contains_key(**k) && current.contains_key(**k))
        .map(|k| (k.to_string(), None));
    map.iter()
        .filter(|(k, v)| current.get(*k) != Some(v))
        .map(|(k, v)| (k.clone(), Some(v.clone())))
        .chain(gone)
        .collect()
}

/// Changes to a Node's annotations: a key set to a value, or removed (`None`).
pub type AnnotationPatch = BTreeMap<String, Option<String>>;

/// The `last-seen` to publish at `now_unix`: a check-in writes `now_unix`; otherwise the
/// current value stays while it is younger than `check_in_period`, so a reconcile between
/// check-ins (a peer moved, a resync) does not make the Node change again.
pub fn last_seen_to_publish(
    current: Option<i64>,
    now_unix: i64,
    check_in: bool,
    check_in_period: i64,
) -> i64 {
    match current {
        Some(v) if !check_in && now_unix.saturating_sub(v) < check_in_period => v,
        _ => now_unix,
    }
}

/// A patch this kg sent: the annotations it was sent against, and whether the backend has shown
/// the Node with it applied since.
#[derive(Debug, Clone)]
pub struct SentPatch {
    against: BTreeMap<String, String>,
    patch: AnnotationPatch,
    shown: bool,
}

impl SentPatch {
    /// `patch`, sent against the Node's annotations `against`.
    pub fn new(against: BTreeMap<String, String>, patch: AnnotationPatch) -> Self {
        Self {
            against,
            patch,
            shown: false,
        }
    }

    /// Takes in the Node's annotations as the backend shows them now: once they hold the
    /// patch, a later Node that lacks it again was changed by another writer.
    pub fn observe(&mut self, current: &BTreeMap<String, String>) {
        self.shown |= self
            .patch
            .iter()
            .all(|(key, value)| current.get(key) == value.as_ref());
    }

    /// True when `changes` is this patch again, against the same Node, which the backend has
    /// not shown with the patch applied: the watch is a moment behind the patch.
    fn awaits(&self, current: &BTreeMap<String, String>, changes: &AnnotationPatch) -> bool {
        !self.shown && self.against == *current && self.patch == *changes
    }
}

/// The patch to send so that the Node's annotations `current` say `written`, if one is due:
/// none when nothing differs, and none when it is the patch last sent (`last_sent`) and the
/// backend has not shown the Node since (sending it again would double the API server's load).
/// A Node that another writer set back to what the patch was sent against gets it again.
pub fn patch_due(
    current: &BTreeMap<String, String>,
    written: &WrittenAnnotations,
    last_sent: Option<&SentPatch>,
) -> Option<AnnotationPatch> {
    let changes = annotation_changes(current, written);
    let awaited = last_sent.is_some_and(|sent| sent.awaits(current, &changes));
    (!changes.is_empty() && !awaited).then_some(changes)
}

/// Remembers which problems were logged per object, so each is logged once, when it appears.
#[derive(Debug, Default)]
pub struct ProblemLog {
    seen: BTreeMap<String, Vec<String>>,
    /// What [`ProblemLog::warn_once`] said.
    said_once: std::collections::BTreeSet<&'static str>,
}

impl ProblemLog {
    /// Logs `message` at warning level the first time `what` is said, and never again.
    pub fn warn_once(&mut self, what: &'static str, message: &str) {
        if self.first_time(what) {
            tracing::warn!("{message}");
        }
    }

    /// True the first time `what` is asked about, and never again.
    pub fn first_time(&mut self, what: &'static str) -> bool {
        self.said_once.insert(what)
    }

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
    /// What a location-granularity node with only an endpoint writes, checked in at `last_seen`.
    fn written_at(last_seen: i64) -> WrittenAnnotations {
        WrittenAnnotations {
            endpoint: Some(Endpoint::parse("1.2.3.4:51820").unwrap()),
            internal_ip: None,
            key: Key::padded("k"),
            last_seen,
            wireguard_ip: None,
            discovered_endpoints: BTreeMap::new(),
            granularity: Granularity::Location,
            cni_compatibility_ip: None,
            second_internal_ip: None,
            leader_election: false,
            leaders_per_location: 1,
            next_key: None,
            key_rotated: None,
            pq: None,
            endpoints: Vec::new(),
        }
    }

    #[test]
    fn last_seen_moves_at_check_ins_and_when_it_grows_old() {
        use super::last_seen_to_publish as last_seen;
        assert_eq!(last_seen(Some(1_000), 1_010, true, 30), 1_010, "a check-in");
        assert_eq!(
            last_seen(Some(1_000), 1_010, false, 30),
            1_000,
            "a reconcile between"
        );
        assert_eq!(last_seen(Some(1_000), 1_030, false, 30), 1_030, "grown old");
        assert_eq!(last_seen(None, 1_010, false, 30), 1_010, "never written");
        assert_eq!(
            last_seen(Some(2_000), 1_010, false, 30),
            2_000,
            "from a clock ahead"
        );
    }

    #[test]
    fn a_patch_is_due_when_something_differs_and_not_twice_before_the_node_shows_it() {
        let written = written_at(1_000);
        let empty = BTreeMap::new();
        let first = patch_due(&empty, &written, None).expect("everything differs");
        assert_eq!(
            first.get(annotation::LAST_SEEN),
            Some(&Some("1000".to_string()))
        );
        let mut sent = SentPatch::new(empty.clone(), first.clone());
        assert_eq!(
            patch_due(&empty, &written, Some(&sent)),
            None,
            "the same patch against the same Node, not shown yet"
        );
        // The Node as the patch left it: nothing to send.
        let applied: BTreeMap<String, String> = first
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), v.clone()?)))
            .collect();
        sent.observe(&applied);
        assert_eq!(patch_due(&applied, &written, Some(&sent)), None);
        // Someone else changed the Node back: the patch is due again.
        let mut reverted = applied;
        reverted.remove(annotation::LAST_SEEN);
        assert!(patch_due(&reverted, &written, Some(&sent)).is_some());
        // Even when they set it back to exactly what the patch was sent against.
        assert_eq!(patch_due(&empty, &written, Some(&sent)), Some(first));
    }

    use super::*;
    use control::node::Granularity;
    use control::Key;

    fn detected() -> Detected {
        Detected {
            private: Some("192.168.0.5/24".parse().unwrap()),
            public: "203.0.113.5/24".parse().unwrap(),
            families: Families {
                ipv4: true,
                ipv6: false,
            },
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
    fn a_forced_ipv6_internal_ip_wins_over_detected_ipv4_on_a_dual_stack_host() {
        let mut dual = detected();
        dual.families.ipv6 = true;
        let a = annotations(&[
            (annotation::FORCE_ENDPOINT, "[fd50::5]:51820"),
            (annotation::FORCE_INTERNAL_IP, "fd50::5/64"),
        ]);
        let mut n = Node::default();
        assert_eq!(fill_local(&mut n, &a, &dual, false, 51820), None);
        assert_eq!(n.internal_ip, Some("fd50::5/64".parse().unwrap()));
        assert_eq!(n.endpoint.unwrap().to_string(), "[fd50::5]:51820");
    }

    #[test]
    fn a_forced_internal_ip_of_a_family_the_host_lacks_is_refused_for_detection() {
        let a = annotations(&[(annotation::FORCE_INTERNAL_IP, "fd50::5/64")]);
        let mut n = Node {
            name: "a1".into(),
            ..Default::default()
        };
        let refused = fill_local(&mut n, &a, &detected(), false, 51820).expect("refused");
        assert_eq!(n.internal_ip, Some("192.168.0.5/24".parse().unwrap()));
        assert!(!n.no_internal_ip);
        assert_eq!(
            refused.to_string(),
            "node a1: kilo.squat.ai/force-internal-ip=\"fd50::5/64\" refused: this host has no \
             usable IPv6 address (it has IPv4 only); using the detected internal IP \
             192.168.0.5/24 instead"
        );
        // An IPv6-only host refuses an IPv4 one alike.
        let v6_only = Detected {
            private: Some("fd50::5/64".parse().unwrap()),
            public: "fd50::5/64".parse().unwrap(),
            families: Families {
                ipv4: false,
                ipv6: true,
            },
        };
        let a = annotations(&[(annotation::FORCE_INTERNAL_IP, "192.168.0.5/24")]);
        assert!(fill_local(&mut n, &a, &v6_only, false, 51820).is_some());
        assert_eq!(n.internal_ip, Some("fd50::5/64".parse().unwrap()));
    }

    #[test]
    fn only_differing_annotations_are_patched() {
        let written = written_at(7);
        let mut current: BTreeMap<String, String> = written.to_map();
        assert!(annotation_changes(&current, &written).is_empty());
        current.insert(annotation::LAST_SEEN.into(), "6".into());
        let changes = annotation_changes(&current, &written);
        assert_eq!(
            changes,
            BTreeMap::from([(annotation::LAST_SEEN.to_string(), Some("7".to_string()))])
        );
        // What an earlier run wrote and this one does not goes; a foreign annotation stays.
        current.insert(annotation::LAST_SEEN.into(), "7".into());
        current.insert(annotation::LEADERS_PER_LOCATION.into(), "2".into());
        current.insert(annotation::LEADER_SHARES.into(), "2".into());
        current.insert(annotation::LEADER_ELECTION.into(), "lease".into());
        current.insert("example.com/other".into(), "x".into());
        let changes = annotation_changes(&current, &written);
        assert_eq!(
            changes,
            BTreeMap::from([
                (annotation::LEADER_ELECTION.to_string(), None),
                (annotation::LEADER_SHARES.to_string(), None),
                (annotation::LEADERS_PER_LOCATION.to_string(), None),
            ])
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
