//! Report windows: two agent replicas take turns reporting one cluster's usage. The one
//! taking over reports what it metered while standing by since before the other's last
//! report, and the federation counts no stretch of time twice (the covered part of a
//! window is cut pro rata), while back-to-back windows are counted in full.

mod common;

use kvota_fairness::federation::{
    Applied, Command, Federation, TenantReport, UsageReport, UsageWindow, MAX_WINDOW_AHEAD_MS,
};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::showback::GroupBy;
use proptest::prelude::*;

/// 4 GPUs of training, all the time: 4,000 milli-GPUe per ms.
const RATE: u64 = 4_000;

use common::east_federation as federation;

fn report(seq: u64, epoch: u64, used: u64, window: Option<(u64, u64)>) -> Command {
    let tenants = [(
        TenantName::from_static("training"),
        TenantReport {
            used_milli_gpue_ms: used,
            inuse: 4_000,
            pending: 0,
            largest: 0,
            borrowed: 0,
        },
    )]
    .into();
    Command::Report(UsageReport {
        cluster: ClusterName::from_static("east"),
        seq,
        held_epoch: epoch,
        capacity: None,
        tenants,
        evictions: Vec::new(),
        decisions: Vec::new(),
        window: window.map(|(start_ms, end_ms)| UsageWindow { start_ms, end_ms }),
        status: None,
    })
}

fn counted(fed: &Federation) -> u64 {
    fed.ledger()
        .entries()
        .get("training")
        .map_or(0, |u| u.value_milli_gpue_ms)
}

/// The control plane's clock when the reports arrive: after every window's end.
const NOW: u64 = 1_000_000;

