//! The routes and rules kg installed, saved as `<key-file>.routes` (one per line) after each
//! change, and read back at start as what kg owns: a kg restarted with other settings (another
//! granularity, `--ipip`, `--encapsulate`) after a run with `--clean-up=false` removes what its
//! last run installed and no longer wants, and never claims a route it did not install.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use control::routes::{Route, RoutePlan, Rule};
use ipnet::IpNet;

/// Where the routes of the kg using `key_file` live.
fn path(key_file: &Path) -> PathBuf {
    crate::agent::shells::keyfile::beside(key_file, ".routes")
}

fn or_dash<T: ToString>(value: &Option<T>) -> String {
    value.as_ref().map_or_else(|| "-".into(), T::to_string)
}

/// `plan`'s routes and rules as lines.
fn render(plan: &RoutePlan) -> String {
    let mut text = String::new();
    for r in &plan.routes {
        text += &format!(
            "route {} {} {} {} {} {}\n",
            r.table,
            r.dst,
            or_dash(&r.gateway),
            r.link,
            or_dash(&r.src),
            u8::from(r.onlink)
        );
    }
    for r in &plan.rules {
        if let Some(g) = r.guard {
            let family = if g.ipv6 { 6 } else { 4 };
            text += &format!("guard {} {:#x} {family} {}\n", g.priority, g.mark, r.table);
            continue;
        }
        text += &format!(
            "rule {} {} {} {}\n",
            or_dash(&r.src),
            or_dash(&r.dst),
            or_dash(&r.iif),
            r.table
        );
    }
    text
}

fn optional<T: std::str::FromStr>(word: &str) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    if word == "-" {
        return Ok(None);
    }
    word.parse()
        .map(Some)
        .map_err(|e| anyhow::anyhow!("{word:?}: {e}"))
}

fn parse(text: &str) -> Result<RoutePlan> {
    let mut plan = RoutePlan::default();
    for (number, line) in text.lines().enumerate() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let parsed: Result<()> = (|| {
            match words.as_slice() {
                ["route", table, dst, gateway, link, src, onlink] => {
                    plan.routes.insert(Route {
                        table: table.parse()?,
                        dst: dst.parse::<IpNet>()?,
                        gateway: optional::<IpAddr>(gateway)?,
                        link: link.parse()?,
                        src: optional::<IpAddr>(src)?,
                        onlink: *onlink == "1",
                    });
                }
                ["rule", src, dst, iif, table] => {
                    plan.rules.insert(Rule {
                        src: optional::<IpNet>(src)?,
                        dst: optional::<IpNet>(dst)?,
                        iif: optional::<String>(iif)?,
                        table: table.parse()?,
                        guard: None,
                    });
                }
                ["guard", priority, mark, family, table] => {
                    let mark = mark.strip_prefix("0x").unwrap_or(mark);
                    let ipv6 = match *family {
                        "4" => false,
                        "6" => true,
                        other => bail!("{other:?} is not a family (4 or 6)"),
                    };
                    plan.rules.insert(Rule::guard(
                        priority.parse()?,
                        u32::from_str_radix(mark, 16)?,
                        ipv6,
                        table.parse()?,
                    ));
                }
                [] => {}
                _ => bail!("not a route or rule"),
            }
            Ok(())
        })();
        parsed.with_context(|| format!("line {}: {line:?}", number + 1))?;
    }
    Ok(plan)
}

/// Saves `plan`'s routes and rules (mode 0600).
pub fn save_routes(key_file: &Path, plan: &RoutePlan) -> Result<()> {
    super::super::write_file(&path(key_file), &render(plan), 0o600)
}

/// The routes and rules the last run saved; none when it saved nothing.
pub fn load_routes(key_file: &Path) -> Result<RoutePlan> {
    let path = path(key_file);
    match std::fs::read_to_string(&path) {
        Ok(text) => parse(&text).with_context(|| format!("reading {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(RoutePlan::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_and_rules_round_trip_and_bad_lines_are_named() {
        let mut plan = RoutePlan::default();
        plan.routes.insert(Route {
            table: 254,
            dst: "10.42.3.0/24".parse().unwrap(),
            gateway: Some("192.168.20.3".parse().unwrap()),
            link: 7,
            src: None,
            onlink: true,
        });
        plan.routes.insert(Route {
            table: 1107,
            dst: "fd00::/64".parse().unwrap(),
            gateway: None,
            link: 9,
            src: Some("fd00::1".parse().unwrap()),
            onlink: false,
        });
        plan.rules.insert(Rule {
            src: Some("10.42.1.0/24".parse().unwrap()),
            dst: None,
            iif: Some("kilo0".into()),
            table: 1107,
            guard: None,
        });
        plan.rules.insert(Rule::guard(1100, 0x1000, true, 1108));
        plan.rules.insert(Rule::guard(1101, 0x1000, false, 0));
        let text = render(&plan);
        assert!(text.contains("guard 1100 0x1000 6 1108\n"), "{text}");
        assert_eq!(parse(&text).unwrap(), plan);
        let e = parse("route 254 banana - 7 - 1\n").unwrap_err();
        assert!(format!("{e:#}").starts_with("line 1: "), "{e:#}");
    }
}
