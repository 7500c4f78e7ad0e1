//! The IPAM objects kg reads, parsed from the JSON the API server (or a file) holds: Calico's
//! `BlockAffinity` and `IPAMBlock`, Cilium's `CiliumNode`, and a Pod's addresses. Each parse
//! keeps only what [`super::pod_ranges`] needs, and fails with an [`ObjectError`] that names
//! the object and the field, so one malformed object is refused alone.

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::Value;

/// An IPAM object kg could not read, named with its kind, its name and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind} {name:?}: {problem}")]
pub struct ObjectError {
    /// The object's kind (`BlockAffinity`, `IPAMBlock`, `CiliumNode`, `Pod`).
    pub kind: &'static str,
    /// The object's name (`namespace/name` for a Pod).
    pub name: String,
    /// What was wrong, naming the field.
    pub problem: String,
}

/// What a Calico `BlockAffinity` says: `node` holds the block `cidr`, once `confirmed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockAffinity {
    /// The node holding the block (`spec.node`).
    pub node: String,
    /// The block (`spec.cidr`).
    pub cidr: IpNet,
    /// `spec.state` is `confirmed` and `spec.deleted` is not true: the block is the node's.
    pub confirmed: bool,
}

/// What a Calico `IPAMBlock` says of its addresses: which node's pod holds each one given out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpamBlock {
    /// The block (`spec.cidr`).
    pub cidr: IpNet,
    /// The node the block is affine to (`spec.affinity` `host:NAME`), if any.
    pub host: Option<String>,
    /// Each address given out (by its offset in the block) and the node its pod runs on
    /// (`spec.allocations` into `spec.attributes[].secondary.node`).
    pub allocated: Vec<(u32, String)>,
}

impl IpamBlock {
    /// The addresses of this block given out to pods on nodes other than the block's own
    /// (Calico lends them when a node's blocks are full or it may take no more): each with
    /// its node, as a single-address range.
    pub fn borrowed(&self) -> impl Iterator<Item = (&str, IpNet)> + '_ {
        self.allocated
            .iter()
            .filter(|(_, node)| Some(node) != self.host.as_ref())
            .filter_map(|(offset, node)| Some((node.as_str(), nth_address(self.cidr, *offset)?)))
    }
}

/// The `offset`-th address of `cidr`, as a host range (`/32` or `/128`).
fn nth_address(cidr: IpNet, offset: u32) -> Option<IpNet> {
    let size_bits = cidr.max_prefix_len() - cidr.prefix_len();
    if size_bits < 32 && u64::from(offset) >= 1u64 << size_bits {
        return None;
    }
    let addr = match cidr.network() {
        IpAddr::V4(a) => IpAddr::V4((u32::from(a).checked_add(offset)?).into()),
        IpAddr::V6(a) => IpAddr::V6((u128::from(a).checked_add(u128::from(offset))?).into()),
    };
    Some(IpNet::from(addr))
}

/// What a `CiliumNode` says: the pod ranges the node was given (`spec.ipam.podCIDRs`, and in
/// multi-pool mode every pool's `spec.ipam.pools.allocated[].cidrs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CiliumNode {
    /// The node (the object's name).
    pub node: String,
    /// Its pod ranges.
    pub pod_cidrs: Vec<IpNet>,
}

/// A Pod's addresses, where they count: a pod of a node's pod network (not `hostNetwork`) that
/// has not ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodAddresses {
    /// The node it runs on (`spec.nodeName`).
    pub node: String,
    /// Its addresses (`status.podIPs`, or `status.podIP`).
    pub ips: Vec<IpAddr>,
}

fn name_of(object: &Value) -> String {
    let meta = object.get("metadata");
    let name = meta
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("?");
    match meta
        .and_then(|m| m.get("namespace"))
        .and_then(Value::as_str)
    {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

/// Reads the fields of one object, with errors naming it.
struct Reader<'a> {
    kind: &'static str,
    object: &'a Value,
}

impl<'a> Reader<'a> {
    fn error(&self, problem: impl Into<String>) -> ObjectError {
        ObjectError {
            kind: self.kind,
            name: name_of(self.object),
            problem: problem.into(),
        }
    }

    fn at(&self, path: &[&str]) -> Option<&'a Value> {
        path.iter()
            .try_fold(self.object, |v, key| v.get(key))
            .filter(|v| !v.is_null())
    }

    fn string(&self, path: &[&str]) -> Result<&'a str, ObjectError> {
        self.at(path)
            .and_then(Value::as_str)
            .ok_or_else(|| self.error(format!("{} is missing or not a string", path.join("."))))
    }

    fn cidr(&self, field: &str, text: &str) -> Result<IpNet, ObjectError> {
        text.parse::<IpNet>()
            .map(|n| n.trunc())
            .map_err(|_| self.error(format!("{field} {text:?} is not a CIDR")))
    }

    fn cidrs(&self, path: &[&str]) -> Result<Vec<IpNet>, ObjectError> {
        let Some(list) = self.at(path) else {
            return Ok(Vec::new());
        };
        let field = path.join(".");
        let list = list
            .as_array()
            .ok_or_else(|| self.error(format!("{field} is not a list")))?;
        list.iter()
            .map(|v| {
                let text = v
                    .as_str()
                    .ok_or_else(|| self.error(format!("{field} holds {v}, not a CIDR")))?;
                self.cidr(&field, text)
            })
            .collect()
    }
}

