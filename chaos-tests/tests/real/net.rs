//! The test's network: one namespace per process, joined by a bridge, built with `ip`.
//!
//! ```text
//!  root namespace (the test: load driver, CLI)
//!    kv<t>u 10.77.N.1/24 ──┐                      ┌── s1 eth0 10.77.N.11  (kvota server 1)
//!                          └── <run>-sw: bridge ──┼── s2 eth0 10.77.N.12
//!                                                 ├── s3 eth0 10.77.N.13
//!                                                 ├── a1 eth0 10.77.N.21  (kvota agent east)
//!                                                 ├── a2 eth0 10.77.N.22
//!                                                 └── a3 eth0 10.77.N.23
//!    kv<t>l1 10.78.N.1/30 ──── a1 lan0 10.78.N.2   (the "API server" link to the webhook)
//!    kv<t>l2 10.78.N.5/30 ──── a2 lan0 10.78.N.6
//!    kv<t>l3 10.78.N.9/30 ──── a3 lan0 10.78.N.10
//! ```
//!
//! The bridge lives in a namespace of its own, not in the root one: a host running
//! Docker sets `FORWARD DROP` and `bridge-nf-call-iptables=1`, which would drop bridged
//! traffic between the namespaces. The agents' second link stands for their cluster's
//! API server calling the webhook: cutting an agent off the control plane (the WAN)
//! must not cut it off its own cluster, or there would be no admissions to check.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static RUNS: AtomicU32 = AtomicU32::new(0);

