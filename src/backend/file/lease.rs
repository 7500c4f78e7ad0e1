//! Kubernetes Leases to and from `control::leader::LeaseState`, with the annotations that carry
//! deposed holders and a holder's cut-off.

use std::collections::BTreeMap;

use control::leader::LeaseState;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};

/// The election state of a Kubernetes Lease.
pub fn lease_state(lease: &Lease) -> LeaseState {
    let spec = lease.spec.as_ref();
    let annotation = |key: &str| {
        lease
            .metadata
            .annotations
            .as_ref()?
            .get(key)
            .map(String::as_str)
    };
    LeaseState {
        holder: spec
            .and_then(|s| s.holder_identity.clone())
            .filter(|h| !h.is_empty()),
        renewed_ms: spec
            .and_then(|s| s.renew_time.as_ref())
            .map_or(0, |t| t.0.as_millisecond()),
        duration_ms: spec
            .and_then(|s| s.lease_duration_seconds)
            .map_or(0, |d| i64::from(d) * 1000),
        transitions: spec.and_then(|s| s.lease_transitions).unwrap_or(0),
        cut_off: annotation(CUT_OFF_ANNOTATION).is_some_and(|v| v == "true"),
        deposed: annotation(DEPOSED_ANNOTATION).map_or_else(BTreeMap::new, decode_deposed),
        cut_off_predecessor: annotation(CUT_OFF_PREDECESSOR_ANNOTATION)
            .filter(|name| !name.is_empty())
            .map(str::to_string),
        handed_over_by: annotation(HANDED_OVER_BY_ANNOTATION)
            .filter(|name| !name.is_empty())
            .map(str::to_string),
    }
}

/// `name=last-seen` pairs, comma-separated (node names hold neither character); a malformed
/// pair is skipped.
fn decode_deposed(text: &str) -> BTreeMap<String, i64> {
    text.split(',')
        .filter_map(|pair| {
            let (name, seen) = pair.split_once('=')?;
            (!name.is_empty()).then_some(())?;
            Some((name.to_string(), seen.parse().ok()?))
        })
        .collect()
}

fn encode_deposed(deposed: &BTreeMap<String, i64>) -> String {
    deposed
        .iter()
        .map(|(name, seen)| format!("{name}={seen}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The Lease annotation that lists deposed holders (see `control::leader::LeaseState`).
pub const DEPOSED_ANNOTATION: &str = "kilotun.io/deposed";

/// The Lease annotation by which a holder says it is cut off (see `control::leader`).
pub const CUT_OFF_ANNOTATION: &str = "kilotun.io/cut-off";

/// The Lease annotation that names the cut-off holder its holder replaced (see
/// `control::leader::LeaseState`).
pub const CUT_OFF_PREDECESSOR_ANNOTATION: &str = "kilotun.io/cut-off-predecessor";

/// The Lease annotation that names the holder that handed it to its holder (see
/// `control::leader::LeaseState`).
pub const HANDED_OVER_BY_ANNOTATION: &str = "kilotun.io/handed-over-by";

/// `state` as a Kubernetes Lease called `name`.
pub fn lease_object(name: &str, state: &LeaseState) -> Lease {
    let renewed = k8s_openapi::jiff::Timestamp::from_millisecond(state.renewed_ms)
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            annotations: {
                let mut annotations = BTreeMap::new();
                if state.cut_off {
                    annotations.insert(CUT_OFF_ANNOTATION.to_string(), "true".to_string());
                }
                if let Some(name) = &state.cut_off_predecessor {
                    annotations.insert(CUT_OFF_PREDECESSOR_ANNOTATION.to_string(), name.clone());
                }
                if let Some(name) = &state.handed_over_by {
                    annotations.insert(HANDED_OVER_BY_ANNOTATION.to_string(), name.clone());
                }
                if !state.deposed.is_empty() {
                    annotations.insert(
                        DEPOSED_ANNOTATION.to_string(),
                        encode_deposed(&state.deposed),
                    );
                }
                (!annotations.is_empty()).then_some(annotations)
            },
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: state.holder.clone(),
            lease_duration_seconds: Some(((state.duration_ms + 999) / 1000) as i32),
            lease_transitions: Some(state.transitions),
            renew_time: Some(MicroTime(renewed)),
            ..Default::default()
        }),
    }
}
