//! How many leaders each location has (`--leaders-per-location`): the smallest number any
//! node runs with, so that every agent computes the same shares, and one while any node runs
//! Kilo's kg (which publishes none) or an agent without the flag.

use control::journal::Reason;
use control::Node;

use super::Reconciler;

impl Reconciler {
    /// The leaders per location of the topology made of `nodes`: the smallest number any node
    /// publishes (1 for a node that publishes none), this one's as the backend holds it
    /// included, so that every agent and kgctl compute the same; never above this kg's
    /// `--leaders-per-location`. While another node holds it below the flag, says once which.
    pub(super) fn leaders_per_location(&mut self, nodes: &[Node]) -> usize {
        let wanted = self.config.leaders_per_location;
        if wanted <= 1 {
            return 1;
        }
        if self.config.granularity != control::node::Granularity::Location {
            let line = format!(
                "--leaders-per-location={wanted} applies to --mesh-granularity=location; with {} every node leads itself",
                self.config.granularity.as_str()
            );
            for line in self
                .problems
                .fresh_lines("leaders-per-location granularity", vec![line])
            {
                self.journal
                    .record(Reason::LeaderSharesLimited, &self.config.hostname, line);
            }
            return 1;
        }
        let hostname = &self.config.hostname;
        let published = |n: &Node| n.leaders_per_location.unwrap_or(1);
        let effective = control::topology::shares::agreed_leaders_per_location(nodes).min(wanted);
        let holding: Vec<String> = nodes
            .iter()
            .filter(|n| n.name != *hostname && published(n) < wanted && n.older_shares.is_none())
            .map(|n| format!("{} ({})", n.name, published(n)))
            .collect();
        let older: Vec<String> = nodes
            .iter()
            .filter_map(|n| Some(format!("{} ({})", n.name, n.older_shares?)))
            .collect();
        let mut lines = Vec::new();
        if !older.is_empty() {
            lines.push(format!(
                "--leaders-per-location={wanted}: one leader per location, each location's lease holder, while nodes run an earlier kilotun that splits a location into shares otherwise (kilotun.io/leaders-per-location): {}",
                abbreviated(&older)
            ));
        }
        if !holding.is_empty() {
            lines.push(format!(
                "--leaders-per-location={wanted}: {effective} per location until every node runs with {wanted} (kilotun.io/leader-shares; Kilo's kg publishes none, which counts as 1); below it: {}",
                abbreviated(&holding)
            ));
        }
        for line in self.problems.fresh_lines("leaders-per-location", lines) {
            self.journal
                .record(Reason::LeaderSharesLimited, &self.config.hostname, line);
        }
        usize::from(effective)
    }
}

/// `names` joined, the first ten and how many more.
fn abbreviated(names: &[String]) -> String {
    let mut text = names
        .iter()
        .take(10)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > 10 {
        text.push_str(&format!(" and {} more", names.len() - 10));
    }
    text
}
