// kvota's dashboard: polls the node's JSON API and draws it. Plain DOM, no framework,
// nothing loaded from elsewhere. Every text from the server goes through textContent,
// never innerHTML, so no name or reason can become markup.
"use strict";

const REFRESH_MS = 2000;
let selected = null; // the tenant charted, or null for the federation
let last = null;     // the last overview

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) e.setAttribute(k, String(v));
  }
  for (const c of children) {
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

const fix2 = (x) => Number(x).toFixed(2);
const pct = (x) => (100 * Number(x)).toFixed(1) + " %";

// A numeric cell: the exact number in data-value, two decimals shown.
function num(field, value, text) {
  return el("td", { "data-field": field, "data-value": value, class: "num" }, text === undefined ? fix2(value) : text);
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  if (seconds < 90) return seconds.toFixed(0) + " s ago";
  if (seconds < 5400) return (seconds / 60).toFixed(0) + " min ago";
  return (seconds / 3600).toFixed(1) + " h ago";
}

function left(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds <= 0 ? "expired" : seconds.toFixed(0) + " s";
}

async function getJson(path) {
  const r = await fetch(path, { cache: "no-store", credentials: "same-origin" });
  if (!r.ok) {
    const body = (await r.text()).trim();
    throw new Error(path + ": HTTP " + r.status + (body ? " – " + body : ""));
  }
  return r.json();
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function renderHeader(o) {
  const n = o.node;
  const f = o.federation;
  setText("policy", f.policy ? "policy " + f.policy + (f.policy_revision ? " (revision " + f.policy_revision + ")" : "") : "no policy applied");
  const leader = n.leader_id === null ? "no leader known" : "leader node " + n.leader_id;
  setText("node", "served by node " + n.node_id + " (" + n.role + "), " + leader);
  const fresh = document.getElementById("fresh");
  fresh.textContent = o.read.follows_leader ? "follows leader" : "may be stale";
  fresh.className = "badge " + (o.read.follows_leader ? "ok" : "warn");
  fresh.title = o.read.note || "applied through log index " + o.read.applied_index;
  setText("updated", "state time " + new Date(o.federation.state_time_ms).toISOString().replace("T", " ").slice(0, 19) + " UTC");
  setText("ov-capacity", fix2(f.capacity_gpus));
  setText("ov-running", fix2(f.running_gpus));
  setText("ov-admitted", fix2(f.admitted_gpus));
  setText("ov-waiting", fix2(f.pending_gpus));
  setText("ov-utilization", pct(f.utilization));
  setText("ov-score", fix2(f.fairness_score));
  document.getElementById("ov-score-card").title = f.score_definition;
  setText("score-definition", f.score_definition);
  setText("ov-revision", f.policy_revision ? String(f.policy_revision) : "–");
  const behind = f.clusters.filter((c) => c.policy_revision !== null && c.policy_revision < f.policy_revision && c.lease !== "fallback").map((c) => c.cluster);
  setText("ov-behind", "behind: " + (behind.length ? behind.join(", ") : "none"));
  document.getElementById("ov-behind").className = "unit" + (behind.length ? " bad" : "");
  setText("ov-leader", n.leader_id === null ? "none" : "node " + n.leader_id);
  setText("ov-term", "term " + n.term);
  setText("ov-clusters", String(o.federation.clusters.length));
  const fallback = o.federation.clusters.filter((c) => c.lease === "fallback").map((c) => c.cluster);
  setText("ov-fallback", "on safe budgets: " + (fallback.length ? fallback.join(", ") : "none"));
  document.getElementById("ov-fallback").className = "unit" + (fallback.length ? " bad" : "");
}

function renderTenants(o) {
  const body = document.querySelector("#tenants tbody");
  const rows = o.federation.tenants.map((t) => {
    const share = t.entitlement_gpus > 0 ? Math.min(t.inuse_gpus / t.entitlement_gpus, 2) : (t.inuse_gpus > 0 ? 2 : 0);
    const bar = el("div", { class: "bar" + (t.inuse_gpus > t.entitlement_gpus + 1e-9 ? " over" : "") });
    bar.style.width = (50 * share).toFixed(1) + "%";
    const below = t.inuse_gpus + 1e-9 < t.guarantee_gpus;
    const wide = (cell) => { cell.classList.add("wide"); return cell; };
    const tr = el(
      "tr",
      { "data-tenant": t.tenant, "data-inuse": t.inuse_gpus, class: (selected === t.tenant ? "selected " : "") + (below ? "starved" : "") },
      el("td", { "data-field": "tenant" }, t.tenant),
      wide(num("weight", t.weight, String(t.weight))),
      num("entitlement_gpus", t.entitlement_gpus),
      num("target_gpus", t.target_gpus),
      num("running_gpus", t.running_gpus),
      num("admitted_gpus", t.admitted_gpus),
      num("pending_gpus", t.pending_gpus),
      wide(num("guarantee_gpus", t.guarantee_gpus)),
      wide(num("decayed_usage_gpu_seconds", t.decayed_usage_gpu_seconds, fix2(t.decayed_usage_gpu_seconds / 3600) + " h")),
      wide(num("drift_ratio", t.drift_ratio, pct(t.drift_ratio))),
      num("fairness_score", t.fairness_score),
      el("td", { class: "barcell wide", title: fix2(t.inuse_gpus) + " in use (running + admitted) of " + fix2(t.entitlement_gpus) + " entitled" }, el("div", { class: "track" }, bar)),
    );
    tr.addEventListener("click", () => {
      selected = selected === t.tenant ? null : t.tenant;
      refreshChart();
      if (last) renderTenants(last);
    });
    return tr;
  });
  body.replaceChildren(...rows);
}

function renderMatrix(o) {
  const clusters = o.federation.clusters;
  const head = el("tr", {}, el("th", {}, "Tenant"));
  for (const c of clusters) {
    head.append(el("th", { "data-cluster": c.cluster, class: c.lease === "fallback" ? "bad" : "" }, c.cluster + (c.lease === "fallback" ? " (safe budgets)" : "")));
  }
  head.append(el("th", {}, "Sum"));
  document.querySelector("#matrix thead").replaceChildren(head);
  const rows = o.federation.tenants.map((t) => {
    const tr = el("tr", { "data-tenant": t.tenant }, el("td", {}, t.tenant));
    let sum = 0;
    for (const c of clusters) {
      const b = t.budgets[c.cluster];
      if (b === undefined) {
        tr.append(el("td", { "data-cluster": c.cluster, class: "num muted" }, "–"));
      } else {
        sum += b;
        tr.append(el("td", { "data-cluster": c.cluster, "data-value": b, class: "num" + (b > 0 ? "" : " muted") }, fix2(b)));
      }
    }
    tr.append(el("td", { "data-field": "sum", "data-value": sum, class: "num" }, fix2(sum)));
    return tr;
  });
  document.querySelector("#matrix tbody").replaceChildren(...rows);
}

const LEASE_WORDS = { none: "no lease yet", fresh: "fresh", expiring: "expiring", fallback: "expired: safe budgets" };

function renderClusters(o) {
  const inForce = o.federation.policy_revision;
  const rows = o.federation.clusters.map((c) => {
    const rev = c.policy_revision;
    const behind = rev !== null && rev < inForce;
    const policy = el("td", { "data-field": "policy_revision", "data-value": rev ?? "", class: "num" + (behind ? " behind" : ""),
      title: behind ? "behind the revision in force (" + inForce + ")" : "" }, rev === null ? "–" : String(rev) + (behind ? " (behind)" : ""));
    const agent = el("td", { "data-field": "agent" }, c.agent_version === null ? "–" : c.agent_version + " (level " + c.agent_feature_level + ")");
    const epoch = num("lease_epoch", c.lease_epoch, String(c.lease_epoch));
    epoch.classList.add("wide");
    return el(
      "tr",
      { "data-cluster": c.cluster, class: "lease-" + c.lease },
      el("td", {}, c.cluster),
      num("capacity_gpus", c.capacity_gpus),
      num("running_gpus", c.running_gpus),
      num("admitted_gpus", c.admitted_gpus),
      num("pending_gpus", c.pending_gpus),
      el("td", { "data-field": "report_age_seconds", "data-value": c.report_age_seconds ?? "" }, ago(c.report_age_seconds)),
      el("td", { "data-field": "lease", "data-value": c.lease }, el("span", { class: "badge lease-" + c.lease }, LEASE_WORDS[c.lease] || c.lease)),
      epoch,
      el("td", { "data-field": "lease_remaining_seconds", class: "num wide" }, left(c.lease_remaining_seconds)),
      policy,
      agent,
    );
  });
  document.querySelector("#clusters tbody").replaceChildren(...rows);
}

// One audit record as a sentence.
function sentence(event) {
  const [kind, e] = Object.entries(event)[0] || ["", {}];
  switch (kind) {
    case "PolicyApplied":
      if (e.changes && e.changes.length === 1 && e.changes[0] === "unchanged")
        return "Policy " + e.name + " applied again unchanged; revision " + e.revision + " stays in force (" + e.tenants + " tenants).";
      return "Policy " + e.name + " came into force" + (e.revision ? " as revision " + e.revision : "") + " (" + e.tenants + " tenants)" +
        (e.changes && e.changes.length ? ": " + e.changes.join("; ") : "") + ".";
    case "ClusterRegistered":
      return "Cluster " + e.cluster + (e.joined ? " joined" : " registered") + " with " + fix2(e.capacity_gpue / 1000) + " GPUs.";
    case "LeaseExpired":
      return "Cluster " + e.cluster + " is cut off: its every lease ran out and it enforces its safe budgets (last report " +
        (e.last_report_ms ? stamp(e.last_report_ms) : "never") + ").";
    case "LeaseRenewed":
      return "Cluster " + e.cluster + " is back after " + (e.cut_off_ms / 1000).toFixed(0) + " s cut off.";
    case "LeaderChanged":
      return "Node " + e.node + " became the leader (term " + e.term + ").";
    case "NodeAdded":
      return "Node " + e.node + " (" + e.rpc_addr + ") joined the control plane as a " + (e.voter ? "voter" : "learner") + ".";
    case "NodeRemoved":
      return "Node " + e.node + " left the control plane.";
    case "NodeRole":
      return "Node " + e.node + " is now a " + (e.voter ? "voter" : "learner") + ".";
    case "SnapshotRestored":
      return "The federation was restored from a backup node " + e.taken_by + " took at " + stamp(e.taken_at_ms) + ".";
    case "ClusterRemoved":
      return "Cluster " + e.cluster + " was removed.";
    case "Eviction": {
      const n = e.note;
      const what = n.outcome === "blocked" ? "could not evict (a PodDisruptionBudget refused)" : "evicted";
      return "In " + e.cluster + ", reclaim " + what + " " + n.victim + " of " + n.victim_tenant + " (" + fix2(n.milli_gpue / 1000) +
        " GPUs) for " + n.for_tenant + "'s " + n.for_pod + ": " + n.why;
    }
    case "BudgetsChanged": {
      const parts = e.changes.map((c) => c.tenant + " " + fix2(c.from / 1000) + " → " + fix2(c.to / 1000) + (c.why ? " (" + c.why + ")" : ""));
      return "Cluster " + e.cluster + " got lease epoch " + e.epoch + ": " + (parts.length ? parts.join("; ") : "budgets renewed") + ".";
    }
    default:
      return kind + ": " + JSON.stringify(e);
  }
}

// The newest 50 records; budget changes only when asked for (they are many).
function auditPath() {
  return "/api/v1/audit?limit=50" + (document.getElementById("audit-budgets").checked ? "&kind=all" : "");
}

function stamp(ms) {
  return new Date(ms).toISOString().replace("T", " ").slice(0, 19);
}

function renderAudit(records) {
  const items = records
    .slice()
    .reverse()
    .map((r) =>
      el(
        "li",
        { "data-seq": r.seq, "data-kind": Object.keys(r.event)[0] || "" },
        el("time", {}, stamp(r.at_ms)),
        " ",
        el("span", { class: "actor" }, r.actor || "–"),
        " ",
        el("span", {}, sentence(r.event)),
      ),
    );
  document.getElementById("audit").replaceChildren(...items);
}

// A line chart of named series over time: [{name, cls, points: [[t, v]]}].
function drawChart(series) {
  const W = 900, H = 220, L = 48, R = 10, T = 10, B = 24;
  const all = series.flatMap((s) => s.points);
  const box = document.getElementById("chart");
  const root = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": document.getElementById("chart-title").textContent });
  if (all.length === 0) {
    box.replaceChildren(el("p", { class: "muted" }, "No samples yet."));
    return;
  }
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]));
  const vmax = Math.max(1, ...all.map((p) => p[1])) * 1.1;
  const x = (t) => L + (t1 === t0 ? (W - L - R) : ((t - t0) / (t1 - t0)) * (W - L - R));
  const y = (v) => T + (1 - v / vmax) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = (vmax * i) / 4;
    root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
    const label = svg("text", { x: L - 6, y: y(v) + 4, class: "axis", "text-anchor": "end" });
    label.textContent = v.toFixed(1);
    root.append(label);
  }
  const span = svg("text", { x: W - R, y: H - 6, class: "axis", "text-anchor": "end" });
  span.textContent = "last " + Math.max(1, Math.round((t1 - t0) / 60000)) + " min";
  root.append(span);
  for (const s of series) {
    const pts = s.points.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ");
    const lastPoint = s.points[s.points.length - 1];
    root.append(svg("polyline", { points: pts, class: "line " + s.cls, "data-series": s.name, "data-last": lastPoint ? lastPoint[1] : "" }));
  }
  box.replaceChildren(root);
  const legend = series.map((s) => {
    const lastPoint = s.points[s.points.length - 1];
    return el("span", { class: "key " + s.cls, "data-series": s.name, "data-value": lastPoint ? lastPoint[1] : "" },
      s.label + ": " + (lastPoint ? fix2(lastPoint[1]) : "–"));
  });
  document.getElementById("legend").replaceChildren(...legend);
}

