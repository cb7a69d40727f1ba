//! Probing links that have work waiting on their peer (`rdev-keepalive`,
//! one thread per node). A peer whose process dies is noticed at once (its
//! connection closes), but one whose host vanishes (power, kernel panic, a
//! cable) answers nothing, and RDMA notices only when something is sent to
//! it. So every `KEEPALIVE_INTERVAL_MS` the node sends a `Msg::Ping` on each
//! link with sends queued or writes outstanding, and on every link with a
//! peer that receives wait for: a vanished host then fails them within
//! that interval plus the transport's retry bound (verbs: 4.096 µs ×
//! 2^ACK_TIMEOUT × (RETRY_COUNT + 1)), instead of never. Idle links are
//! not probed. The same tick fails worker calls past their deadline
//! (rpc.rs), fails what waits for a route pending past its deadline
//! (routes.rs) and ends steps idle for `IDLE_STEP_LINGER_MS` (idle.rs).

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::Inner;
use crate::constants::KEEPALIVE_INTERVAL_MS;
use crate::error::Error;
use crate::rendezvous::Msg;

pub(super) struct Keepalive {
    /// Set when the node goes: the thread ends at once.
    stop: Arc<(Mutex<bool>, Condvar)>,
}

impl Keepalive {
    pub(super) fn start(node: Weak<Inner>) -> Keepalive {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let s = stop.clone();
        let spawned = std::thread::Builder::new().name("rdev-keepalive".into()).spawn(move || {
            let every = Duration::from_millis(KEEPALIVE_INTERVAL_MS);
            // Kept from probe to probe: a steady state allocates nothing.
            let (mut peers, mut links, mut steps) = (Vec::with_capacity(16), Vec::with_capacity(16), Vec::with_capacity(64));
            loop {
                {
                    let until = Instant::now() + every;
                    let mut g = s.0.lock();
                    while !*g {
                        if s.1.wait_until(&mut g, until).timed_out() {
                            break;
                        }
                    }
                    if *g {
                        return;
                    }
                }
                let Some(n) = node.upgrade() else { return };
                if crate::error::catch_panic("probing links", || probe(&n, &mut peers, &mut links, &mut steps)).is_err() {
                    log::error!("{}: probing links panicked; probing goes on", n.task);
                }
            }
        });
        if let Err(e) = spawned {
            log::warn!("cannot start the rdev-keepalive thread ({e}): a vanished host is noticed only when something is sent to it, and an idle step ends only when TensorFlow cleans it up or {} others are idle", crate::constants::IDLE_STEPS_MAX);
        }
        Keepalive { stop }
    }
}

fn probe(n: &Inner, peers: &mut Vec<Arc<str>>, links: &mut Vec<u64>, steps: &mut Vec<u64>) {
    let now = Instant::now();
    n.rpc_expire(now);
    n.expire_routes(now);
    n.end_idle_steps(now, steps);
    n.locked(|r| r.links_to_probe(peers, links));
    if !links.is_empty() {
        log::debug!("{}: probing connections {links:?}", n.task);
    }
    for &link in links.iter() {
        match n.send_msg(link, &Msg::Ping) {
            Ok(()) => {}
            // A queue full of work for the peer: the link is busy, not
            // vanished (a vanished peer fails that work within the retry
            // bound on its own).
            Err(Error::ResourceExhausted(_)) => log::debug!("{}: probing connection {link}: its queue is full", n.task),
            Err(e) => n.fail_link(link, Error::PeerLost(format!("{}: probing connection {link}: {}", n.task, e.message()))),
        }
    }
}

impl Drop for Keepalive {
    fn drop(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
    }
}
