//! The CNI conflist kg keeps in step with the node: every plugin's IPAM ranges are the
//! node's pod CIDRs (one range set per family, as host-local takes a dual-stack node's), and (unlike Kilo, which leaves 1420) every plugin's `mtu` follows `--mtu`.

use std::collections::BTreeMap;

use ipnet::IpNet;
use serde_json::Value;

/// Why a conflist could not be updated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CniError {
    /// Not JSON.
    #[error("not valid JSON: {0}")]
    Json(String),
    /// No `plugins` array.
    #[error("no \"plugins\" list")]
    NoPlugins,
}

/// Rebuilds `value` with every object's keys sorted (Kilo writes keys sorted).
fn sorted(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let ordered: BTreeMap<String, Value> =
                map.into_iter().map(|(k, v)| (k, sorted(v))).collect();
            Value::Object(ordered.into_iter().collect())
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

/// The updated conflist (compact JSON, keys sorted), or `None` when `text` is already right.
/// `pod_cidrs` are the node's, `spec.podCIDR` first: each becomes a range set of its own.
pub fn update_conflist(
    text: &str,
    pod_cidrs: &[IpNet],
    mtu: Option<u32>,
) -> Result<Option<String>, CniError> {
    let mut conf: Value = serde_json::from_str(text).map_err(|e| CniError::Json(e.to_string()))?;
    let plugins = conf
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or(CniError::NoPlugins)?;
    let ranges: Vec<Value> = pod_cidrs
        .iter()
        .map(|n| serde_json::json!([{ "subnet": n.trunc().to_string() }]))
        .collect();
    let mut changed = false;
    for plugin in plugins.iter_mut() {
        let Some(object) = plugin.as_object_mut() else {
            continue;
        };
        if let Some(ipam) = object.get_mut("ipam").and_then(Value::as_object_mut) {
            if !same_subnets(ipam.get("ranges"), &ranges) {
                ipam.insert("ranges".into(), Value::Array(ranges.clone()));
                changed = true;
            }
        }
        if let (Some(mtu), Some(current)) = (mtu, object.get("mtu")) {
            if current.as_u64() != Some(u64::from(mtu)) {
                object.insert("mtu".into(), Value::from(mtu));
                changed = true;
            }
        }
    }
    if !changed {
        return Ok(None);
    }
    Ok(Some(
        serde_json::to_string(&sorted(conf)).expect("a JSON value serialises"),
    ))
}

/// True when `current` (an IPAM `ranges` value) has as many range sets as `wanted` and each
/// set's first subnet is the wanted one (what Kilo compares for its single range); other ranges
/// of a set and other keys of a range (a `gateway`, a `rangeStart`) are left as they are.
fn same_subnets(current: Option<&Value>, wanted: &[Value]) -> bool {
    let first_subnets = |sets: &[Value]| -> Vec<Option<String>> {
        sets.iter()
            .map(|set| {
                set.get(0)
                    .and_then(|r| r.get("subnet"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .collect()
    };
    match current.and_then(Value::as_array) {
        Some(sets) => first_subnets(sets) == first_subnets(wanted),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The conflist Kilo's manifests ship.
    pub(crate) const KILO_CONFLIST: &str = r#"{
  "cniVersion": "0.4.0",
  "name": "kilo",
  "plugins": [
    {"name": "kubernetes", "type": "bridge", "bridge": "kube-bridge", "isDefaultGateway": true,
     "forceAddress": true, "mtu": 1420, "ipam": {"type": "host-local"}},
    {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}}
  ]
}"#;

    #[test]
    fn the_ipam_range_and_mtu_follow_the_node() {
        let pods: IpNet = "10.42.3.0/24".parse().unwrap();
        let out = update_conflist(KILO_CONFLIST, &[pods], Some(1380))
            .unwrap()
            .unwrap();
        assert!(
            out.contains(r#""ipam":{"ranges":[[{"subnet":"10.42.3.0/24"}]],"type":"host-local"}"#),
            "{out}"
        );
        assert!(out.contains(r#""mtu":1380"#));
        assert!(
            out.starts_with(
                r#"{"cniVersion":"0.4.0","name":"kilo","plugins":[{"bridge":"kube-bridge""#
            ),
            "keys sorted: {out}"
        );
        assert!(
            !out.contains("portmap\",\"ipam"),
            "plugins without ipam are left alone"
        );
        assert_eq!(
            update_conflist(&out, &[pods], Some(1380)).unwrap(),
            None,
            "already right"
        );
        let moved = update_conflist(&out, &["10.42.9.0/24".parse().unwrap()], Some(1380))
            .unwrap()
            .unwrap();
        assert!(moved.contains("10.42.9.0/24"));
    }

    #[test]
    fn a_dual_stack_node_gets_one_range_set_per_family() {
        let pods: Vec<IpNet> = vec![
            "10.42.3.0/24".parse().unwrap(),
            "fd42:3::/64".parse().unwrap(),
        ];
        let out = update_conflist(KILO_CONFLIST, &pods, None)
            .unwrap()
            .unwrap();
        assert!(
            out.contains(r#""ranges":[[{"subnet":"10.42.3.0/24"}],[{"subnet":"fd42:3::/64"}]]"#),
            "{out}"
        );
        assert_eq!(
            update_conflist(&out, &pods, None).unwrap(),
            None,
            "already right"
        );
        // A single-stack conflist on a node that became dual-stack gains the second set, and
        // back.
        let single = update_conflist(&out, &pods[..1], None).unwrap().unwrap();
        assert!(
            single.contains(r#""ranges":[[{"subnet":"10.42.3.0/24"}]]"#),
            "{single}"
        );
        assert!(update_conflist(&single, &pods, None).unwrap().is_some());
    }

    #[test]
    fn ranges_added_by_hand_to_a_set_are_left_alone() {
        let pods: IpNet = "10.42.3.0/24".parse().unwrap();
        let conf = KILO_CONFLIST.replace(
            r#""ipam": {"type": "host-local"}"#,
            r#""ipam": {"type": "host-local", "ranges": [[{"subnet": "10.42.3.0/24"}, {"subnet": "10.99.0.0/24"}]]}"#,
        );
        assert_ne!(conf, KILO_CONFLIST);
        assert_eq!(update_conflist(&conf, &[pods], None).unwrap(), None);
    }

    #[test]
    fn bad_files_are_errors() {
        let pods: IpNet = "10.42.3.0/24".parse().unwrap();
        assert!(matches!(
            update_conflist("{", &[pods], None),
            Err(CniError::Json(_))
        ));
        assert_eq!(
            update_conflist("{}", &[pods], None),
            Err(CniError::NoPlugins)
        );
    }
}