/// Applies every report at the same instant (so the ledger decays nothing).
fn apply(fed: &mut Federation, cmd: Command) {
    match fed.apply(NOW, cmd) {
        Ok(Applied::Reported { applied: true, .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn uncovered_cuts_the_covered_part_pro_rata() {
    let w = UsageWindow {
        start_ms: 1_000,
        end_ms: 2_000,
    };
    assert_eq!(w.uncovered(10_000, None), 10_000, "nothing counted yet");
    assert_eq!(w.uncovered(10_000, Some(1_000)), 10_000, "back to back");
    assert_eq!(w.uncovered(10_000, Some(500)), 10_000, "starts after");
    assert_eq!(w.uncovered(10_000, Some(1_250)), 7_500, "a quarter already counted");
    assert_eq!(w.uncovered(10_000, Some(2_000)), 0, "all counted");
    assert_eq!(w.uncovered(10_000, Some(9_000)), 0, "all counted, long ago");
    // A clock stepped back: the window is empty or reversed; counted unless it ends by
    // what is counted already.
    assert_eq!(
        UsageWindow {
            start_ms: 3_000,
            end_ms: 2_500
        }
        .uncovered(10_000, Some(2_000)),
        10_000
    );
    assert_eq!(
        UsageWindow {
            start_ms: 3_000,
            end_ms: 1_500
        }
        .uncovered(10_000, Some(2_000)),
        0
    );
    // No overflow at the extremes.
    assert_eq!(
        UsageWindow {
            start_ms: 0,
            end_ms: u64::MAX
        }
        .uncovered(u64::MAX, Some(u64::MAX / 2)),
        u64::MAX / 2 + 1
    );
}

#[test]
fn a_takeover_report_counts_only_what_the_old_leader_did_not() {
    let (mut fed, epoch) = federation();
    fed.enable_records();
    // The old leader: two back-to-back windows, 0-10 s and 10-20 s.
    apply(&mut fed, report(1, epoch, RATE * 10_000, Some((0, 10_000))));
    apply(&mut fed, report(2, epoch, RATE * 10_000, Some((10_000, 20_000))));
    assert_eq!(counted(&fed), RATE * 20_000);
    assert_eq!(fed.clusters()["east"].reported_through_ms, Some(20_000));
    // It dies at 27 s; the standby takes over at 35 s and reports from its reading at
    // 15 s (its latest before 20 s): 15-35 s, of which 20-35 s is new.
    apply(&mut fed, report(3, epoch, RATE * 20_000, Some((15_000, 35_000))));
    assert_eq!(
        counted(&fed),
        RATE * 35_000,
        "the 20-35 s gap is counted, 15-20 s is not counted twice"
    );
    // A late report from the old leader (written at 26 s, sent after it came back) covers
    // nothing new.
    apply(&mut fed, report(4, epoch, RATE * 6_000, Some((20_000, 26_000))));
    assert_eq!(counted(&fed), RATE * 35_000);
    assert_eq!(
        fed.clusters()["east"].reported_through_ms,
        Some(35_000),
        "never moves back"
    );
    // Reports without a window (older agents) count in full and move nothing.
    apply(&mut fed, report(5, epoch, 7, None));
    assert_eq!(counted(&fed), RATE * 35_000 + 7);
    assert_eq!(fed.clusters()["east"].reported_through_ms, Some(35_000));
    // An agent whose clock runs far ahead: its window is not trusted (else every later
    // report would count nothing); the usage counts in full.
    let ahead = NOW + MAX_WINDOW_AHEAD_MS + 1;
    apply(&mut fed, report(6, epoch, 11, Some((ahead - 1_000, ahead))));
    assert_eq!(counted(&fed), RATE * 35_000 + 18);
    assert_eq!(fed.clusters()["east"].reported_through_ms, Some(35_000));
    apply(&mut fed, report(7, epoch, RATE * 1_000, Some((35_000, 36_000))));
    assert_eq!(counted(&fed), RATE * 36_000 + 18, "later reports still count");
    // The showback: the same amounts, by tenant and cluster.
    let rows = fed.showback().expect("kept").query(
        0,
        u64::MAX,
        GroupBy {
            tenant: true,
            cluster: true,
        },
    );
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].tenant.as_deref(), rows[0].cluster.as_deref()),
        (Some("training"), Some("east"))
    );
    assert_eq!(rows[0].milli_gpue_ms, u128::from(RATE * 36_000 + 18));
}

#[test]
fn showback_is_kept_only_once_turned_on_and_a_late_report_lands_in_its_own_hour() {
    const H: u64 = kvota_fairness::showback::HOUR_MS;
    let (mut fed, epoch) = federation();
    apply(&mut fed, report(1, epoch, 5, Some((0, 1_000))));
    assert!(fed.showback().is_none(), "off until the control plane turns it on");
    fed.enable_records();
    // Reported at NOW (in hour 0), but metered in hour 0 and in hours 0 to 2 on the
    // agent's clock... which must not run ahead of the control plane's: only windows
    // ending by NOW + MAX_WINDOW_AHEAD_MS are taken as windows.
    let now = 3 * H;
    for (seq, (s, e)) in [(2, (H / 2, H / 2 + 10)), (3, (2 * H - 10, 2 * H + 10))] {
        match fed.apply(now, report(seq, epoch, 20, Some((s, e)))) {
            Ok(Applied::Reported { applied: true, .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    let sb = fed.showback().expect("kept");
    let hour = |h: u64| {
        sb.query(h * H, (h + 1) * H, GroupBy::default())
            .first()
            .map_or(0, |r| r.milli_gpue_ms)
    };
    assert_eq!(
        (hour(0), hour(1), hour(2)),
        (20, 10, 10),
        "each report in the hours it was metered"
    );
}

proptest! {
    /// Reports of a constant rate over arbitrary windows, applied in any order (replicas
    /// overlapping, late, out of order): the federation never counts more than the rate
    /// times the time the windows cover together; windows that follow each other are
    /// counted in full.
    #[test]
    fn no_stretch_of_time_is_counted_twice(
        windows in prop::collection::vec((0u64..100_000, 1u64..20_000), 1..12),
        contiguous in any::<bool>(),
    ) {
        let (mut fed, epoch) = federation();
        fed.enable_records();
        let mut spans: Vec<(u64, u64)> = Vec::new();
        let mut at = 0;
        for &(start, len) in &windows {
            let start = if contiguous { at } else { start };
            spans.push((start, start + len));
            at = start + len;
        }
        for (i, &(s, e)) in spans.iter().enumerate() {
            apply(&mut fed, report(i as u64 + 1, epoch, RATE * (e - s), Some((s, e))));
        }
        // The length of the union of the windows.
        let mut sorted = spans.clone();
        sorted.sort_unstable();
        let (mut union, mut reach) = (0u64, 0u64);
        for (s, e) in sorted {
            let s = s.max(reach);
            if e > s {
                union += e - s;
                reach = e;
            }
        }
        let got = counted(&fed);
        // One rounding down per report at most.
        prop_assert!(got <= RATE * union, "counted {got} > {} for {spans:?}", RATE * union);
        if contiguous {
            prop_assert_eq!(got, RATE * union);
        }
        // The showback holds exactly what the ledger was given (nothing decayed here).
        let sb = fed.showback().expect("kept");
        let total: u128 = sb.query(0, u64::MAX, GroupBy::default()).iter().map(|r| r.milli_gpue_ms).sum();
        prop_assert_eq!(total, u128::from(got));
    }
}
