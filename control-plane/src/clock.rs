//! The federation's time: what the leader stamps on each log entry.
//!
//! Time enters the state machine only through these stamps, and the state machine
//! never lets it run backwards. A leader that stamped its own wall clock could, with a
//! clock far ahead (a bad NTP step, a wrong RTC after a reboot), move the federation
//! years forward in one entry; after the clock was fixed, time would stand still
//! until real time caught up, and decay and lease accounting with it.
//!
//! So the leader stamps the **median of the voters' wall clocks**: its own, and the
//! last reading from each other voter (every node asks every voter for its clock once
//! per tick over the Raft port), carried forward by the time elapsed on this node's
//! monotonic clock since. A stamp is made only from a majority of the voters' clocks;
//! until this node has fresh readings from enough of them (the first tick after a
//! start), it stamps nothing new and time stands still, which only makes leases last
//! longer (safe). One wrong clock in a group of three (two of five) never moves the
//! federation's time; each step of it goes at most to where a majority's clocks say.
//!
//! Why not simply bound each step by a constant: a group restarted after an outage must
//! catch up with real time, and catching up in bounded steps runs the federation's
//! clock faster than real time, which would end leases early (unsafe).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use std::sync::atomic::{AtomicU32, Ordering};

use crate::feature::FeatureLevel;
use crate::types::NodeId;

/// A wall clock: Unix milliseconds. Tests give nodes wrong ones.
pub type WallClock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The system's wall clock.
pub fn system_wall_clock() -> WallClock {
    Arc::new(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    })
}

/// A reading older than this is not used: a voter that stopped answering no longer
/// counts towards the median (its clock could have drifted since).
pub const READING_MAX_AGE: Duration = Duration::from_secs(10);

/// A reading whose round trip took longer than this is dropped: its error (half the
/// round trip) would be larger than the clock differences it is meant to catch.
pub const READING_MAX_RTT: Duration = Duration::from_secs(1);

/// The node's own wall clock and its readings of the other voters' clocks.
pub struct TimeKeeper {
    me: NodeId,
    wall: WallClock,
    /// Per node: its wall clock at `Instant` (half the round trip after it answered).
    readings: Mutex<HashMap<NodeId, (u64, Instant)>>,
    /// Per node: the newest feature level it supports, as it said at `Instant`.
    supports: Mutex<HashMap<NodeId, (FeatureLevel, Instant)>>,
    /// The newest feature level this node supports.
    own_feature_max: AtomicU32,
}

impl std::fmt::Debug for TimeKeeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimeKeeper")
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

/// The lower median: the middle value of an odd count; of an even count, the lower of
/// the two middle ones (the smaller time: leases last longer, never shorter).
fn lower_median(mut v: Vec<u64>) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    Some(v[(v.len() - 1) / 2])
}

impl TimeKeeper {
    /// Node `me` with wall clock `wall`.
    pub fn new(me: NodeId, wall: WallClock) -> Self {
        TimeKeeper {
            me,
            wall,
            readings: Mutex::new(HashMap::new()),
            supports: Mutex::new(HashMap::new()),
            own_feature_max: AtomicU32::new(FeatureLevel::NEWEST.get()),
        }
    }

    /// The newest feature level this node supports.
    pub fn own_feature_max(&self) -> FeatureLevel {
        FeatureLevel::new(self.own_feature_max.load(Ordering::Relaxed))
    }

    /// Supports feature levels up to `level` (below [`FeatureLevel::NEWEST`] only when
    /// a test poses as an older build, `ServerConfig::feature_level_max`).
    pub(crate) fn set_own_feature_max(&self, level: FeatureLevel) {
        self.own_feature_max.store(level.get(), Ordering::Relaxed);
    }

    /// Records that node `node` said it supports feature levels up to `max` (0, from a
    /// node that predates feature levels, is level 1).
    pub fn record_support(&self, node: NodeId, max: u32) {
        self.supports
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(node, (FeatureLevel::new(max), Instant::now()));
    }

    /// The newest feature level every one of `members` supports (the leader passes
    /// voters and learners), if this node has heard from each of them within
    /// [`READING_MAX_AGE`] (one silent member, which might be an old build just
    /// restarted, holds the level where it is). A member rolled back to an old build
    /// within that window still counts with its last answer: it then stops, saying so,
    /// when it meets the raise (fail-safe, not divergence).
    pub fn voters_support(&self, voters: &BTreeSet<NodeId>) -> Option<FeatureLevel> {
        let now = Instant::now();
        let supports = self.supports.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut level: Option<FeatureLevel> = None;
        for v in voters {
            let max = if *v == self.me {
                self.own_feature_max()
            } else {
                match supports.get(v) {
                    Some((max, at)) if now.saturating_duration_since(*at) <= READING_MAX_AGE => *max,
                    _ => return None,
                }
            };
            level = Some(level.map_or(max, |l| l.min(max)));
        }
        level
    }