/// Runs `ip` (or another tool) and returns its stdout, or what went wrong.
pub fn sh(prog: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(prog)
        .args(args)
        .output()
        .map_err(|e| format!("run `{prog} {}`: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "`{prog} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

fn ip(args: &[&str]) -> Result<String, String> {
    sh("ip", args)
}

/// One process's place in the network.
#[derive(Clone, Debug)]
pub struct Host {
    /// Short name: `s1`, `a2`.
    pub name: String,
    /// Its namespace.
    pub ns: String,
    /// Its address on the bridge.
    pub addr: String,
    /// Agents: the address the driver reaches the webhook at (the second link).
    pub lan_addr: Option<String>,
    /// The bridge port (in the switch namespace) its `eth0` plugs into.
    port: String,
}

/// The namespaces, bridge and links of one test run; all removed on drop.
#[derive(Debug)]
pub struct Net {
    /// Namespace of the bridge.
    pub switch_ns: String,
    /// Every host, servers first.
    pub hosts: Vec<Host>,
    root_links: Vec<String>,
    namespaces: Vec<String>,
}

/// Namespaces of earlier runs whose test process is gone (killed before its drop guards
/// ran): their processes are killed and the namespaces removed.
fn remove_stale() {
    let Ok(list) = ip(&["netns", "list"]) else { return };
    for line in list.lines() {
        let ns = line.split_whitespace().next().unwrap_or_default();
        let Some(rest) = ns.strip_prefix("kvota-") else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if let Ok(pids) = ip(&["netns", "pids", ns]) {
            for p in pids.split_whitespace() {
                let _ = sh("kill", &["-KILL", p]);
            }
        }
        let _ = ip(&["netns", "del", ns]);
    }
}

/// A /24 in 10.77.0.0/16 (and the matching one in 10.78/16) no interface uses yet.
fn free_subnet(seed: u32) -> Result<u32, String> {
    let used = ip(&["-o", "-4", "addr", "show"])?;
    for k in 0..200 {
        let n = 20 + (seed + k) % 200;
        if !used.contains(&format!("10.77.{n}.")) && !used.contains(&format!("10.78.{n}.")) {
            return Ok(n);
        }
    }
    Err("no free 10.77.x.0/24 subnet for the test network".into())
}

impl Net {
    /// Builds the network for `servers` servers and `agents` agents.
    pub fn build(servers: usize, agents: usize) -> Result<Net, String> {
        remove_stale();
        let pid = std::process::id();
        let run = RUNS.fetch_add(1, Ordering::SeqCst);
        let prefix = format!("kvota-{pid}-{run}");
        // Interface names are at most 15 bytes: a short tag from pid and run.
        let tag = format!("{:05x}", (pid.wrapping_mul(31).wrapping_add(run)) & 0xf_ffff);
        let n = free_subnet(pid.wrapping_add(run * 7))?;
        let mut net = Net {
            switch_ns: format!("{prefix}-sw"),
            hosts: Vec::new(),
            root_links: Vec::new(),
            namespaces: Vec::new(),
        };
        let sw = net.switch_ns.clone();
        ip(&["netns", "add", &sw])?;
        net.namespaces.push(sw.clone());
        ip(&["-n", &sw, "link", "set", "lo", "up"])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        // The uplink from the root namespace (the test) to the bridge.
        let up = format!("kv{tag}u");
        ip(&["link", "add", &up, "type", "veth", "peer", "name", "up0", "netns", &sw])?;
        net.root_links.push(up.clone());
        ip(&["-n", &sw, "link", "set", "up0", "master", "br0", "up"])?;
        ip(&["addr", "add", &format!("10.77.{n}.1/24"), "dev", &up])?;
        ip(&["link", "set", &up, "up"])?;
        let names: Vec<(String, String)> = (1..=servers)
            .map(|i| (format!("s{i}"), format!("10.77.{n}.{}", 10 + i)))
            .chain((1..=agents).map(|i| (format!("a{i}"), format!("10.77.{n}.{}", 20 + i))))
            .collect();
        for (name, addr) in names {
            let ns = format!("{prefix}-{name}");
            ip(&["netns", "add", &ns])?;
            net.namespaces.push(ns.clone());
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let port = format!("p{name}");
            ip(&[
                "-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0", "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            let lan_addr = if let Some(i) = name.strip_prefix('a').and_then(|i| i.parse::<u32>().ok()) {
                let base = 4 * (i - 1);
                let link = format!("kv{tag}l{i}");
                ip(&[
                    "link", "add", &link, "type", "veth", "peer", "name", "lan0", "netns", &ns,
                ])?;
                net.root_links.push(link.clone());
                ip(&["addr", "add", &format!("10.78.{n}.{}/30", base + 1), "dev", &link])?;
                ip(&["link", "set", &link, "up"])?;
                ip(&[
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("10.78.{n}.{}/30", base + 2),
                    "dev",
                    "lan0",
                ])?;
                ip(&["-n", &ns, "link", "set", "lan0", "up"])?;
                Some(format!("10.78.{n}.{}", base + 2))
            } else {
                None
            };
            net.hosts.push(Host {
                name,
                ns,
                addr,
                lan_addr,
                port,
            });
        }
        Ok(net)
    }

    /// The host called `name`.
    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name} in the test network"))
    }

    /// Pulls (`false`) or plugs back (`true`) the cable of `name` on the bridge: its
    /// `eth0` loses carrier; its second link (agents) stays up.
    pub fn set_link(&self, name: &str, up: bool) -> Result<(), String> {
        let h = self.host(name);
        ip(&[
            "-n",
            &self.switch_ns,
            "link",
            "set",
            &h.port,
            if up { "up" } else { "down" },
        ])
        .map(|_| ())
    }

    /// A summary for failure messages.
    pub fn describe(&self) -> String {
        let hosts: Vec<String> = self
            .hosts
            .iter()
            .map(|h| {
                format!(
                    "{} {} in {}{}",
                    h.name,
                    h.addr,
                    h.ns,
                    h.lan_addr
                        .as_ref()
                        .map(|l| format!(" (webhook {l})"))
                        .unwrap_or_default()
                )
            })
            .collect();
        format!("bridge in {}; {}", self.switch_ns, hosts.join("; "))
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            if let Ok(pids) = ip(&["netns", "pids", ns]) {
                for p in pids.split_whitespace() {
                    let _ = sh("kill", &["-KILL", p]);
                }
            }
            let _ = ip(&["netns", "del", ns]);
        }
        // Deleting a namespace destroys its veth ends, and with them the peers here; a
        // link whose peer was never moved is deleted by name.
        for l in &self.root_links {
            let _ = ip(&["link", "del", l]);
        }
    }
}
