//! A leader's own judgement of its tunnels: whether they went silent, and so whether to mark
//! its lease cut off.

use super::{LeaseBook, TunnelTraffic};
use crate::leader::{cut_off, hears_any, TrafficSample, CUT_OFF_WINDOW_MS, VERIFY_WINDOW_MS};

impl LeaseBook {
    /// Samples the tunnels' `traffic` at `now_ms` and says whether this leader is cut off
    /// (see [`cut_off`]); once `marked`, until a tunnel hears something again or
    /// [`VERIFY_WINDOW_MS`] passed without a verifier taking over.
    pub(super) fn cut_off_now(
        &mut self,
        traffic: &TunnelTraffic,
        now_ms: i64,
        marked: bool,
    ) -> Mark {
        let (watched, peers) = match traffic {
            TunnelTraffic::NotLeading => {
                self.samples.clear();
                self.marked_since_ms = None;
                self.unverified = None;
                return Mark::Clear;
            }
            TunnelTraffic::Unreadable => return Mark::Clear,
            TunnelTraffic::Read { watched, peers } => (watched, peers),
        };
        let samples = &mut self.samples;
        samples.push_back(TrafficSample {
            at_ms: now_ms,
            peers: peers.clone(),
        });
        while samples.len() > 2
            && samples
                .get(1)
                .is_some_and(|s| now_ms - s.at_ms >= CUT_OFF_WINDOW_MS)
        {
            samples.pop_front();
        }
        let (Some(oldest), Some(newest)) = (samples.front(), samples.back()) else {
            return Mark::Clear;
        };
        let previous = samples.len().checked_sub(2).and_then(|i| samples.get(i));
        let heard = previous.is_some_and(|p| hears_any(p, newest, watched));
        if marked {
            if heard {
                self.marked_since_ms = None;
                return Mark::Clear;
            }
            let since = *self.marked_since_ms.get_or_insert(now_ms);
            if now_ms - since < VERIFY_WINDOW_MS {
                return Mark::CutOff;
            }
            self.marked_since_ms = None;
            self.unverified = Some(watched.clone());
            return Mark::Unverified;
        }
        self.marked_since_ms = None;
        if let Some(unverified) = &self.unverified {
            if !heard && unverified == watched {
                return Mark::Unverified;
            }
            self.unverified = None;
        }
        if cut_off(oldest, newest, watched) {
            Mark::CutOff
        } else {
            Mark::Clear
        }
    }
}

/// What a leader's tunnels say of its lease's cut-off mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mark {
    /// Not cut off (or no way to tell).
    Clear,
    /// Cut off: the lease is (or stays) marked.
    CutOff,
    /// Silent still, but the verifiers reached nothing within [`VERIFY_WINDOW_MS`] of the
    /// mark: no mark until a tunnel hears or the watched tunnels change.
    Unverified,
}
