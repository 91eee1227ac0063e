//! Raft calls run in spans that name the method, the peer and the term on both sides,
//! so one write can be followed from the leader to each follower in the logs
//! (`--log-format json` prints a span's fields with every line logged inside it).
//! Its own test binary: it installs the process's global subscriber.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvota_testkit::{Cluster, Pki};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};

/// A span's name and its fields as recorded (at creation and later).
type SpanSeen = (&'static str, HashMap<String, String>);

/// Every span seen, by id.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<HashMap<u64, SpanSeen>>>);

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}"));
    }
}

impl<S: tracing::Subscriber> Layer<S> for Seen {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut seen = self.0.lock().expect("no panic while holding the spans");
        seen.insert(id.into_u64(), (attrs.metadata().name(), fields));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut seen = self.0.lock().expect("no panic while holding the spans");
        if let Some((_, fields)) = seen.get_mut(&id.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
}

impl Seen {
    /// The fields of every span named `name` whose `method` is `method`.
    fn spans(&self, name: &str, method: &str) -> Vec<HashMap<String, String>> {
        let want = format!("{method:?}");
        self.0
            .lock()
            .expect("no panic while holding the spans")
            .values()
            .filter(|(n, f)| *n == name && f.get("method") == Some(&want))
            .map(|(_, f)| f.clone())
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn raft_calls_carry_the_method_the_peer_and_the_term_on_both_sides() {
    let seen = Seen::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(seen.clone()))
        .expect("the only subscriber of this test binary");
    let pki = Pki::new("kvota");
    let cl = Cluster::start_with(3, Some(&pki), |_| {}).await;
    let leader = cl.leader(Duration::from_secs(10)).await;
    // Heartbeats: AppendEntries from the leader to each follower.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let votes = seen.spans("raft_send", "Vote");
    assert!(!votes.is_empty(), "an election sends votes in spans");
    let sent = seen.spans("raft_send", "AppendEntries");
    let peers: Vec<&str> = sent.iter().filter_map(|f| f.get("peer").map(String::as_str)).collect();
    assert!(
        (1..=3u64)
            .filter(|n| *n != leader)
            .all(|n| peers.contains(&n.to_string().as_str())),
        "the leader's AppendEntries name each follower: {peers:?}"
    );
    assert!(
        sent.iter().all(|f| f.get("term").is_some_and(|t| t != "0")),
        "every call names the term: {sent:?}"
    );
    let received = seen.spans("raft_receive", "AppendEntries");
    assert!(
        received
            .iter()
            .any(|f| f.get("peer") == Some(&leader.to_string()) && f.get("term").is_some_and(|t| t != "0")),
        "a follower's handler names the leader it heard from and the term: {received:?}"
    );
}
