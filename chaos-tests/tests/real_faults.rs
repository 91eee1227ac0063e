//! Real processes, real faults: three `kvota server` and three `kvota agent` processes
//! (the real binary, simulated clusters of 8 GPUs each), every one in its own network
//! namespace with its own address, under load from the test acting as each cluster's
//! API server; faults from outside: SIGKILL and restart of the leader, SIGSTOP/SIGCONT,
//! an agent's cable pulled for longer than its lease, and packet delay on the leader.
//!
//! After each scenario the test reads the state through the CLI (`kvota clusters`,
//! `tenants`, `explain tenant`), the servers' HTTP API and the agents' `/metrics`, and
//! checks: no over-admission (each admission within the budget it was judged by; each
//! tenant's federation-wide in-use within maxShare; a cut-off agent within what the
//! control plane accounts it may enforce), nothing lost (journals drained, the control
//! plane's last report per cluster is the agent's, the ledger equals the usage the
//! agents reported), recovery (one leader, every server ready, every lease fresh again)
//! within stated bounds.
//!
//! Needs root and `ip` (iproute2); the delay scenario also `iptables`. Missing ones fail
//! the test with what to install, unless `KVOTA_CHAOS_REAL=skip`. The scenarios run one
//! at a time (they share two cores and their timing). Run just these:
//! `cargo test -p kvota-chaos-tests --test real_faults`. More in `docs/testing.md`.

mod real;

use std::time::{Duration, Instant};

use real::delay::Delay;
use real::load::{Load, TENANTS};
use real::{eventually, max_share_caps, Fed, Timing, LEASE_MS, MARGIN_MS};

/// One scenario at a time: six processes each, on a machine with two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Load before the fault: budgets follow demand within a few report rounds.
const WARMUP: Duration = Duration::from_secs(4);
/// Recovery bound after the last fault heals: an election (600-1200 ms timeouts), the
/// agents' backoff after failures (up to 8 report intervals, 2.4 s, plus a call
/// deadline of 8 s against a node that does not answer), then one report.
const RECOVERY: Duration = Duration::from_secs(25);
/// A new leader after the old one died or froze: a few election timeouts.
const FAILOVER: Duration = Duration::from_secs(10);

/// Every cluster's last applied report at the control plane.
async fn last_seqs(fed: &Fed) -> Vec<(String, u64)> {
    let cs = fed
        .clusters_at(&fed.leader_cp().await)
        .await
        .unwrap_or_else(|e| fed.fail(&e));
    cs.iter()
        .map(|(c, v)| (c.clone(), v["last_seq"].as_u64().unwrap_or(0)))
        .collect()
}

