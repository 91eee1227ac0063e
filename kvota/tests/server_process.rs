//! The real `kvota server` binary, three processes on loopback: SIGKILL the leader in
//! the middle of a stream of writes, restart it from its data directory, and check that
//! every acknowledged write survived and the restarted node caught up.

use std::process::Child;
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_proto::v1;
use kvota_testkit::procs::{server_command, specs, Procs, ServerSpec};

fn spawn(s: &ServerSpec, all: &[ServerSpec], init: bool) -> Child {
    server_command(
        std::path::Path::new(env!("CARGO_BIN_EXE_kvota")),
        s,
        all,
        init,
        &["--tick-ms".into(), "300".into()],
    )
    .spawn()
    .expect("spawn kvota server")
}

async fn status(addr: &str) -> Option<v1::StatusReply> {
    kvota_testkit::procs::status(addr, Duration::from_secs(3)).await
}

async fn leader(specs: &[ServerSpec]) -> usize {
    let rpcs: Vec<String> = specs.iter().map(|s| s.rpc.clone()).collect();
    kvota_testkit::procs::leader(&rpcs, Duration::from_secs(3), Duration::from_secs(20)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_the_leader_during_writes_then_it_catches_up() {
    let tmp = tempfile::tempdir().expect("tmp");
    let specs = specs(3, tmp.path());
    let mut procs = Procs(
        specs
            .iter()
            .enumerate()
            .map(|(i, s)| Some(spawn(s, &specs, i == 0)))
            .collect(),
    );
    leader(&specs).await;
    let all: Vec<String> = specs.iter().map(|s| s.rpc.clone()).collect();
    let client = Client::new(&all).expect("client");
    let yaml = kvota_fairness::policy::Policy::article_example_yaml().to_string();
    client
        .call(|ch| {
            let yaml = yaml.clone();
            async move {
                Ok(Client::admin(ch)
                    .apply_policy(v1::PolicyRequest { yaml })
                    .await?
                    .into_inner())
            }
        })
        .await
        .expect("apply policy");
    let reg = v1::RegisterRequest {
        cluster: "east".into(),
        capacity: vec![v1::Resource {
            name: "nvidia.com/gpu".into(),
            quantity_milli: 32_000,
        }],
        labels: Default::default(),
    };
    let mut held = client
        .call(|ch| {
            let reg = reg.clone();
            async move { Ok(Client::member(ch).register(reg).await?.into_inner()) }
        })
        .await
        .expect("register")
        .lease
        .expect("lease")
        .epoch;

    let total = 120u64;
    let mut killed = None;
    for seq in 1..=total {
        if seq == 40 {
            let l = leader(&specs).await;
            procs.kill(l);
            killed = Some(l);
        }
        if seq == 80 {
            let l = killed.expect("killed");
            procs.0[l] = Some(spawn(&specs[l], &specs, false));
        }
        let r = v1::ReportRequest {
            cluster: "east".into(),
            seq,
            held_epoch: held,
            tenants: vec![v1::TenantUsage {
                tenant: "training".into(),
                used_milli_gpue_ms: 1_000,
                inuse_milli_gpue: 1_000,
                pending_milli_gpue: 0,
                largest_pending_milli_gpue: 0,
                borrowed_milli_gpue: 0,
            }],
            capacity: vec![],
            evictions: vec![],
            decisions: vec![],
            window_start_ms: 0,
            window_end_ms: 0,
            gap_in_reply: false,
            status: None,
        };
        // Acknowledged means committed: retry until this report is acknowledged once.
        let reply = client
            .call(|ch| {
                let r = r.clone();
                async move { Ok(Client::member(ch).report(r).await?.into_inner()) }
            })
            .await
            .unwrap_or_else(|e| {
                let logs: String = specs
                    .iter()
                    .map(|s| std::fs::read_to_string(s.log()).unwrap_or_default())
                    .collect::<Vec<_>>()
                    .join("\n---\n");
                panic!(
                    "report {seq}: {e}\nnodes: {:?}\n{logs}",
                    specs.iter().map(|s| (&s.rpc, &s.http)).collect::<Vec<_>>()
                )
            });
        held = reply.lease.expect("lease").epoch;
    }

    // The restarted node catches up: same applied state as the others.
    let l = killed.expect("killed");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let one = Client::new(&[specs[l].rpc.clone()]).expect("client");
        let east = tokio::time::timeout(
            Duration::from_secs(3),
            one.call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) }),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .and_then(|r| r.clusters.into_iter().find(|c| c.cluster == "east"));
        if east.as_ref().map(|c| c.last_seq) == Some(total) {
            break;
        }
        assert!(Instant::now() < deadline, "restarted node did not catch up: {east:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Every node holds bit-for-bit the same ledger, with every report counted once.
    // The leader's ticks advance the state's clock (and so the decayed value), so nodes
    // are compared when they have applied the same log index.
    let deadline = Instant::now() + Duration::from_secs(30);
    let seen = loop {
        let mut rows = Vec::new();
        for s in &specs {
            let one = Client::new(std::slice::from_ref(&s.rpc)).expect("client");
            let before = status(&s.rpc).await.map(|st| st.last_applied_index);
            let t = one
                .call(|ch| async move { Ok(Client::admin(ch).list_tenants(v1::Empty {}).await?.into_inner()) })
                .await
                .expect("tenants");
            let after = status(&s.rpc).await.map(|st| st.last_applied_index);
            let usage = t
                .tenants
                .iter()
                .find(|x| x.tenant == "training")
                .map(|x| x.decayed_usage);
            rows.push((before, after, usage));
        }
        let same_index = rows.iter().all(|r| r.0.is_some() && r.0 == r.1 && r.0 == rows[0].0);
        if same_index {
            break rows.iter().map(|r| r.2.unwrap_or(0)).collect::<Vec<u64>>();
        }
        assert!(Instant::now() < deadline, "nodes never at the same index: {rows:?}");
        tokio::time::sleep(Duration::from_millis(37)).await;
    };
    assert!(
        seen.windows(2).all(|w| w[0] == w[1]),
        "nodes disagree at the same log index: {seen:?}"
    );
    // 120 reports of 1,000 milli-GPUe x ms each, decayed over seconds of a 24 h
    // half-life and rounded down once per report: just under 120,000. Had one report
    // been lost it would be at most 119,000; counted twice, above 120,000.
    assert!((119_500..=120_000).contains(&seen[0]), "usage {}", seen[0]);

    // `kvota members list`, as an operator runs it against the restarted node: the three
    // voters with their addresses, one of them the leader that `status` names.
    let leader_id = loop {
        match status(&specs[l].rpc).await {
            Some(st) if st.leader_id != 0 => break st.leader_id,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvota"))
            .args(args)
            .args(["--cp", &specs[l].rpc])
            .output()
            .expect("run kvota");
        assert!(
            out.status.success(),
            "kvota {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let list: serde_json::Value = serde_json::from_str(&cli(&["members", "list", "--json"])).expect("JSON");
    let list = list.as_array().expect("an array");
    assert_eq!(list.len(), 3, "{list:?}");
    for (m, s) in list.iter().zip(&specs) {
        assert_eq!(m["voter"], true, "{m}");
        assert_eq!(m["rpc"], s.rpc.as_str(), "{m}");
        assert_eq!(m["raft"], s.raft.as_str(), "{m}");
    }
    let leaders: Vec<u64> = list
        .iter()
        .filter(|m| m["leader"] == true)
        .filter_map(|m| m["id"].as_u64())
        .collect();
    assert_eq!(leaders, [leader_id]);
    let table = cli(&["members", "list"]);
    assert!(table.starts_with("  ID  ROLE"), "{table}");
    let leading = table.lines().filter(|l| l.contains(" yes ")).collect::<Vec<_>>();
    assert!(
        leading.len() == 1 && leading[0].trim_start().starts_with(&leader_id.to_string()),
        "{table}"
    );
}
