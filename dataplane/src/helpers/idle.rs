//! Whether helpers have idle cores to run on: the machine's CPU time from `/proc/stat`, judged
//! between two readings (pure: the device's timer thread reads the file).

use std::time::Duration;

/// The machine's CPU time so far, idle and in total, as the first line of `/proc/stat` counts it
/// (in the kernel's clock ticks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuTimes {
    /// Time no core had work: `idle` plus `iowait`.
    pub idle: u64,
    /// All time counted, over every core.
    pub total: u64,
    /// The cores counted (`cpuN` lines).
    pub cores: usize,
}

impl CpuTimes {
    /// Reads the `cpu` line of `/proc/stat`'s text; `None` if it has none.
    pub fn parse(proc_stat: &str) -> Option<Self> {
        let line = proc_stat.lines().find(|l| l.starts_with("cpu "))?;
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal (guest time is inside user already).
        let counted = &fields[..fields.len().min(8)];
        let cores = proc_stat
            .lines()
            .filter(|l| l.starts_with("cpu") && l[3..].starts_with(|c: char| c.is_ascii_digit()))
            .count();
        Some(Self {
            idle: fields.get(3)? + fields.get(4).copied().unwrap_or(0),
            total: counted.iter().sum(),
            cores: cores.max(1),
        })
    }
}

/// Whether helpers have idle cores to run on, judged between two readings of the machine's
/// CPU time. Spreading a batch pays only when a helper runs on a core that would otherwise be
/// idle; on a machine whose cores are all busy (both ends of a transfer and its programs on two
/// cores, say) it only adds context switches, and measured end to end that cost up to a quarter
/// of the throughput. So the helpers stay open while the cores left idle, plus the time the
/// helpers themselves ran (which would be idle without them), come to half a core or more.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdleCores {
    last: Option<CpuTimes>,
    last_busy: Duration,
}

/// The idle share of a core below which helpers are closed.
const MIN_IDLE_CORES: f64 = 0.5;

impl IdleCores {
    /// Takes a reading: the machine's CPU times and the helpers' [`Helpers::busy`](super::Helpers::busy) time.
    /// Returns whether helpers should be open until the next reading (`None` on the first, or
    /// when no time passed). `/proc/stat` counts 100 ticks a second on every core.
    pub fn judge(&mut self, now: CpuTimes, helpers_busy: Duration) -> Option<bool> {
        let cores = now.cores;
        let last = self.last.replace(now)?;
        let busy =
            helpers_busy.saturating_sub(std::mem::replace(&mut self.last_busy, helpers_busy));
        let total = now.total.checked_sub(last.total).filter(|&t| t > 0)?;
        let idle = now.idle.saturating_sub(last.idle) as f64 / total as f64;
        // The interval in seconds, from the ticks every core counted (100 a second).
        let seconds = total as f64 / cores.max(1) as f64 / 100.0;
        let helped = busy.as_secs_f64() / seconds.max(1e-3);
        Some(idle * cores as f64 + helped >= MIN_IDLE_CORES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_gives_idle_and_total_time() {
        let text = "cpu  100 5 50 800 20 3 7 15 0 0\ncpu0 50 2 25 400 10 1 3 7 0 0\n";
        let times = CpuTimes::parse(text).unwrap();
        assert_eq!(
            times,
            CpuTimes {
                idle: 820,
                total: 1000,
                cores: 1
            }
        );
        assert_eq!(CpuTimes::parse("intr 1 2 3\n"), None);
        assert_eq!(CpuTimes::parse("cpu  1 2 x\n"), None);
    }

    #[test]
    fn helpers_stay_open_only_while_cores_are_left_idle() {
        let mut gate = IdleCores::default();
        let at = |idle, total| CpuTimes {
            idle,
            total,
            cores: 2,
        };
        // 2 cores, 250 ms a reading: 50 ticks in all.
        assert_eq!(gate.judge(at(0, 0), Duration::ZERO), None, "first reading");
        // A core and a half idle: open.
        assert_eq!(gate.judge(at(38, 50), Duration::ZERO), Some(true));
        // Both cores busy (a quarter of a core idle), helpers idle: closed.
        assert_eq!(gate.judge(at(44, 100), Duration::ZERO), Some(false));
        // Busy cores, but 200 ms of them were the helpers' own: they used an idle core. Open.
        let busy = Duration::from_millis(200);
        assert_eq!(gate.judge(at(47, 150), busy), Some(true));
        // The helpers ran only 20 ms more and the cores were busy: closed.
        assert_eq!(
            gate.judge(at(50, 200), busy + Duration::from_millis(20)),
            Some(false)
        );
        // No time passed: no judgement.
        assert_eq!(gate.judge(at(50, 200), busy), None);
    }
}