    /// This node's wall clock, Unix milliseconds.
    pub fn wall_ms(&self) -> u64 {
        (self.wall)()
    }

    /// Records node `node`'s answer `wall_ms` to a clock request that took `rtt`.
    pub fn record(&self, node: NodeId, wall_ms: u64, rtt: Duration) {
        if rtt > READING_MAX_RTT {
            return;
        }
        // Its clock read `wall_ms` about half a round trip ago.
        let at = Instant::now().checked_sub(rtt / 2).unwrap_or_else(Instant::now);
        self.readings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(node, (wall_ms, at));
    }

    /// The median of the voters' clocks now, if this node has a reading younger than
    /// [`READING_MAX_AGE`] from enough voters that they, with itself if it votes, are a
    /// majority.
    pub fn quorum_now(&self, voters: &BTreeSet<NodeId>) -> Option<u64> {
        let now = Instant::now();
        let readings = self.readings.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut clocks = Vec::with_capacity(voters.len());
        for v in voters {
            if *v == self.me {
                clocks.push(self.wall_ms());
            } else if let Some((wall, at)) = readings.get(v) {
                let age = now.saturating_duration_since(*at);
                if age <= READING_MAX_AGE {
                    clocks.push(wall.saturating_add(u64::try_from(age.as_millis()).unwrap_or(u64::MAX)));
                }
            }
        }
        if clocks.len() * 2 <= voters.len() {
            return None;
        }
        lower_median(clocks)
    }

    /// The stamp for the next log entry: [`TimeKeeper::quorum_now`], or 0 (time stands
    /// still: the state machine keeps its clock) until there is one.
    pub fn stamp(&self, voters: &BTreeSet<NodeId>) -> u64 {
        self.quorum_now(voters).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(ms: u64) -> WallClock {
        Arc::new(move || ms)
    }

    #[test]
    fn the_median_of_three_ignores_one_wrong_clock_either_way() {
        let voters: BTreeSet<NodeId> = [1, 2, 3].into();
        let year = 365 * 24 * 3_600_000u64;
        // This node's clock is a year ahead; the others agree.
        let t = TimeKeeper::new(1, fixed(1_000_000 + year));
        assert_eq!(t.quorum_now(&voters), None, "no readings yet: no majority");
        assert_eq!(t.stamp(&voters), 0, "time stands still");
        t.record(2, 1_000_000, Duration::ZERO);
        let q = t.quorum_now(&voters).expect("itself and node 2 are a majority");
        // Two clocks: the lower median is node 2's (carried forward a few ms at most).
        assert!((1_000_000..1_000_100).contains(&q), "{q}");
        t.record(3, 1_000_050, Duration::ZERO);
        let q = t.quorum_now(&voters).expect("three");
        assert!((1_000_050..1_000_150).contains(&q), "{q}");
        // A clock a year behind is outvoted as well.
        let real = 2 * year;
        let t = TimeKeeper::new(1, fixed(real - year));
        t.record(2, real, Duration::ZERO);
        t.record(3, real, Duration::ZERO);
        let q = t.quorum_now(&voters).expect("three");
        assert!((real..real + 100).contains(&q), "{q}");
    }

    #[test]
    fn stale_slow_and_absent_readings_do_not_count() {
        let voters: BTreeSet<NodeId> = [1, 2, 3, 4, 5].into();
        let t = TimeKeeper::new(1, fixed(10_000));
        t.record(2, 10_000, Duration::ZERO);
        assert_eq!(t.quorum_now(&voters), None, "two of five");
        t.record(3, 10_000, READING_MAX_RTT + Duration::from_millis(1));
        assert_eq!(t.quorum_now(&voters), None, "a slow answer does not count");
        t.record(3, 10_000, Duration::from_millis(2));
        assert!(t.quorum_now(&voters).is_some(), "three of five");
        // A single-node group needs only itself.
        assert_eq!(TimeKeeper::new(7, fixed(42)).quorum_now(&[7].into()), Some(42));
        // A node outside the voters (a learner) needs a majority of the voters.
        assert_eq!(TimeKeeper::new(9, fixed(42)).quorum_now(&[1, 2, 3].into()), None);
    }

    #[test]
    fn lower_median_takes_the_smaller_middle() {
        assert_eq!(lower_median(vec![]), None);
        assert_eq!(lower_median(vec![5]), Some(5));
        assert_eq!(lower_median(vec![9, 1]), Some(1));
        assert_eq!(lower_median(vec![3, 100, 1]), Some(3));
        assert_eq!(lower_median(vec![4, 1, 3, 2]), Some(2));
    }
}
