//! Limits that follow the machine: an agent under `prlimit --nofile=1024:1024` sizes its
//! webhook's connection limits below that (with a reserve for its journal, its kept
//! state and its connections to the control plane), so 1,100 half-finished TLS
//! requests from three local addresses, kept up for seconds, cannot pin it at its file
//! limit: the agent holds at most its per-address limit from each, refuses the rest,
//! never runs out of descriptors, answers five real reviews from another address
//! within the API server's timeout, and no kept-state save fails. (With the limits of
//! before, 4,096 connections and 512 per address, the flood was held whole and kept-state
//! saves failed.)

use std::sync::Arc;

use tokio::task::JoinSet;

use super::*;

/// Opens `n` TLS connections to `to` from the addresses `from` in turn (up to 64 at a
/// time) and sends each half a request (a request line and one header, never the end
/// of the head); returns the connections the server kept open.
pub(super) async fn half_requests(
    from: &[&str],
    to: SocketAddr,
    n: usize,
    cfg: &Arc<rustls::ClientConfig>,
) -> Vec<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let permits = Arc::new(tokio::sync::Semaphore::new(64));
    let mut tasks = JoinSet::new();
    for i in 0..n {
        let from = from[i % from.len()].to_string();
        let cfg = cfg.clone();
        let permit = permits.clone().acquire_owned().await.expect("permit");
        tasks.spawn(async move {
            let _permit = permit;
            let sock = tokio::net::TcpSocket::new_v4().ok()?;
            sock.bind(format!("{from}:0").parse().ok()?).ok()?;
            let tcp = sock.connect(to).await.ok()?;
            let name = rustls::pki_types::ServerName::try_from("localhost").ok()?;
            let mut tls = tokio_rustls::TlsConnector::from(cfg).connect(name, tcp).await.ok()?;
            tls.write_all(b"POST /validate HTTP/1.1\r\nhost: localhost\r\n")
                .await
                .ok()?;
            tls.flush().await.ok()?;
            Some(tls)
        });
    }
    let mut held = Vec::new();
    while let Some(r) = tasks.join_next().await {
        if let Ok(Some(tls)) = r {
            held.push(tls);
        }
    }
    held
}

/// Keeps up to `n` half-finished requests open from the addresses `from` in turn until
/// `stop`: one task per slot, which opens one, waits until the server closes it (the
/// header timeout) and opens the next; a connection refused is tried again 250 ms
/// later. Returns the most held at once.
async fn sustain_half_requests(
    from: &'static [&'static str],
    to: SocketAddr,
    n: usize,
    cfg: Arc<rustls::ClientConfig>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> usize {
    let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let peak = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for i in 0..n {
        let (cfg, held, peak, mut stop) = (cfg.clone(), held.clone(), peak.clone(), stop.clone());
        let from = from[i % from.len()];
        tasks.spawn(async move {
            use std::sync::atomic::Ordering::SeqCst;
            while !*stop.borrow() {
                let Some(mut tls) = half_requests(&[from], to, 1, &cfg).await.pop() else {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                };
                let now = held.fetch_add(1, SeqCst) + 1;
                peak.fetch_max(now, SeqCst);
                let mut b = [0u8; 64];
                tokio::select! {
                    _ = tls.read(&mut b) => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
                held.fetch_sub(1, SeqCst);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    peak.load(std::sync::atomic::Ordering::SeqCst)
}

/// One sample of `series` in an OpenMetrics text (0 if absent).
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// The case, on a running federation.
pub(super) async fn an_agent_under_a_low_file_limit_still_answers(fed: &Fed, apiserver_ca: &Pki) {
    // This process opens as many connections as it floods with.
    kvota_tls::listen::raise_file_limit();
    let agent = start_agent_as(fed, apiserver_ca, "south", None, Some(1_024));
    agent.ready(fed).await;
    let m = agent.metrics(fed).await;
    assert_eq!(sample(&m, "kvota_agent_open_files_limit"), 1_024.0, "{m}");
    // What a 1,024 limit leaves after the reserve (256), a quarter of it per address.
    assert_eq!(sample(&m, "kvota_agent_webhook_max_connections"), 768.0, "{m}");
    let log = std::fs::read_to_string(&agent.log).unwrap_or_default();
    assert!(
        log.contains("connection limits fit to the open-files limit") && log.contains("webhook_max_connections=768"),
        "{log}"
    );

    // 1,100 half-finished requests from three addresses, kept up for 4 s; meanwhile
    // real reviews from another address, each answered within the API server's
    // timeout (judge asserts it), and the report rounds' state saves go on.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let flood = tokio::spawn(sustain_half_requests(
        &["127.0.0.2", "127.0.0.3", "127.0.0.4"],
        agent.addr,
        1_100,
        hook_config(&fed.pki.ca_pem, None),
        stopped,
    ));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for i in 0..5 {
        let v = agent.judge(fed, &format!("while-flooded-{i}"), "CREATE", "1").await;
        assert_eq!(v["response"]["uid"], format!("while-flooded-{i}"));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let _ = stop.send(true);
    let peak = flood.await.expect("flood");
    eprintln!("at most {peak} of 1,100 half-finished requests held at once");
    assert!(peak <= 3 * 192, "held {peak}");
    let m = agent.metrics(fed).await;
    assert!(
        sample(
            &m,
            "kvota_agent_connections_refused_total{reason=\"too_many_from_peer\"}"
        ) > 0.0,
        "{m}"
    );
    assert_eq!(sample(&m, "kvota_agent_state_save_failures"), 0.0, "{m}");
    let log = std::fs::read_to_string(&agent.log).unwrap_or_default();
    assert!(
        !log.contains("Too many open files") && !log.contains("os error 24"),
        "the agent ran out of descriptors:\n{log}"
    );
}
