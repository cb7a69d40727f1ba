//! The cluster token in the handshake (`RDMA_DEVICE_CLUSTER_TOKEN`): each
//! side proves it knows the token without sending it, by an HMAC-SHA256
//! over what identifies the connection. The receiver opens every
//! connection with a fresh random nonce (shm: a challenge frame; verbs:
//! the accept's private data). The sender's proof covers its task, the
//! task it expects, its incarnation and that nonce, so a hello recorded on
//! one connection proves nothing on another; the receiver's reply covers
//! its own task and the sender's proof, so a reply cannot be lifted from
//! another connection either. Checked in constant time.
//!
//! What it does: a process that does not know the token cannot open a
//! connection to a task (its writes and messages never reach the
//! protocol), cannot replay another connection's handshake, and cannot
//! pose as a receiver to a sender. What it does not do: encrypt or
//! authenticate what follows the handshake (an attacker who can inject
//! into an established connection is outside it).

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

fn mac(token: &str, parts: &[&[u8]]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(token.as_bytes()).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m
}

fn hello_mac(token: &str, task: &str, target: &str, incarnation: u64, nonce: &[u8]) -> HmacSha256 {
    mac(token, &[b"rdma_device hello", task.as_bytes(), target.as_bytes(), &incarnation.to_le_bytes(), nonce])
}

fn reply_mac(token: &str, task: &str, hello_proof: &[u8]) -> HmacSha256 {
    mac(token, &[b"rdma_device reply", task.as_bytes(), hello_proof])
}

/// The sender's proof for the connection the receiver opened with `nonce`
/// (empty without a token).
pub fn hello(token: &str, task: &str, target: &str, incarnation: u64, nonce: &[u8]) -> Vec<u8> {
    if token.is_empty() {
        return Vec::new();
    }
    hello_mac(token, task, target, incarnation, nonce).finalize().into_bytes().to_vec()
}

/// The receiver's proof, answering the sender's `hello_proof`.
pub fn reply(token: &str, task: &str, hello_proof: &[u8]) -> Vec<u8> {
    if token.is_empty() {
        return Vec::new();
    }
    reply_mac(token, task, hello_proof).finalize().into_bytes().to_vec()
}

fn refused(who: &str) -> Error {
    Error::NotViable(format!(
        "{who} does not prove this cluster's token: set the same RDMA_DEVICE_CLUSTER_TOKEN on every task"
    ))
}

/// Receiver: check a sender's proof on the connection it opened with
/// `nonce` (nothing to check without a token). A receiver must never take
/// a proof for a nonce it did not just issue on that connection.
pub fn check_hello(token: &str, task: &str, target: &str, incarnation: u64, nonce: &[u8], proof: &[u8]) -> Result<()> {
    if token.is_empty() {
        return Ok(());
    }
    if nonce.len() < crate::fabric::NONCE_LEN {
        return Err(Error::Internal(format!("a connection's nonce of {} bytes (want {})", nonce.len(), crate::fabric::NONCE_LEN)));
    }
    hello_mac(token, task, target, incarnation, nonce).verify_slice(proof).map_err(|_| refused(task))
}

/// Sender: check the receiver's reply to our `hello_proof`.
pub fn check_reply(token: &str, task: &str, hello_proof: &[u8], proof: &[u8]) -> Result<()> {
    if token.is_empty() {
        return Ok(());
    }
    reply_mac(token, task, hello_proof).verify_slice(proof).map_err(|_| refused(task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_check_only_with_the_same_token_and_connection() {
        let (n1, n2) = ([1u8; 16], [2u8; 16]);
        let p = hello("s3cret", "/job:a/task:0", "/job:b/task:0", 7, &n1);
        assert_eq!(p.len(), 32);
        check_hello("s3cret", "/job:a/task:0", "/job:b/task:0", 7, &n1, &p).unwrap();
        for (tok, task, target, inc, nonce) in [
            ("other", "/job:a/task:0", "/job:b/task:0", 7, &n1),
            ("s3cret", "/job:x/task:0", "/job:b/task:0", 7, &n1),
            ("s3cret", "/job:a/task:0", "/job:c/task:0", 7, &n1),
            ("s3cret", "/job:a/task:0", "/job:b/task:0", 8, &n1),
            // A hello recorded on another connection (another nonce).
            ("s3cret", "/job:a/task:0", "/job:b/task:0", 7, &n2),
        ] {
            let e = check_hello(tok, task, target, inc, nonce, &p).unwrap_err();
            assert!(matches!(e, Error::NotViable(_)) && e.to_string().contains("RDMA_DEVICE_CLUSTER_TOKEN"), "{e}");
        }
        assert!(check_hello("s3cret", "/job:a/task:0", "/job:b/task:0", 7, &n1, &[]).is_err(), "no proof passed");
        assert!(check_hello("s3cret", "/job:a/task:0", "/job:b/task:0", 7, &n1, &p[..31]).is_err(), "a short proof passed");
        assert!(check_hello("s3cret", "/job:a/task:0", "/job:b/task:0", 7, &[], &hello("s3cret", "/job:a/task:0", "/job:b/task:0", 7, &[])).is_err(), "no nonce passed");
        let r = reply("s3cret", "/job:b/task:0", &p);
        check_reply("s3cret", "/job:b/task:0", &p, &r).unwrap();
        let other = hello("s3cret", "/job:a/task:0", "/job:b/task:0", 7, &n2);
        assert!(check_reply("s3cret", "/job:b/task:0", &other, &r).is_err(), "a reply to another hello passed");
        // No token: nothing is proved or checked.
        assert!(hello("", "a", "b", 1, &n1).is_empty());
        check_hello("", "a", "b", 1, &[], &[]).unwrap();
        check_reply("", "b", &[], &[]).unwrap();
    }
}
