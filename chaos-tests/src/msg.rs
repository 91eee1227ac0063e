//! What travels between agents and control-plane nodes.

use kvota_fairness::federation::Command;
use kvota_fairness::lease::Lease;
use kvota_fairness::policy::Policy;

/// One message on the simulated network.
#[derive(Clone, Debug)]
pub enum Msg {
    /// An agent's request (registration or usage report) to a control-plane node.
    Request(AgentRequest),
    /// A control-plane answer to an agent.
    Answer(AgentAnswer),
    /// An agent asks what a node's applied state knows of its cluster
    /// (`DescribeCluster`: any node answers from its own state, at once).
    Describe {
        /// Asking agent.
        agent: usize,
        /// Agent clock when it asked (copied into the answer).
        sent_agent_ms: u64,
    },
}

/// An agent's request; answered only after the command is committed and applied.
#[derive(Clone, Debug)]
pub struct AgentRequest {
    /// Sending agent.
    pub agent: usize,
    /// Agent clock when it sent the request: the lease's anchor.
    pub sent_agent_ms: u64,
    /// `RegisterCluster` or `Report`.
    pub command: Command,
    /// Forwarded once by a follower (a forwarded request is never forwarded again, as
    /// in `control-plane/src/service.rs`).
    pub forwarded: bool,
}

/// The control plane's answer.
#[derive(Clone, Debug)]
pub struct AgentAnswer {
    /// The node that answered (the agent talks to it next).
    pub from_node: usize,
    /// Anchor copied from the request.
    pub sent_agent_ms: u64,
    /// What the state machine said.
    pub outcome: AnswerOutcome,
}

/// The state machine's answer, as the gRPC layer maps it.
#[derive(Clone, Debug)]
pub enum AnswerOutcome {
    /// Registered or reported: the lease, the report's sequence number (None for a
    /// registration), and the policy in force (the real agent fetches it with
    /// `GetPolicy`; here it rides along).
    Lease {
        /// The lease.
        lease: Lease,
        /// Report sequence answered.
        seq: Option<u64>,
        /// Policy in force.
        policy: Option<Box<Policy>>,
        /// The report was counted now (false: a duplicate sequence number).
        applied: bool,
        /// The cluster's last applied report sequence and where its counted usage ends
        /// (wall clock; 0: nowhere yet): what `DescribeCluster` tells a standby that
        /// takes over.
        last_seq: u64,
        /// See `last_seq`.
        reported_through_ms: u64,
    },
    /// `FAILED_PRECONDITION` with `kvota-expected-seq`.
    SequenceGap {
        /// The report's sequence.
        seq: u64,
        /// What the control plane expects next.
        expected: u64,
    },
    /// Any other refusal.
    Refused(String),
    /// What the node's applied state knows of the cluster (`DescribeCluster`).
    Described {
        /// The last report sequence applied.
        last_seq: u64,
        /// Up to when the cluster's usage is counted (agent wall clock; 0: nowhere).
        reported_through_ms: u64,
    },
}
