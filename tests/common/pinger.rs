//! A ping every 100 ms from a namespace, recording when each reply arrives, to measure how long
//! traffic stopped during a failover.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `ping -i 0.1` from a namespace, recording the arrival time of every reply.
pub struct Pinger {
    child: Child,
    replies: Arc<Mutex<Vec<Instant>>>,
    /// The `icmp_seq` of every reply, with its arrival.
    sequence: Arc<Mutex<Vec<(Instant, u32)>>>,
}

impl Pinger {
    pub fn start(ns: &str, target: &str) -> Self {
        Self::spawn(&[
            "netns", "exec", ns, "ping", "-n", "-i", "0.1", "-W", "1", target,
        ])
    }

    /// [`Pinger::start`] from the address `source` (`ping -I`): a pod's address, so that the
    /// echoes can only travel through the mesh, never the underlay.
    #[allow(dead_code)]
    pub fn start_from(ns: &str, source: &str, target: &str) -> Self {
        Self::spawn(&[
            "netns", "exec", ns, "ping", "-n", "-i", "0.1", "-W", "1", "-I", source, target,
        ])
    }

    fn spawn(args: &[&str]) -> Self {
        let mut child = Command::new("ip")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning ping");
        let stdout = child.stdout.take().unwrap();
        let replies = Arc::new(Mutex::new(Vec::new()));
        let sequence = Arc::new(Mutex::new(Vec::new()));
        let (sink, seq_sink) = (Arc::clone(&replies), Arc::clone(&sequence));
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.contains("bytes from") {
                    let now = Instant::now();
                    sink.lock().unwrap().push(now);
                    let seq = line
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("icmp_seq="))
                        .and_then(|n| n.parse::<u32>().ok());
                    if let Some(seq) = seq {
                        seq_sink.lock().unwrap().push((now, seq));
                    }
                }
            }
        });
        Self {
            child,
            replies,
            sequence,
        }
    }

    pub fn replies_since(&self, since: Instant) -> usize {
        self.replies
            .lock()
            .unwrap()
            .iter()
            .filter(|t| **t >= since)
            .count()
    }

    /// How many echoes sent after `since` went unanswered, up to the last reply: the gaps in
    /// the replies' sequence numbers (a ping every 100 ms, so 10 a second).
    #[allow(dead_code)]
    pub fn lost_after(&self, since: Instant) -> usize {
        let sequence = self.sequence.lock().unwrap();
        let mut seqs: Vec<u32> = sequence
            .iter()
            .filter(|(t, _)| *t >= since)
            .map(|(_, s)| *s)
            .collect();
        seqs.sort_unstable();
        seqs.dedup();
        match (seqs.first(), seqs.last()) {
            (Some(first), Some(last)) => (last - first + 1) as usize - seqs.len(),
            _ => 0,
        }
    }

    /// The longest time without a reply after `since`, up to the last reply.
    pub fn longest_gap_after(&self, since: Instant) -> Duration {
        let replies = self.replies.lock().unwrap();
        let mut last = since;
        let mut longest = Duration::ZERO;
        for t in replies.iter().filter(|t| **t >= since) {
            longest = longest.max(t.duration_since(last));
            last = *t;
        }
        longest
    }

    /// When the longest time without a reply after `since` began and ended (the replies on
    /// either side of it).
    pub fn longest_gap_window_after(&self, since: Instant) -> (Instant, Instant) {
        let replies = self.replies.lock().unwrap();
        let mut last = since;
        let mut window = (since, since);
        for t in replies.iter().filter(|t| **t >= since) {
            if t.duration_since(last) > window.1.duration_since(window.0) {
                window = (last, *t);
            }
            last = *t;
        }
        window
    }

    /// Waits until replies flow again (5 in a row within a second) after `since`.
    pub fn wait_flowing(&self, since: Instant, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let replies = self.replies.lock().unwrap();
            let recent = replies
                .iter()
                .filter(|t| **t >= since && t.elapsed() < Duration::from_secs(1))
                .count();
            drop(replies);
            if recent >= 5 && self.longest_gap_after(since) > Duration::ZERO {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
