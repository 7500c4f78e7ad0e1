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
/// spaces) with the boot time from `/proc/stat`: CPU time and start time. Memory comes from
/// `/proc/self/statm` ([`parse_statm`]).
fn parse_stat(stat: &str, boot_time: u64, ticks: f64) -> Option<ProcessStats> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is index 0 here: utime is field 14, stime 15, starttime 22 (proc(5)).
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(ProcessStats {
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
        start_time_seconds: boot_time as f64 + field(22)? as f64 / ticks,
        ..ProcessStats::default()
    })
}

/// Parses `/proc/self/statm`: the virtual and resident sizes, in bytes. The kernel derives them
/// from the same counters as `/proc/self/stat`'s vsize and rss (in pages here); unlike `stat`,
/// qemu-user passes `statm` through from the host instead of writing zeros into it, so the
/// figures stay right for an agent run under emulation (a foreign-architecture image through
/// binfmt_misc).
fn parse_statm(statm: &str, page_size: u64) -> Option<(u64, u64)> {
    let mut pages = statm.split_whitespace().map(|v| v.parse::<u64>().ok());
    let size = pages.next()??.checked_mul(page_size)?;
    let resident = pages.next()??.checked_mul(page_size)?;
    Some((size, resident))
}

/// The soft limit on open files from `/proc/self/limits` (`Max open files  1024  524288  files`),
/// `u64::MAX` for `unlimited`. Read there rather than with getrlimit, whose `rlim_t` is 32 bits
/// on 32-bit ARM.
fn parse_max_files(limits: &str) -> Option<u64> {
    let rest = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    match rest.split_whitespace().next()? {
        "unlimited" => Some(u64::MAX),
        soft => soft.parse().ok(),
    }
}

/// A gauge's value: saturated at `i64::MAX` (an unlimited limit) instead of wrapping negative.
fn gauge_value(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl ProcessStats {
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot_time = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
        // SAFETY: sysconf only reads process-wide settings.
        let (ticks, page_size) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        if ticks <= 0 || page_size <= 0 {
            return None;
        }
        let mut stats = parse_stat(&stat, boot_time, ticks as f64)?;
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        (stats.virtual_memory_bytes, stats.resident_memory_bytes) =
            parse_statm(&statm, page_size as u64)?;
        stats.open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        stats.max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .as_deref()
            .and_then(parse_max_files)
            .unwrap_or(0);
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
            &ConstGauge::new(gauge_value(s.open_fds)),
        )?;
        encode_one(
            &mut encoder,
            "process_max_fds",
            "Maximum number of open file descriptors.",
            None,
            &ConstGauge::new(gauge_value(s.max_fds)),
        )?;
        encode_one(
            &mut encoder,
            "process_virtual_memory",
            "Virtual memory size in bytes.",
            Some(&Unit::Bytes),
            &ConstGauge::new(gauge_value(s.virtual_memory_bytes)),
        )?;
        encode_one(
            &mut encoder,
            "process_resident_memory",
            "Resident memory size in bytes.",
            Some(&Unit::Bytes),
            &ConstGauge::new(gauge_value(s.resident_memory_bytes)),
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
        let s = parse_stat(stat, 1_000_000, 100.0).unwrap();
        assert_eq!(s.cpu_seconds, 4.0);
        assert_eq!(s.start_time_seconds, 1_000_050.0);
        assert!(parse_stat("4242 (kg) S 1", 0, 100.0).is_none());
        assert_eq!(
            parse_statm("30141 300 250 1 0 2000 0\n", 4096),
            Some((30_141 * 4096, 300 * 4096))
        );
        // Past 4 GiB (a 32-bit usize would wrap; these are u64).
        assert_eq!(
            parse_statm("2000000 1500000 0 0 0 0 0", 4096),
            Some((8_192_000_000, 6_144_000_000))
        );
        assert!(parse_statm("12", 4096).is_none());
        let limits =
            "Limit                     Soft Limit           Hard Limit           Units     \n\
            Max cpu time              unlimited            unlimited            seconds   \n\
            Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_files(limits), Some(1024));
        assert_eq!(
            parse_max_files(&limits.replace("1024 ", "unlimited")),
            Some(u64::MAX)
        );
        assert_eq!(parse_max_files("Max processes 10 10 processes\n"), None);
        assert_eq!(
            gauge_value(u64::MAX),
            i64::MAX,
            "unlimited saturates instead of wrapping to -1"
        );
        let live = ProcessStats::read().unwrap();
        assert!(live.resident_memory_bytes > 0 && live.open_fds > 0 && live.max_fds > 0);
        assert!(live.start_time_seconds > 1_600_000_000.0, "{live:?}");
    }
}