/// Waits until every cluster's reports moved at least `by` past `before`: writes go on.
async fn writes_continue(fed: &Fed, before: &[(String, u64)], by: u64, within: Duration) -> Duration {
    let (_, t) = eventually("every cluster's reports applied again", within, || async {
        let now = fed.clusters_at(&fed.leader_cp().await).await?;
        for (c, s) in before {
            let n = now.get(c).and_then(|v| v["last_seq"].as_u64()).unwrap_or(0);
            if n < s + by {
                return Err(format!("{c}: last applied report {n}, was {s}"));
            }
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|e| fed.fail(&e));
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_sigkill_then_restart_catches_up() {
    let _one = SERIAL.lock().await;
    let Some(mut fed) = Fed::start("leader-sigkill").await else {
        return;
    };
    let mut load = Load::start(&fed.hooks, max_share_caps());
    tokio::time::sleep(WARMUP).await;
    let (leader, _) = fed.wait_leader(FAILOVER).await.unwrap_or_else(|e| fed.fail(&e));
    let before = last_seqs(&fed).await;
    let killed_at = Instant::now();
    fed.proc(&format!("s{leader}")).kill();
    fed.note(format!("SIGKILL leader s{leader}"));
    let (new, t) = fed.wait_leader(FAILOVER).await.unwrap_or_else(|e| fed.fail(&e));
    assert_ne!(new, leader, "the killed node cannot lead");
    fed.note(format!("s{new} leads after {t:?}"));
    let t = writes_continue(&fed, &before, 3, Duration::from_secs(15)).await;
    fed.note(format!(
        "every cluster's reports applied under the new leader {t:?} after it was elected"
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Restart from its data directory; it must catch up with what was committed while
    // it was dead.
    let st = fed.statuses().await;
    let target = st
        .values()
        .filter_map(|v| v["last_applied_index"].as_u64())
        .max()
        .unwrap_or(0);
    fed.restart(&format!("s{leader}"));
    fed.note(format!("restarted s{leader}; the others had applied index {target}"));
    let addr = format!("{}:7501", fed.server(usize::try_from(leader - 1).unwrap_or(0)).addr);
    let (_, t) = eventually("the restarted node to catch up", Duration::from_secs(20), || async {
        let v = real::server_status(&addr).await?;
        match (v["role"].as_str(), v["last_applied_index"].as_u64()) {
            (Some("follower"), Some(i)) if i >= target => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| fed.fail(&e));
    fed.note(format!("s{leader} caught up past index {target} in {t:?}"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    load.stop().await;
    fed.recover(RECOVERY).await;
    fed.check_ledger().await;
    fed.check_cp_accounting().await;
    fed.check_book(&load.book(), Some(killed_at));
    fed.check_alive();
    fed.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_the_leader_then_a_follower() {
    let _one = SERIAL.lock().await;
    let Some(mut fed) = Fed::start("sigstop").await else {
        return;
    };
    let mut load = Load::start(&fed.hooks, max_share_caps());
    tokio::time::sleep(WARMUP).await;
    let (leader, _) = fed.wait_leader(FAILOVER).await.unwrap_or_else(|e| fed.fail(&e));
    let paused_at = Instant::now();
    // Paused longer than a lease: agents whose calls hang on the frozen node fall back
    // to safe budgets until their client gives up on it and finds the new leader.
    let pause = Duration::from_millis(LEASE_MS + 1_000);
    fed.proc(&format!("s{leader}")).signal("-STOP");
    fed.note(format!("SIGSTOP leader s{leader} for {pause:?}"));
    // A frozen node cannot lead: the other two must elect one of themselves and agree.
    let (new, t) = fed
        .wait_leader_without(Some(leader), FAILOVER)
        .await
        .unwrap_or_else(|e| fed.fail(&e));
    fed.note(format!("s{new} leads after {t:?}"));
    tokio::time::sleep(pause.saturating_sub(paused_at.elapsed())).await;
    fed.proc(&format!("s{leader}")).signal("-CONT");
    // The old leader wakes up believing it leads; it must step down, one leader remains.
    let (l, t) = eventually("one leader once the old one resumed", FAILOVER, || async {
        let st = fed.statuses().await;
        let leaders: Vec<u64> = st
            .values()
            .filter(|v| v["role"] == "leader")
            .filter_map(|v| v["node_id"].as_u64())
            .collect();
        match leaders.as_slice() {
            [l] if st.len() == 3 && st.values().all(|v| v["leader_id"].as_u64() == Some(*l)) => Ok(*l),
            _ => Err(format!("leaders {leaders:?} among {} answering", st.len())),
        }
    })
    .await
    .unwrap_or_else(|e| fed.fail(&e));
    fed.note(format!("SIGCONT s{leader}: all three agree on s{l} after {t:?}"));

    let follower = (1..=3u64).find(|i| *i != l).unwrap_or(1);
    let before = last_seqs(&fed).await;
    fed.proc(&format!("s{follower}")).signal("-STOP");
    fed.note(format!("SIGSTOP follower s{follower} for 3s"));
    let t = writes_continue(&fed, &before, 3, Duration::from_secs(15)).await;
    fed.note(format!("reports applied with a follower frozen ({t:?})"));
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(t)).await;
    fed.proc(&format!("s{follower}")).signal("-CONT");
    fed.note(format!("SIGCONT s{follower}"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    load.stop().await;
    // A frozen node must not cost an agent more than about one lease: its client gives
    // up on a silent node after two thirds of the lease's usable life. (Before that fix
    // every agent spent about 10 s of this scenario, 40 samples, on safe budgets.)
    for c in real::CLUSTERS {
        let safe = load
            .book()
            .samples
            .iter()
            .filter(|s| s.cluster == c && s.metrics.lease_state() == "safe")
            .count();
        if safe > 24 {
            fed.fail(&format!(
                "{c} spent {safe} samples (250 ms each) on safe budgets while one server was frozen"
            ));
        }
    }
    fed.recover(RECOVERY).await;
    fed.check_ledger().await;
    fed.check_cp_accounting().await;
    fed.check_book(&load.book(), Some(paused_at));
    fed.check_alive();
    fed.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_cut_off_past_its_lease_keeps_enforcing_then_drains() {
    let _one = SERIAL.lock().await;
    let Some(mut fed) = Fed::start("agent-cut").await else {
        return;
    };
    let mut load = Load::start(&fed.hooks, max_share_caps());
    tokio::time::sleep(WARMUP).await;
    let cut_at = Instant::now();
    fed.net.set_link("a1", false).unwrap_or_else(|e| fed.fail(&e));
    fed.note("pulled east's cable (a1 eth0 has no carrier; its webhook link stays up)".into());
    let hook = fed.hooks[0].1.clone();
    // The lease ends at request time + duration - margin, so at most that after the cut.
    let (_, t) = eventually(
        "east to enforce safe budgets",
        Duration::from_millis(LEASE_MS + 2_000),
        || async {
            let m = hook.metrics().await?;
            match m.lease_state() {
                "safe" => Ok(()),
                s => Err(format!("lease {s}")),
            }
        },
    )
    .await
    .unwrap_or_else(|e| fed.fail(&e));
    let safe_at = Instant::now();
    fed.note(format!(
        "east enforces safe budgets {t:?} after the cut (lease {LEASE_MS} ms - margin {MARGIN_MS} ms)"
    ));
    assert!(
        t <= Duration::from_millis(LEASE_MS),
        "the lease outlived its duration after the cut: {t:?}"
    );
    // The control plane, on its side, accounts east at its safe budgets once the lease
    // has provably ended.
    let (east, t) = eventually(
        "the control plane to mark east unreachable",
        Duration::from_secs(5),
        || async {
            let cs = fed.clusters_at(&fed.leader_cp().await).await?;
            let east = cs.get("east").cloned().ok_or("east unknown")?;
            if east["unreachable"] == true {
                Ok(east)
            } else {
                Err("east still reachable".to_string())
            }
        },
    )
    .await
    .unwrap_or_else(|e| fed.fail(&e));
    fed.note(format!("control plane marks east unreachable {t:?} later"));
    // Longer than a pod's life (5 s): east's pods from before the cut finish, and new
    // ones are admitted (or not) by the safe budgets alone.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let healed_at = Instant::now();
    fed.net.set_link("a1", true).unwrap_or_else(|e| fed.fail(&e));
    fed.note(format!("plugged east back after {:?}", cut_at.elapsed()));

    // While safe, east admitted nothing beyond what the control plane accounted it may
    // enforce (that is what lets the control plane give the rest to other clusters).
    let may: std::collections::BTreeMap<String, u64> = east["tenants"]
        .as_array()
        .map(|ts| {
            ts.iter()
                .filter_map(|t| Some((t["tenant"].as_str()?.to_string(), t["enforceable_milli_gpue"].as_u64()?)))
                .collect()
        })
        .unwrap_or_default();
    {
        let book = load.book();
        let mut checked = 0;
        for a in book
            .admissions
            .iter()
            .filter(|a| a.cluster == "east" && a.at > safe_at && a.at < healed_at)
        {
            let bound = may.get(&a.tenant).copied().unwrap_or(0);
            if a.after > bound || a.budget > bound {
                fed.fail(&format!("east admitted {} to {} milli-GPUe (budget {}) while cut off; the control plane accounts it may enforce {bound}", a.tenant, a.after, a.budget));
            }
            checked += 1;
        }
        let mut backlog = 0;
        for s in book
            .samples
            .iter()
            .filter(|s| s.cluster == "east" && s.at > safe_at && s.at < healed_at)
        {
            backlog = backlog.max(s.metrics.get("kvota_agent_journal_backlog").unwrap_or(0));
            for (t, _) in TENANTS {
                let b = s.metrics.tenant_scaled("kvota_agent_budget_gpus", t, 1000.0);
                if b > may.get(t).copied().unwrap_or(0) {
                    fed.fail(&format!(
                        "east enforced a {t} budget of {b} while cut off, above the {:?} the control plane accounts",
                        may.get(t)
                    ));
                }
            }
        }
        let others = book
            .admissions
            .iter()
            .filter(|a| a.cluster != "east" && a.at > safe_at && a.at < healed_at)
            .count();
        fed.note(format!(
            "while cut: east admitted {checked} pods within its safe budgets {may:?}, journal backlog reached {backlog}; west and north admitted {others}"
        ));
        if backlog == 0 {
            fed.fail("east's journal never held a report while cut off: was it cut?");
        }
        if checked == 0 {
            fed.fail("east admitted nothing under its safe budgets: the check above proved nothing");
        }
    }
    load.stop().await;
    fed.recover(RECOVERY).await;
    fed.check_ledger().await;
    fed.check_cp_accounting().await;
    fed.check_book(&load.book(), Some(cut_at));
    fed.check_alive();
    fed.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packets_of_the_leader_delayed_200ms() {
    let _one = SERIAL.lock().await;
    // The delay stands for a WAN link: the servers run with timing for one (heartbeat
    // above the round trip). With the LAN timing every replication RPC of the delayed
    // leader times out, it cannot commit, and writes stall until a follower's election
    // timer fires (about 8 s in the runs that found it).
    let Some(mut fed) = Fed::start_with("leader-delay", &["iptables"], Timing::Wan).await else {
        return;
    };
    let mut load = Load::start(&fed.hooks, max_share_caps());
    tokio::time::sleep(WARMUP).await;
    let (leader, _) = fed.wait_leader(FAILOVER).await.unwrap_or_else(|e| fed.fail(&e));
    let host = fed.server(usize::try_from(leader - 1).unwrap_or(0)).clone();
    let ping = || async {
        let t0 = Instant::now();
        real::http::http_get(&format!("{}:7501", host.addr), "/healthz")
            .await
            .map(|_| t0.elapsed())
    };
    let quiet = ping().await.unwrap_or_else(|e| fed.fail(&e));
    let before = last_seqs(&fed).await;
    let delayed_at = Instant::now();
    let delay = Delay::start(&host.ns, 7, Duration::from_millis(200), Duration::from_millis(50))
        .unwrap_or_else(|e| fed.fail(&e));
    fed.note(format!("delaying every packet s{leader} sends by 200 ms +- 50 ms"));
    let slow = ping().await.unwrap_or_else(|e| fed.fail(&e));
    fed.note(format!(
        "HTTP round trip to s{leader}: {quiet:?} before, {slow:?} delayed"
    ));
    if slow < Duration::from_millis(150) {
        fed.fail(&format!(
            "the delay did not take: a round trip to s{leader} took {slow:?}"
        ));
    }
    let t = writes_continue(&fed, &before, 5, Duration::from_secs(15)).await;
    fed.note(format!("every cluster's reports applied while delayed ({t:?})"));
    tokio::time::sleep(Duration::from_secs(8).saturating_sub(delayed_at.elapsed())).await;
    let n = delay.stop().unwrap_or_else(|e| fed.fail(&e));
    fed.note(format!(
        "delay removed after {:?}: {n} packets delayed",
        delayed_at.elapsed()
    ));
    let st = fed.statuses().await;
    let leaders: Vec<u64> = st
        .values()
        .filter(|v| v["role"] == "leader")
        .filter_map(|v| v["node_id"].as_u64())
        .collect();
    fed.note(format!("leader now {leaders:?} (was s{leader})"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    load.stop().await;
    fed.recover(RECOVERY).await;
    fed.check_ledger().await;
    fed.check_cp_accounting().await;
    fed.check_book(&load.book(), Some(delayed_at));
    fed.check_alive();
    fed.finish();
}
