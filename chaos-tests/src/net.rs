//! The simulated network between agents and control-plane nodes.
//!
//! Modelled, not real: messages are values in a queue with a delivery time. Each message
//! is lost with the current loss probability when sent, delayed uniformly in the current
//! delay range (so messages on one link overtake each other: reordering), and dropped at
//! delivery if its link is cut *at that moment*. Links are one-way: a partition is a set
//! of cut `(from, to)` pairs, so one-way partitions are just half of a two-way one.

use std::collections::BTreeSet;

use crate::rng::Rng;

/// A host on the simulated network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Addr {
    /// Control-plane node by index.
    Cp(usize),
    /// Member agent by index.
    Agent(usize),
}

/// Network conditions the nemesis can change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conditions {
    /// Per-message loss, percent.
    pub loss_pct: u64,
    /// Smallest delivery delay.
    pub min_delay_ms: u64,
    /// Largest delivery delay.
    pub max_delay_ms: u64,
}

impl Conditions {
    /// A healthy datacenter network: no loss, 1-20 ms.
    pub const CALM: Conditions = Conditions {
        loss_pct: 0,
        min_delay_ms: 1,
        max_delay_ms: 20,
    };
}

#[derive(Debug)]
struct InFlight<M> {
    at_ms: u64,
    order: u64,
    from: Addr,
    to: Addr,
    msg: M,
}

/// The network: in-flight messages and cut links.
#[derive(Debug)]
pub struct Net<M> {
    queue: Vec<InFlight<M>>,
    order: u64,
    cut: BTreeSet<(Addr, Addr)>,
    /// Current conditions.
    pub conditions: Conditions,
    /// Messages sent, lost at send, dropped at a cut link, delivered.
    pub stats: NetStats,
}

/// Counters for the run summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Messages handed to the network.
    pub sent: u64,
    /// Lost at send.
    pub lost: u64,
    /// Dropped at delivery because the link was cut.
    pub cut: u64,
    /// Delivered.
    pub delivered: u64,
}

impl<M> Net<M> {
    /// An empty, healthy network.
    pub fn new() -> Net<M> {
        Net {
            queue: Vec::new(),
            order: 0,
            cut: BTreeSet::new(),
            conditions: Conditions::CALM,
            stats: NetStats::default(),
        }
    }

    /// Sends `msg` at `now_ms`: lost, or delivered after a random delay.
    pub fn send(&mut self, rng: &mut Rng, now_ms: u64, from: Addr, to: Addr, msg: M) {
        self.stats.sent += 1;
        if rng.chance(self.conditions.loss_pct) {
            self.stats.lost += 1;
            return;
        }
        let delay = rng.range(self.conditions.min_delay_ms, self.conditions.max_delay_ms);
        self.order += 1;
        self.queue.push(InFlight {
            at_ms: now_ms + delay,
            order: self.order,
            from,
            to,
            msg,
        });
    }

    /// Messages due at `now_ms` on links that are up, in delivery order.
    pub fn due(&mut self, now_ms: u64) -> Vec<(Addr, Addr, M)> {
        let mut due = Vec::new();
        let mut keep = Vec::with_capacity(self.queue.len());
        for m in self.queue.drain(..) {
            if m.at_ms <= now_ms {
                due.push(m);
            } else {
                keep.push(m);
            }
        }
        self.queue = keep;
        due.sort_by_key(|m| (m.at_ms, m.order));
        let mut out = Vec::with_capacity(due.len());
        for m in due {
            if self.cut.contains(&(m.from, m.to)) {
                self.stats.cut += 1;
            } else {
                self.stats.delivered += 1;
                out.push((m.from, m.to, m.msg));
            }
        }
        out
    }

    /// Messages still in flight.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }

    /// Cuts the one-way link `from -> to`.
    pub fn cut(&mut self, from: Addr, to: Addr) {
        self.cut.insert((from, to));
    }

    /// Restores the one-way link `from -> to`.
    pub fn heal(&mut self, from: Addr, to: Addr) {
        self.cut.remove(&(from, to));
    }

    /// Restores every link.
    pub fn heal_all(&mut self) {
        self.cut.clear();
    }

    /// Whether `from -> to` is up.
    pub fn up(&self, from: Addr, to: Addr) -> bool {
        !self.cut.contains(&(from, to))
    }

    /// Whether both directions between `a` and `b` are up.
    pub fn both_up(&self, a: Addr, b: Addr) -> bool {
        self.up(a, b) && self.up(b, a)
    }
}

impl<M> Default for Net<M> {
    fn default() -> Self {
        Net::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_way_cuts_drop_at_delivery_and_delays_reorder() {
        let mut rng = Rng::new(3);
        let mut net: Net<u32> = Net::new();
        net.conditions = Conditions {
            loss_pct: 0,
            min_delay_ms: 0,
            max_delay_ms: 500,
        };
        net.cut(Addr::Agent(0), Addr::Cp(0));
        for i in 0..50 {
            net.send(&mut rng, 0, Addr::Agent(0), Addr::Cp(0), i);
            net.send(&mut rng, 0, Addr::Cp(0), Addr::Agent(0), 100 + i);
        }
        let got: Vec<u32> = net.due(1_000).into_iter().map(|(_, _, m)| m).collect();
        assert!(got.iter().all(|&m| m >= 100), "the cut direction delivers nothing");
        assert_eq!(got.len(), 50, "the other direction delivers everything");
        assert!(got.windows(2).any(|w| w[0] > w[1]), "random delays reorder");
        assert_eq!(net.stats.cut, 50);
        assert_eq!(net.in_flight(), 0);
    }
}
