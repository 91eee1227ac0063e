//! `kvota snapshot save|restore`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kvota_client::client::Client;
use kvota_proto::v1;

use super::*;

/// `kvota snapshot ...`
#[derive(Debug, clap::Subcommand)]
pub enum SnapshotCmd {
    /// Save the federation's replicated state (policy, ledger, clusters and their leases,
    /// showback, decisions, audit log) to FILE, as the leader has applied it. Operators
    /// only. The file is versioned; `kvota snapshot restore` reads it.
    Save {
        /// Where to write the backup (not overwritten unless --force); a directory:
        /// into a new file there, `kvota-backup-<UTC time>.json` (as a CronJob does).
        file: PathBuf,
        /// Replace FILE if it exists.
        #[arg(long)]
        force: bool,
        /// With FILE a directory: keep the newest N backups there, remove older ones.
        #[arg(long, value_name = "N")]
        keep: Option<usize>,
    },
    /// Write a backup into a NEW data directory as a one-node federation (no control
    /// plane needed): then start `kvota server` on that directory without --init, and
    /// grow it with `kvota members add-learner` and `kvota members set-voters`. Agents
    /// keep their journals: what they reported after the backup was taken is reported
    /// again only if they still hold it, so take backups often.
    Restore {
        /// The backup file (`kvota snapshot save`).
        file: PathBuf,
        /// The new node's id.
        #[arg(long)]
        id: u64,
        /// The new node's data directory (must not hold one yet).
        #[arg(long)]
        data_dir: PathBuf,
        /// The new node's addresses, as for `kvota server --member`:
        /// ID=GRPC_ADDR,HTTP_ADDR,RAFT_ADDR (the ID must be --id).
        #[arg(long, value_name = "ID=GRPC,HTTP,RAFT")]
        member: String,
    },
}

/// `kvota snapshot ...`
pub fn snapshot(cp: &Cp, cmd: &SnapshotCmd) -> Result<()> {
    match cmd {
        SnapshotCmd::Save { file, force, keep } => {
            if !file.is_dir() {
                if keep.is_some() {
                    bail!("--keep needs FILE to be a directory of backups");
                }
                return snapshot_save(cp, file, *force);
            }
            let name = format!("kvota-backup-{}.json", rfc3339(wall_ms()).replace(':', "-"));
            snapshot_save(cp, &file.join(name), *force)?;
            if let Some(n) = keep {
                prune_backups(file, *n)?;
            }
            Ok(())
        }
        SnapshotCmd::Restore {
            file,
            id,
            data_dir,
            member,
        } => {
            let (mid, node) = crate::server_cmd::parse_member(member)?;
            if mid != *id {
                bail!("--member names node {mid} but --id is {id}: the addresses must be the restored node's own");
            }
            let bytes = read_backup(file)?;
            let rt = rt()?;
            let s = rt
                .block_on(kvota_control_plane::backup::restore(
                    &bytes,
                    data_dir,
                    *id,
                    node.clone(),
                    kvota_control_plane::feature::FeatureLevel::NEWEST,
                ))
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            out!(
                "restored the federation as of log index {} (policy {}, {} tenants, {} clusters, feature level {}) into {} as node {id}, its only voter",
                s.applied_index,
                s.policy.as_deref().unwrap_or("none"),
                s.tenants,
                s.clusters,
                s.feature_level,
                data_dir.display()
            );
            out!("start it (without --init):");
            out!(
                "  kvota server --id {id} --data-dir {} --listen {} --http {} --raft-listen {}",
                data_dir.display(),
                node.rpc_addr,
                node.http_addr,
                node.raft_addr
            );
            out!("then grow it: start each new node without --init, and");
            out!(
                "  kvota members add-learner --id N --rpc ... --raft ... --http ... --cp {}",
                node.rpc_addr
            );
            out!("  kvota members set-voters --voters {id},N,... --cp {}", node.rpc_addr);
            Ok(())
        }
    }
}

fn read_backup(file: &Path) -> Result<Vec<u8>> {
    let meta = std::fs::metadata(file).with_context(|| format!("read {}", file.display()))?;
    if meta.len() > kvota_control_plane::backup::MAX_BACKUP_BYTES as u64 {
        bail!(
            "{}: {} bytes; a backup is at most {}",
            file.display(),
            meta.len(),
            kvota_control_plane::backup::MAX_BACKUP_BYTES
        );
    }
    std::fs::read(file).with_context(|| format!("read {}", file.display()))
}

/// `kvota snapshot save FILE`: fetched whole, checked, then written durably (a
/// temporary file beside FILE, fdatasync, renamed into place, the directory synced).
fn snapshot_save(cp: &Cp, file: &Path, force: bool) -> Result<()> {
    use std::io::Write as _;
    if file.exists() && !force {
        bail!("{} exists; pass --force to replace it", file.display());
    }
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| async move {
            Ok(Client::admin(ch)
                .max_decoding_message_size(kvota_control_plane::backup::MAX_BACKUP_BYTES)
                .save_snapshot(v1::Empty {})
                .await?
                .into_inner())
        }))
        .map_err(|e| status_err(cp, e))?;
    let s = kvota_control_plane::backup::summary(&r.backup, kvota_control_plane::feature::FeatureLevel::NEWEST)
        .map_err(|e| anyhow::anyhow!("the control plane sent a backup this kvota cannot read: {e}"))?;
    if !r.follows_leader {
        eprintln!("kvota: warning: the answering node could not confirm it was caught up with the leader ({}); the backup may miss the latest writes", r.note);
    }
    let dir = file
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.partial",
        file.file_name().map_or("kvota-backup".into(), |n| n.to_string_lossy())
    ));
    {
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
        f.write_all(&r.backup)
            .with_context(|| format!("write {}", tmp.display()))?;
        f.sync_data().with_context(|| format!("sync {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, file).with_context(|| format!("move {} to {}", tmp.display(), file.display()))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    out!(
        "saved the federation as of log index {} (policy {}, {} tenants, {} cluster{}, feature level {}) to {} ({} bytes)",
        s.applied_index,
        s.policy.as_deref().unwrap_or("none"),
        s.tenants,
        s.clusters,
        if s.clusters == 1 { "" } else { "s" },
        s.feature_level,
        file.display(),
        r.backup.len()
    );
    Ok(())
}

/// Removes all but the newest `keep` backups `kvota-backup-*.json` in `dir` (their names
/// sort by time).
fn prune_backups(dir: &Path, keep: usize) -> Result<()> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("kvota-backup-") && n.ends_with(".json"))
        })
        .collect();
    files.sort();
    let old = files.len().saturating_sub(keep.max(1));
    for f in &files[..old] {
        std::fs::remove_file(f).with_context(|| format!("remove {}", f.display()))?;
        out!("removed the older backup {}", f.display());
    }
    Ok(())
}
