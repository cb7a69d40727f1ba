//! The handshake payload (`Hello`), both directions: it opens every
//! connection, so it checks the magic and the protocol version first.

use super::{R, W};
use crate::constants::{MAGIC, PROTOCOL_VERSION};
use crate::error::{Error, Result};

/// Handshake payload, both directions: who I am, in which life, and (from
/// the connecting sender) whom it means to reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub task: String,
    pub incarnation: u64,
    /// Sender → receiver: the task the sender expects; empty in replies.
    pub target: String,
    /// `RDMA_DEVICE_MODE=rpc` on this task (both ends must agree).
    pub rpc: bool,
    /// Proof of the cluster token (`proof::hello`/`proof::reply`; empty
    /// without a token).
    pub proof: Vec<u8>,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W::new();
        w.u32(MAGIC); w.u32(PROTOCOL_VERSION);
        w.bytes(self.task.as_bytes()); w.u64(self.incarnation); w.bytes(self.target.as_bytes());
        w.u8(self.rpc as u8);
        w.bytes(&self.proof);
        w.done().into_vec()
    }

    pub fn decode(b: &[u8]) -> Result<Hello> {
        let mut r = R::new(b);
        if r.u32()? != MAGIC {
            return Err(Error::Protocol("handshake is not from rdma_device (bad magic)".into()));
        }
        let v = r.u32()?;
        if v != PROTOCOL_VERSION {
            return Err(Error::Protocol(format!("peer speaks protocol version {v}, we speak {PROTOCOL_VERSION}: use the same rdma_device build on every task")));
        }
        let task = r.string()?; let incarnation = r.u64()?; let target = r.string()?;
        let rpc = match r.u8()? {
            0 => false,
            1 => true,
            m => return Err(Error::Protocol(format!("unknown transport mode {m} in handshake"))),
        };
        let proof = r.bytes(64)?.to_vec();
        r.end()?;
        Ok(Hello { task, incarnation, target, rpc, proof })
    }
}