async function refreshChart() {
  const o = last;
  if (!o) return;
  const path = "/api/v1/history" + (selected ? "?tenant=" + encodeURIComponent(selected) : "");
  let h;
  try {
    h = await getJson(path);
  } catch (e) {
    showError(e);
    return;
  }
  // The newest point is the overview just read, so the chart ends where the tables are.
  const now = o.federation.state_time_ms;
  if (selected) {
    const t = o.federation.tenants.find((x) => x.tenant === selected);
    if (!t) {
      selected = null;
      return refreshChart();
    }
    setText("chart-title", "Tenant " + selected + ": entitlement, target and use");
    const pts = h.points.filter((p) => p.tenant && p.at_ms < now);
    const line = (f) => pts.map((p) => [p.at_ms, p.tenant[f]]).concat([[now, t[f]]]);
    drawChart([
      { name: "entitlement_gpus", label: "Entitled", cls: "s1", points: line("entitlement_gpus") },
      { name: "target_gpus", label: "Target", cls: "s3", points: line("target_gpus") },
      { name: "inuse_gpus", label: "In use (running + admitted)", cls: "s2", points: line("inuse_gpus") },
    ]);
  } else {
    setText("chart-title", "Federation: in use against capacity");
    const pts = h.points.filter((p) => p.at_ms < now);
    const f = o.federation;
    drawChart([
      { name: "capacity_gpus", label: "Capacity", cls: "s1", points: pts.map((p) => [p.at_ms, p.capacity_gpus]).concat([[now, f.capacity_gpus]]) },
      { name: "inuse_gpus", label: "In use (running + admitted)", cls: "s2", points: pts.map((p) => [p.at_ms, p.inuse_gpus]).concat([[now, f.inuse_gpus]]) },
    ]);
  }
}

