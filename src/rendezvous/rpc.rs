//! `RDMA_DEVICE_MODE=rpc`, the RPC-over-RDMA ablation: a receive requests
//! its tensor with `Msg::Request` (one round trip), and the sender's pump
//! (tx.rs) writes only requested tensors. Everything else is the push
//! mode's: the same copier writes the tensor once into the slot the
//! receiver placed, and TensorFlow gets it there; so the two modes differ
//! by exactly that round trip, the one thing receiver placement removes.

use super::{smallvec, Actions, Action, LinkId, Rendezvous};
use crate::error::{Error, Result};
use crate::rendezvous::wire::Msg;

/// rpc mode: requests one edge may have outstanding, and edges a peer's
/// requests may create on one link (a hostile receiver cannot grow our
/// state without bound).
pub(super) const MAX_REQUESTS_PER_EDGE: usize = 4096;
const MAX_REQUESTED_EDGES: usize = 1 << 16;

impl Rendezvous {
    /// rpc mode: ask `peer` for `(key, step)` now, or when it connects.
    pub(super) fn request(&mut self, peer: &str, key: &str, step: u64) -> Actions {
        self.tally.requests_sent += 1;
        let msg = Msg::Request { key: key.to_string(), step };
        // The newest link from the peer (a restarted peer's old link goes
        // away with its disconnect).
        let ready = &self.ready_links;
        match self.rx.iter().filter(|(l, r)| r.peer == peer && ready.contains(l)).map(|(l, _)| *l).max() {
            Some(link) => smallvec![Action::Send { link, msg }],
            None => {
                self.unsent_requests.entry(peer.to_string()).or_default().push((key.to_string(), step));
                Actions::new()
            }
        }
    }

    /// rpc mode: the sender on `link` says the link is up: requests made
    /// before go out on it now.
    pub(super) fn rx_ready(&mut self, link: LinkId) -> Actions {
        let Some(peer) = self.rx.get(&link).map(|r| r.peer.clone()) else { return Actions::new() };
        self.ready_links.insert(link);
        let reqs = self.unsent_requests.remove(&peer).unwrap_or_default();
        reqs.into_iter().map(|(key, step)| Action::Send { link, msg: Msg::Request { key, step } }).collect()
    }

    /// rpc mode: the receiver's `Recv` of `(key, step)` is running.
    pub(super) fn tx_request(&mut self, link: LinkId, key: String, step: u64) -> Result<Actions> {
        if !self.params.rpc {
            return Err(Error::NotViable(
                "the receiver requests tensors (RDMA_DEVICE_MODE=rpc) but this task pushes them: set the same mode on every task".into(),
            ));
        }
        if self.finished_set.contains(&step) {
            return Ok(Actions::new());
        }
        let t = self.tx.get_mut(&link).ok_or_else(|| Error::Internal("request on unknown link".into()))?;
        if !t.edges.contains_key(key.as_str()) && t.edges.len() >= MAX_REQUESTED_EDGES {
            return Err(Error::Protocol(format!("more than {MAX_REQUESTED_EDGES} edges requested")));
        }
        let e = t.edges.entry(std::sync::Arc::from(key.as_str())).or_default();
        if e.requested.len() >= MAX_REQUESTS_PER_EDGE {
            return Err(Error::Protocol(format!("more than {MAX_REQUESTS_PER_EDGE} outstanding requests for {key}")));
        }
        if e.requested.insert(step) {
            t.requests += 1;
        }
        Ok(self.pump(link, &key))
    }

}
