//! The standard `process_*` series (CPU, memory, file descriptors, start time) of this
//! process, read from `/proc` at each scrape, as the Prometheus client libraries export them.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

use super::encode_one;

/// The standard `process_*` series of this process, read from `/proc` at each scrape.
#[derive(Debug, Default)]
pub struct ProcessCollector;

/// This process's figures from `/proc`.
#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    cpu_seconds: f64,
    start_time_seconds: f64,
    virtual_memory_bytes: u64,
    resident_memory_bytes: u64,
    open_fds: u64,
    max_fds: u64,
}

/// Parses `/proc/self/stat` (fields after the parenthesised command name, which may contain
/// spaces) with the boot time from `/proc/stat`.
fn parse_stat(stat: &str, boot_time: u64, ticks: f64, page_size: u64) -> Option<ProcessStats> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is index 0 here: utime is field 14, stime 15, starttime 22, vsize 23,
    // rss 24 (proc(5)).
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(ProcessStats {
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
        start_time_seconds: boot_time as f64 + field(22)? as f64 / ticks,
        virtual_memory_bytes: field(23)?,
        resident_memory_bytes: field(24)? * page_size,
        open_fds: 0,
        max_fds: 0,
    })
}

impl ProcessStats {
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot_time = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
        // SAFETY: sysconf and getrlimit only read process-wide settings into local values.
        let (ticks, page_size, limit) = unsafe {
            let mut limit: libc::rlimit = std::mem::zeroed();
            let got = libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
                (got == 0).then_some(limit.rlim_cur),
            )
        };
        if ticks <= 0 || page_size <= 0 {
            return None;
        }
        let mut stats = parse_stat(&stat, boot_time, ticks as f64, page_size as u64)?;
        stats.open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        stats.max_fds = limit.unwrap_or(0);
        Some(stats)
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(s) = ProcessStats::read() else {
            return Ok(());
        };
        encode_one(
            &mut encoder,
            "process_cpu",
            "Total user and system CPU time spent in seconds.",
            Some(&Unit::Seconds),
            &ConstCounter::new(s.cpu_seconds),
        )?;
        encode_one(
            &mut encoder,
            "process_open_fds",
            "Number of open file descriptors.",
            None,
            &ConstGauge::new(s.open_fds as i64),
        )?;
        encode_one(
            &mut encoder,
            "process_max_fds",
            "Maximum number of open file descriptors.",
            None,
            &ConstGauge::new(s.max_fds as i64),
        )?;
        encode_one(
            &mut encoder,
            "process_virtual_memory",
            "Virtual memory size in bytes.",
            Some(&Unit::Bytes),
            &ConstGauge::new(s.virtual_memory_bytes as i64),
        )?;
        encode_one(
            &mut encoder,
            "process_resident_memory",
            "Resident memory size in bytes.",
            Some(&Unit::Bytes),
            &ConstGauge::new(s.resident_memory_bytes as i64),
        )?;
        encode_one(
            &mut encoder,
            "process_start_time",
            "Start time of the process since the Unix epoch in seconds.",
            Some(&Unit::Seconds),
            &ConstGauge::new(s.start_time_seconds),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_is_parsed_past_a_command_with_spaces() {
        let stat = "4242 (kg (a b)) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 150 0 0 20 0 9 0 5000 123456789 300 18446744073709551615 0";
        let s = parse_stat(stat, 1_000_000, 100.0, 4096).unwrap();
        assert_eq!(s.cpu_seconds, 4.0);
        assert_eq!(s.start_time_seconds, 1_000_050.0);
        assert_eq!(s.virtual_memory_bytes, 123_456_789);
        assert_eq!(s.resident_memory_bytes, 300 * 4096);
        assert!(parse_stat("4242 (kg) S 1", 0, 100.0, 4096).is_none());
        let live = ProcessStats::read().unwrap();
        assert!(live.resident_memory_bytes > 0 && live.open_fds > 0 && live.max_fds > 0);
        assert!(live.start_time_seconds > 1_600_000_000.0, "{live:?}");
    }
}