function showError(e) {
  const p = document.getElementById("error");
  p.textContent = "Could not read the federation: " + (e && e.message ? e.message : e);
  p.hidden = false;
  const fresh = document.getElementById("fresh");
  fresh.textContent = "disconnected";
  fresh.className = "badge bad";
}

async function refresh() {
  try {
    const [o, audit] = await Promise.all([getJson("/api/v1/overview"), getJson(auditPath())]);
    last = o;
    document.getElementById("error").hidden = true;
    renderHeader(o);
    renderTenants(o);
    renderMatrix(o);
    renderClusters(o);
    renderAudit(audit);
    await refreshChart();
    document.body.setAttribute("data-loaded", "true");
    // Whether the page is wider than the window (each wide table scrolls in its own box).
    document.body.setAttribute("data-overflow-x", String(document.documentElement.scrollWidth > window.innerWidth));
  } catch (e) {
    showError(e);
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

const VERDICT_WORDS = { allow: "admitted", queue: "queued behind the gate", deny: "denied" };

async function explainPod() {
  const pod = document.getElementById("pod-q").value.trim();
  const cluster = document.getElementById("pod-cluster").value.trim();
  const out = document.getElementById("pod-result");
  if (!/^[^/\s]+\/[^/\s]+$/.test(pod)) {
    out.replaceChildren(el("p", { class: "error" }, "Give the pod as namespace/name, as in its admission message."));
    return;
  }
  history.replaceState(null, "", "#pod=" + encodeURIComponent(pod) + (cluster ? "&cluster=" + encodeURIComponent(cluster) : ""));
  out.replaceChildren(el("p", { class: "muted" }, "Asking…"));
  let r;
  try {
    r = await getJson("/api/v1/decisions?pod=" + encodeURIComponent(pod) + (cluster ? "&cluster=" + encodeURIComponent(cluster) : ""));
  } catch (e) {
    out.replaceChildren(el("p", { class: "error" }, String(e.message || e)));
    return;
  }
  if (!r.kept) {
    out.replaceChildren(el("p", { class: "muted" }, "This federation keeps no decisions yet: every control-plane node must run a kvota that supports feature level 2."));
    return;
  }
  if (r.decisions.length === 0) {
    out.replaceChildren(el("p", { class: "muted" }, "No agent has reported a decision about " + pod + (cluster ? " in " + cluster : "") +
      ": not judged, not reported yet, or judged more than 512 decisions ago."));
    return;
  }
  const now = last ? last.federation.state_time_ms : Date.now();
  // A stamp before 2001 is the agent's own clock since it started, not a time of day.
  const when = (at) => at < 978307200000 ? (at / 1000).toFixed(0) + " s after its agent started" : ago(Math.max(0, now - at) / 1000);
  out.replaceChildren(...r.decisions.map((d) =>
    el("div", { class: "decision verdict-" + d.verdict, "data-pod-cluster": d.cluster, "data-verdict": d.verdict },
      el("h3", {}, d.pod + " in " + d.cluster + ": " + (VERDICT_WORDS[d.verdict] || d.verdict) + " (" + fix2(d.gpus) + " GPUs, tenant " + d.tenant + ", " + when(d.at_ms) + ")"),
      el("pre", {}, d.text))));
}

function searchFromHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  if (!params.get("pod")) return;
  document.getElementById("pod-q").value = params.get("pod");
  document.getElementById("pod-cluster").value = params.get("cluster") || "";
  explainPod();
}

document.getElementById("pod-go").addEventListener("click", explainPod);
document.getElementById("audit-budgets").addEventListener("change", () => {
  getJson(auditPath()).then(renderAudit, showError);
});
for (const id of ["pod-q", "pod-cluster"]) {
  document.getElementById(id).addEventListener("keydown", (e) => { if (e.key === "Enter") explainPod(); });
}
window.addEventListener("hashchange", searchFromHash);
searchFromHash();
refresh();
