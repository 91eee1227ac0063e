//! `kvota members ...` and `kvota cluster remove`.

use anyhow::Result;
use kvota_client::client::Client;
use kvota_proto::v1;

use super::*;

/// `kvota members ...`
#[derive(Debug, Subcommand)]
pub enum MembersCmd {
    /// List the control plane's members: id, voter or learner, which one leads, and
    /// their gRPC, Raft and HTTP addresses, as the answering node knows them.
    List {
        /// JSON and YAML: an array of {id, voter, leader, rpc, raft, http}, the
        /// `members` of `/api/v1/status`.
        #[command(flatten)]
        out: OutputArg,
    },
    /// Initialize a new group from a node that started without --init. Give every
    /// initial member, including that node. With TLS, each other member must answer at
    /// its Raft address with its own node certificate.
    Init {
        /// ID=GRPC_ADDR,HTTP_ADDR,RAFT_ADDR; repeat for each member.
        #[arg(long = "member", value_name = "ID=GRPC,HTTP,RAFT", required = true)]
        members: Vec<String>,
    },
    /// Add a node as a learner (it receives the log but does not vote). Then waits, up
    /// to --wait, until the node says it has caught up (it has applied what the leader
    /// had: its /readyz), printing its progress. With TLS, the leader first checks that
    /// the Raft address answers with the certificate of node --id.
    AddLearner {
        /// The new node's id.
        #[arg(long)]
        id: u64,
        /// Its gRPC API address.
        #[arg(long)]
        rpc: String,
        /// Its Raft address (its --advertise-raft).
        #[arg(long)]
        raft: String,
        /// Its HTTP address.
        #[arg(long, default_value = "")]
        http: String,
        /// How long to wait for the node to catch up, in seconds (0: do not wait). A
        /// new node of a large federation is sent a snapshot of the whole state first.
        #[arg(long, value_name = "SECONDS", default_value_t = 600)]
        wait: u64,
    },
    /// Set the voters (promote learners, demote or remove voters).
    SetVoters {
        /// Node ids of the new voter set, comma separated.
        #[arg(long, value_delimiter = ',', required = true)]
        voters: Vec<u64>,
        /// Keep nodes dropped from the voter set as learners instead of removing them.
        #[arg(long)]
        keep_as_learners: bool,
    },
}

fn member(spec: &str) -> Result<v1::NodeInfo> {
    let (id, n) = crate::server_cmd::parse_member(spec)?;
    Ok(v1::NodeInfo {
        id,
        rpc_addr: n.rpc_addr,
        http_addr: n.http_addr,
        raft_addr: n.raft_addr,
        voter: true,
    })
}

/// `kvota members list`
fn members_list(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let s = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if o.print(&kvota_control_plane::view::StatusView::from(&s).members)? {
        return Ok(());
    }
    out!(
        "{:>4}  {:<8}  {:<6}  {:<22}  {:<22}  HTTP",
        "ID",
        "ROLE",
        "LEADS",
        "GRPC",
        "RAFT"
    );
    for m in &s.members {
        out!(
            "{:>4}  {:<8}  {:<6}  {:<22}  {:<22}  {}",
            m.id,
            if m.voter { "voter" } else { "learner" },
            if m.id == s.leader_id { "yes" } else { "" },
            m.rpc_addr,
            if m.raft_addr.is_empty() { "-" } else { &m.raft_addr },
            if m.http_addr.is_empty() { "-" } else { &m.http_addr },
        );
    }
    if s.leader_id == 0 {
        out!(
            "no leader known to node {} (election in progress or no quorum)",
            s.node_id
        );
    }
    Ok(())
}