/// A Calico `BlockAffinity` (`blockaffinities.crd.projectcalico.org`).
pub fn block_affinity(object: &Value) -> Result<BlockAffinity, ObjectError> {
    let r = Reader {
        kind: "BlockAffinity",
        object,
    };
    let node = r.string(&["spec", "node"])?.to_string();
    let cidr = r.cidr("spec.cidr", r.string(&["spec", "cidr"])?)?;
    let state = r.at(&["spec", "state"]).and_then(Value::as_str);
    // Calico writes `deleted` as the string "true" or "false"; a boolean is taken too.
    let deleted = match r.at(&["spec", "deleted"]) {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => s == "true",
        Some(other) => return Err(r.error(format!("spec.deleted {other} is not true or false"))),
    };
    Ok(BlockAffinity {
        node,
        cidr,
        confirmed: state == Some("confirmed") && !deleted,
    })
}

/// A Calico `IPAMBlock` (`ipamblocks.crd.projectcalico.org`).
pub fn ipam_block(object: &Value) -> Result<IpamBlock, ObjectError> {
    let r = Reader {
        kind: "IPAMBlock",
        object,
    };
    let cidr = r.cidr("spec.cidr", r.string(&["spec", "cidr"])?)?;
    let host = r
        .at(&["spec", "affinity"])
        .and_then(Value::as_str)
        .and_then(|a| a.strip_prefix("host:"))
        .map(str::to_string);
    let attributes = r
        .at(&["spec", "attributes"])
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let mut allocated = Vec::new();
    if let Some(allocations) = r.at(&["spec", "allocations"]) {
        let allocations = allocations
            .as_array()
            .ok_or_else(|| r.error("spec.allocations is not a list"))?;
        for (offset, slot) in allocations.iter().enumerate() {
            let Some(index) = slot.as_u64() else {
                if slot.is_null() {
                    continue;
                }
                return Err(r.error(format!(
                    "spec.allocations[{offset}] is {slot}, not an index"
                )));
            };
            // An address without a node (Calico's own, a tunnel address) routes with its block.
            let node = attributes
                .get(index as usize)
                .and_then(|a| a.get("secondary"))
                .and_then(|s| s.get("node"))
                .and_then(Value::as_str);
            if let (Some(node), Ok(offset)) = (node, u32::try_from(offset)) {
                if nth_address(cidr, offset).is_none() {
                    return Err(r.error(format!(
                        "spec.allocations has {} entries, more than {cidr} holds",
                        allocations.len()
                    )));
                }
                allocated.push((offset, node.to_string()));
            }
        }
    }
    Ok(IpamBlock {
        cidr,
        host,
        allocated,
    })
}

/// A `CiliumNode` (`ciliumnodes.cilium.io`).
pub fn cilium_node(object: &Value) -> Result<CiliumNode, ObjectError> {
    let r = Reader {
        kind: "CiliumNode",
        object,
    };
    let node = r.string(&["metadata", "name"])?.to_string();
    let mut pod_cidrs = r.cidrs(&["spec", "ipam", "podCIDRs"])?;
    if let Some(pools) = r.at(&["spec", "ipam", "pools", "allocated"]) {
        let pools = pools
            .as_array()
            .ok_or_else(|| r.error("spec.ipam.pools.allocated is not a list"))?;
        for (i, pool) in pools.iter().enumerate() {
            let inner = Reader {
                kind: "CiliumNode",
                object: pool,
            };
            let cidrs = inner
                .cidrs(&["cidrs"])
                .map_err(|e| r.error(format!("spec.ipam.pools.allocated[{i}]: {}", e.problem)))?;
            pod_cidrs.extend(cidrs);
        }
    }
    Ok(CiliumNode { node, pod_cidrs })
}

/// A Pod's addresses; `Ok(None)` for a pod whose addresses are not its node's pod network's
/// (`hostNetwork`), one not scheduled yet, or one that ended (`Succeeded`, `Failed`).
pub fn pod_addresses(object: &Value) -> Result<Option<PodAddresses>, ObjectError> {
    let r = Reader {
        kind: "Pod",
        object,
    };
    if r.at(&["spec", "hostNetwork"]).and_then(Value::as_bool) == Some(true) {
        return Ok(None);
    }
    if matches!(
        r.at(&["status", "phase"]).and_then(Value::as_str),
        Some("Succeeded" | "Failed")
    ) {
        return Ok(None);
    }
    let Some(node) = r.at(&["spec", "nodeName"]).and_then(Value::as_str) else {
        return Ok(None);
    };
    let mut texts: Vec<&str> = r
        .at(&["status", "podIPs"])
        .and_then(Value::as_array)
        .map(|ips| {
            ips.iter()
                .filter_map(|ip| ip.get("ip").and_then(Value::as_str))
                .collect()
        })
        .unwrap_or_default();
    if texts.is_empty() {
        texts.extend(r.at(&["status", "podIP"]).and_then(Value::as_str));
    }
    let ips = texts
        .into_iter()
        .map(|t| {
            t.parse::<IpAddr>()
                .map_err(|_| r.error(format!("status.podIPs holds {t:?}, not an address")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(PodAddresses {
        node: node.to_string(),
        ips,
    }))
}
