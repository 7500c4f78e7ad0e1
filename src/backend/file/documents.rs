//! The files' documents: which files hold objects, parsing YAML (several documents) or JSON,
//! flattening `kind: List`, rendering them back, and setting a Node's annotations.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use serde_json::Value;

pub(super) fn is_object_file(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    !hidden && matches!(ext, "yaml" | "yml" | "json")
}

/// How the files' YAML is read: a key given twice in one mapping takes its last value, as a
/// repeated key of a JSON object does, so a node file with an annotation written twice is read
/// (and its annotation judged) rather than refused whole.
pub(super) fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        duplicate_keys: serde_saphyr::DuplicateKeyPolicy::LastWins,
    }
}

/// Parses a file's documents into JSON values (YAML may hold several, separated by `---`).
pub(super) fn parse_documents(path: &Path, text: &str) -> Result<Vec<Value>> {
    if path.extension().and_then(|e| e.to_str()) == Some("json") {
        return Ok(vec![serde_json::from_str(text)?]);
    }
    let docs: Vec<Value> = serde_saphyr::from_multiple_with_options(text, yaml_options())?;
    Ok(docs.into_iter().filter(|doc| !doc.is_null()).collect())
}

/// Walks `value`, flattening `kind: List` (and `NodeList`/`PeerList`) items.
pub(super) fn visit<'v>(value: &'v Value, out: &mut Vec<&'v Value>) {
    match value.get("kind").and_then(Value::as_str) {
        Some(k) if k.ends_with("List") => {
            for item in value
                .get("items")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                visit(item, out);
            }
        }
        _ => out.push(value),
    }
}

pub(super) fn visit_mut<'v>(value: &'v mut Value, out: &mut Vec<&'v mut Value>) {
    let is_list = value
        .get("kind")
        .and_then(Value::as_str)
        .is_some_and(|k| k.ends_with("List"));
    if is_list {
        if let Some(items) = value.get_mut("items").and_then(Value::as_array_mut) {
            for item in items {
                visit_mut(item, out);
            }
        }
    } else {
        out.push(value);
    }
}

pub(super) fn name_of(value: &Value) -> Option<&str> {
    value.get("metadata")?.get("name")?.as_str()
}

pub(super) fn render(path: &Path, docs: &[Value]) -> Result<String> {
    if path.extension().and_then(|e| e.to_str()) == Some("json") {
        return Ok(serde_json::to_string_pretty(&docs[0])? + "\n");
    }
    let mut out = String::new();
    for (i, doc) in docs.iter().enumerate() {
        if i > 0 {
            out.push_str("---\n");
        }
        out.push_str(&serde_saphyr::to_string(doc)?);
    }
    Ok(out)
}

pub(super) fn apply_changes(object: &mut Value, changes: &BTreeMap<String, Option<String>>) {
    let metadata = object
        .as_object_mut()
        .expect("a Node is an object")
        .entry("metadata")
        .or_insert_with(|| Value::Object(Default::default()));
    let annotations = metadata
        .as_object_mut()
        .expect("metadata is an object")
        .entry("annotations")
        .or_insert_with(|| Value::Object(Default::default()));
    if !annotations.is_object() {
        *annotations = Value::Object(Default::default());
    }
    let map = annotations.as_object_mut().expect("just made an object");
    for (key, value) in changes {
        match value {
            Some(v) => {
                map.insert(key.clone(), Value::String(v.clone()));
            }
            None => {
                map.remove(key);
            }
        }
    }
}