/// `kvota members ...`
pub fn members(cp: &Cp, cmd: &MembersCmd) -> Result<()> {
    let c = client(cp)?;
    let rt = rt()?;
    let reply = match cmd {
        MembersCmd::List { out } => return members_list(cp, *out),
        MembersCmd::Init { members } => {
            let members = members.iter().map(|m| member(m)).collect::<Result<Vec<_>>>()?;
            rt.block_on(c.call(|ch| {
                let members = members.clone();
                async move {
                    Ok(Client::admin(ch)
                        .initialize(v1::InitializeRequest { members })
                        .await?
                        .into_inner())
                }
            }))
        }
        MembersCmd::AddLearner {
            id,
            rpc,
            http,
            raft,
            wait,
        } => {
            let node = v1::NodeInfo {
                id: *id,
                rpc_addr: rpc.clone(),
                http_addr: http.clone(),
                raft_addr: raft.clone(),
                voter: false,
            };
            let reply = rt
                .block_on(c.call(|ch| {
                    let node = node.clone();
                    async move {
                        Ok(Client::admin(ch)
                            .add_learner(v1::AddLearnerRequest { node: Some(node) })
                            .await?
                            .into_inner())
                    }
                }))
                .map_err(|e| status_err(cp, e))?;
            if *wait > 0 {
                rt.block_on(wait_caught_up(cp, &c, *id, rpc, std::time::Duration::from_secs(*wait)))?;
            }
            Ok(reply)
        }
        MembersCmd::SetVoters {
            voters,
            keep_as_learners,
        } => rt.block_on(c.call(|ch| {
            let req = v1::ChangeMembershipRequest {
                voters: voters.clone(),
                retain: *keep_as_learners,
            };
            async move { Ok(Client::admin(ch).change_membership(req).await?.into_inner()) }
        })),
    }
    .map_err(|e| status_err(cp, e))?;
    print_membership(&reply.members);
    Ok(())
}

fn print_membership(members: &[v1::NodeInfo]) {
    out!("membership now:");
    for m in members {
        out!(
            "  {:>3}  {:<8} grpc {}  raft {}",
            m.id,
            if m.voter { "voter" } else { "learner" },
            m.rpc_addr,
            m.raft_addr
        );
    }
}

/// Waits until node `id` (gRPC at `rpc`) says it is ready, having applied what the
/// leader had; prints its progress every few seconds. Asks the node itself: the
/// leader's view of a learner is not in the status it serves.
async fn wait_caught_up(cp: &Cp, group: &Client, id: u64, rpc: &str, within: std::time::Duration) -> Result<()> {
    let start = std::time::Instant::now();
    let node = Client::with_tls(&[rpc.to_string()], cp.tls()?).map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let status = |c: &Client| {
        let c = c.clone();
        async move {
            c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) })
                .await
        }
    };
    let mut said = std::time::Instant::now();
    loop {
        let mine = status(&node).await;
        if let Ok(st) = &mine {
            if st.ready {
                out!(
                    "node {id} has caught up (applied {}) after {:.1} s",
                    st.last_applied_index,
                    start.elapsed().as_secs_f64()
                );
                return Ok(());
            }
        }
        let leader = status(group).await.map(|s| s.last_applied_index).unwrap_or(0);
        let at = match &mine {
            Ok(st) => format!("applied {} of the leader's {leader}", st.last_applied_index),
            Err(e) => format!("not answering at {rpc}: {}", e.message()),
        };
        if start.elapsed() >= within {
            anyhow::bail!(
                "node {id} was added as a learner but has not caught up within {} s ({at}); it goes on catching up: see its log, `kvota members list`, and its /readyz",
                within.as_secs()
            );
        }
        if said.elapsed() >= std::time::Duration::from_secs(5) {
            eprintln!("node {id} catching up: {at}");
            said = std::time::Instant::now();
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// `kvota cluster remove NAME`
pub fn cluster_remove(cp: &Cp, name: &str) -> Result<()> {
    let c = client(cp)?;
    let cluster = name.to_string();
    rt()?
        .block_on(c.call(|ch| {
            let cluster = cluster.clone();
            async move {
                Ok(Client::admin(ch)
                    .remove_cluster(v1::DescribeClusterRequest { cluster })
                    .await?
                    .into_inner())
            }
        }))
        .map_err(|e| status_err(cp, e))?;
    out!("cluster `{name}` removed");
    Ok(())
}
