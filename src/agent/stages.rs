//! Where one reconcile's time went, stage by stage: the backend's objects translated into the
//! node table, the host listed (resyncs and kernel notifications only), the leases, the
//! topology, then the host's routes (with the links and tunnel they need), the engine and the
//! firewall. A reconcile that reached the topology says so in one debug line on target
//! `kilotun::stages` (with the Unix time it started, so a benchmark can tell how long the
//! watch took to bring the change, and its whole wall time, DNS and the annotation patch
//! included) and in the histogram `kilotun_reconcile_stage_seconds`, which counts only the
//! stages that ran; check-in churn, which stops at the table, says nothing.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A timed stage of the reconcile pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Changed Nodes and Peers translated into the node table.
    Translate,
    /// The host's links, addresses, routes and rules listed (a full reconcile only).
    Host,
    /// Leaders elected from the leases.
    Leases,
    /// The topology computed and compared with the last one.
    Topology,
    /// Links, addresses, the tunnel and the routes brought to the topology.
    Routes,
    /// The WireGuard device's configuration.
    Engine,
    /// iptables or nftables.
    Firewall,
}

impl Stage {
    /// Every stage, in pipeline order.
    pub const ALL: [Stage; 7] = [
        Stage::Translate,
        Stage::Host,
        Stage::Leases,
        Stage::Topology,
        Stage::Routes,
        Stage::Engine,
        Stage::Firewall,
    ];

    /// The stage's name in logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Translate => "translate",
            Stage::Host => "host",
            Stage::Leases => "leases",
            Stage::Topology => "topology",
            Stage::Routes => "routes",
            Stage::Engine => "engine",
            Stage::Firewall => "firewall",
        }
    }
}

/// The time one reconcile spent in each stage (`None` where it did not go).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StageTimes {
    spent: [Option<Duration>; Stage::ALL.len()],
    /// True once the reconcile computed a topology.
    pub meshed: bool,
}

impl StageTimes {
    /// Adds `spent` to `stage`.
    pub fn add(&mut self, stage: Stage, spent: Duration) {
        let slot = &mut self.spent[stage as usize];
        *slot = Some(slot.unwrap_or_default() + spent);
        self.meshed |= stage == Stage::Topology;
    }

    /// The time spent in `stage`, if it ran.
    pub fn get(&self, stage: Stage) -> Option<Duration> {
        self.spent[stage as usize]
    }

    /// The time spent in all stages.
    pub fn total(&self) -> Duration {
        self.spent.iter().flatten().sum()
    }
}

/// Times the current reconcile: started by [`StageClock::begin`], filled in by the stages.
#[derive(Debug, Clone, Copy)]
pub struct StageClock {
    started: Instant,
    started_unix_ms: i64,
    /// The stages so far.
    pub times: StageTimes,
}

impl Default for StageClock {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            started_unix_ms: 0,
            times: StageTimes::default(),
        }
    }
}

impl StageClock {
    /// Starts timing a new reconcile.
    pub fn begin(&mut self) {
        self.started = Instant::now();
        self.started_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        self.times = StageTimes::default();
    }

    /// Adds the time since `since` to `stage`.
    pub fn lap(&mut self, stage: Stage, since: Instant) {
        self.times.add(stage, since.elapsed());
    }

    /// Says where the reconcile's time went, if it reached the topology: one debug line (a
    /// stage that did not run shows 0) and an observation in `metrics` for each stage that
    /// ran. `ok` is false when the reconcile failed. Returns the times said.
    pub fn finish(
        &self,
        trigger: super::Trigger,
        ok: bool,
        metrics: &super::serve::metrics::Metrics,
    ) -> Option<StageTimes> {
        if !self.times.meshed {
            return None;
        }
        for stage in Stage::ALL {
            if let Some(spent) = self.times.get(stage) {
                metrics.observe_stage(stage.name(), spent.as_secs_f64());
            }
        }
        let ms = |s: Stage| self.times.get(s).unwrap_or_default().as_secs_f64() * 1000.0;
        tracing::debug!(
            target: "kilotun::stages",
            ?trigger,
            ok,
            started_unix_ms = self.started_unix_ms,
            translate_ms = ms(Stage::Translate),
            host_ms = ms(Stage::Host),
            leases_ms = ms(Stage::Leases),
            topology_ms = ms(Stage::Topology),
            routes_ms = ms(Stage::Routes),
            engine_ms = ms(Stage::Engine),
            firewall_ms = ms(Stage::Firewall),
            wall_ms = self.started.elapsed().as_secs_f64() * 1000.0,
            "reconcile stages"
        );
        Some(self.times)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::serve::metrics::{Format, Metrics};
    use crate::agent::Trigger;

    #[test]
    fn times_add_up_per_stage_and_only_a_topology_counts_as_meshed() {
        let mut t = StageTimes::default();
        t.add(Stage::Translate, Duration::from_millis(2));
        assert!(!t.meshed, "check-in churn stops at the table");
        t.add(Stage::Topology, Duration::from_millis(5));
        t.add(Stage::Routes, Duration::from_millis(3));
        t.add(Stage::Routes, Duration::from_millis(4));
        assert!(t.meshed);
        assert_eq!(t.get(Stage::Routes), Some(Duration::from_millis(7)));
        assert_eq!(t.get(Stage::Engine), None, "did not run");
        assert_eq!(t.total(), Duration::from_millis(14));
        let names: Vec<_> = Stage::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(
            names,
            [
                "translate",
                "host",
                "leases",
                "topology",
                "routes",
                "engine",
                "firewall"
            ]
        );
    }

    #[test]
    fn only_a_reconcile_that_meshed_is_reported_and_only_the_stages_that_ran() {
        let mut clock = StageClock::default();
        clock.begin();
        clock.lap(Stage::Translate, Instant::now());
        let metrics = Metrics::new();
        assert!(clock.finish(Trigger::CheckIn, true, &metrics).is_none());
        let scraped = || metrics.render(None, Format::Text);
        assert!(!scraped().contains("kilotun_reconcile_stage_seconds_count{"));
        clock.lap(Stage::Topology, Instant::now());
        clock.lap(Stage::Routes, Instant::now());
        assert!(clock.finish(Trigger::Event, true, &metrics).is_some());
        let text = scraped();
        for stage in ["translate", "topology", "routes"] {
            let count = format!("kilotun_reconcile_stage_seconds_count{{stage=\"{stage}\"}} 1");
            assert!(text.contains(&count), "{count}:\n{text}");
        }
        assert!(
            !text.contains("stage=\"engine\""),
            "a stage that did not run is not observed:\n{text}"
        );
    }
}
