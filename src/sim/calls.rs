//! The call channel's wire in the simulation (`SimWire`: messages, jobs
//! for `rdev-callbacks` and failed links queue for the world to carry
//! out) and b's server (`Echo`).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::callbacks::Pending;
use super::{flag, pattern, Violations};
use crate::error::{Error, Result};
use crate::fabric::ConnId;
use crate::node::rpc::{Server, Wire};
use crate::rendezvous::Msg;

pub(super) enum Out {
    Msg(ConnId, Vec<u8>),
    Later(Box<dyn FnOnce() + Send>),
    Fail(ConnId),
}

pub(super) struct SimWire {
    pub(super) name: &'static str,
    /// The link this task dialled to the other (calls go over it).
    pub(super) dialled: Mutex<Option<ConnId>>,
    pub(super) alive: Arc<Mutex<HashMap<ConnId, bool>>>,
    pub(super) out: Mutex<Vec<Out>>,
}

impl Wire for SimWire {
    fn task(&self) -> &str {
        self.name
    }
    fn call_link(&self, _peer: &str) -> Option<ConnId> {
        let l = (*self.dialled.lock())?;
        self.alive.lock().get(&l).copied().unwrap_or(false).then_some(l)
    }
    fn send(&self, link: ConnId, msg: &Msg) -> Result<()> {
        if !self.alive.lock().get(&link).copied().unwrap_or(false) {
            return Err(Error::PeerLost(format!("connection {link} is closed")));
        }
        self.out.lock().push(Out::Msg(link, msg.encode().to_vec()));
        Ok(())
    }
    fn fail_link(&self, link: ConnId, _why: Error) {
        self.out.lock().push(Out::Fail(link));
    }
    fn later(&self, f: Box<dyn FnOnce() + Send>) {
        self.out.lock().push(Out::Later(f));
    }
    fn backlog(&self, _link: ConnId) -> usize {
        0
    }
    fn start_pacing(&self) {
        // The workload's bodies are at most three parts: nothing is paced.
        unreachable!("a body of more than DIRECT_PARTS parts in the simulation")
    }
}

/// b's server: answers every call with its body reversed, after checking
/// that the body is whole.
pub(super) struct Echo {
    pub(super) v: Violations,
    /// (handle, body) of calls to answer (the world answers them later).
    pub(super) pending: Pending,
}

pub(super) fn call_body(id: u64, len: usize) -> Vec<u8> {
    let mut b = pattern(9, "call", id, len.max(16));
    b[..8].copy_from_slice(&(len.max(16) as u64).to_le_bytes());
    b[8..16].copy_from_slice(&id.to_le_bytes());
    b
}

impl Server for Echo {
    fn call(&self, handle: u64, _method: u32, body: Vec<u8>) {
        let whole = body.len() >= 16 && {
            let len = u64::from_le_bytes(body[..8].try_into().unwrap_or_default()) as usize;
            let id = u64::from_le_bytes(body[8..16].try_into().unwrap_or_default());
            len == body.len() && body == call_body(id, len)
        };
        if !whole {
            flag(&self.v, format!("a call served with a body of {} bytes that is not a whole call", body.len()));
        }
        self.pending.lock().push((handle, body));
    }
    fn cancel(&self, _handle: u64) {}
}
