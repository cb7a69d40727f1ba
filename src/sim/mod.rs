//! A deterministic simulation of two tasks' transports with faults
//! (`--features sim`; `rdma-device-sim` runs it). The real protocol state
//! machines (`Rendezvous`) and the real call channel (`node::rpc::Rpc`) of
//! two nodes run over a simulated fabric: links carry control messages in
//! order per direction, write doorbells apart from them (shm orders the
//! two independently), writes complete in any order (two write threads),
//! chunk copies in any order, callbacks one by one (`rdev-callbacks`).
//! One seed fixes the workload and every choice the simulation makes (the
//! protocol iterates std hash maps, whose random seeds can still change
//! the order of one event's actions between runs).
//!
//! Workload: per step, tensors both ways (empty, small, medium, and larger
//! than the arena, so streamed), receives posted before or after the
//! send, received tensors held a while then released, and one call from a
//! to b of up to three parts. Faults (the second schedule of each seed):
//! a link lost at any point (reconnected later), task b crashed and
//! restarted (a new incarnation; the dead one's late doorbells delivered
//! to the new one), step aborts, cancelled receives, cancelled calls and
//! passed deadlines.
//!
//! Invariants, checked after every event: a callback (send, receive, call)
//! runs at most once, and, once everything drained, exactly once (a
//! crashed task's own are exempt: that process is gone); a send's payload
//! is never read after its `done`; a received tensor holds the bytes sent
//! for its key and step until it is released; a call is served only with
//! its whole body; the arena never holds more than its size; the protocol
//! never closes a link on its own (a protocol error) in a schedule
//! without faults.
//!
//! Not simulated: real NIC timing, kernel behaviour, the node's threads
//! and pools (the schedule tests explore the call channel's, and the jobs
//! of streamed and written tensors: `node::stream::sched_tests`), and
//! waits (the node's waits carry their deadlines; nothing here blocks).
//!
//! Files: the run and its report here; the simulated tasks' callbacks and
//! payloads (`callbacks`), their call channel's wire and b's server
//! (`calls`); the world that runs the events (`world`) and the faults it
//! injects (`world::faults`).

use std::sync::Arc;

use parking_lot::Mutex;

use world::World;

mod callbacks;
mod calls;
mod world;

const ARENA: usize = 4 << 20;
const NAMES: [&str; 2] = ["/job:worker/replica:0/task:0", "/job:ps/replica:0/task:0"];

/// What one run found.
#[derive(Default, Debug)]
pub struct Report {
    pub seeds: u64,
    pub schedules: u64,
    pub events: u64,
    /// Received intact; receives failed; calls answered; calls failed;
    /// faults injected.
    pub delivered: u64,
    pub recv_failed: u64,
    pub calls_ok: u64,
    pub calls_failed: u64,
    pub faults: u64,
    /// (seed, schedule, what).
    pub violations: Vec<(u64, u32, String)>,
}

/// Run `seeds` seeds from `first`, each under two schedules (reordered
/// only; reordered with faults), `steps` steps each.
pub fn run(first: u64, seeds: u64, steps: u64) -> Report {
    let mut r = Report::default();
    for seed in first..first + seeds {
        for faults in [false, true] {
            let (c, v) = run_one(seed, faults, steps);
            r.events += c.events;
            r.delivered += c.delivered;
            r.recv_failed += c.recv_failed;
            r.calls_ok += c.calls_ok;
            r.calls_failed += c.calls_failed;
            r.faults += c.faults;
            r.schedules += 1;
            r.violations.extend(v.into_iter().map(|m| (seed, faults as u32, m)));
        }
        r.seeds += 1;
    }
    r
}

/// What one schedule did.
#[derive(Default, Debug, Clone, Copy)]
pub struct Counts {
    pub events: u64,
    pub delivered: u64,
    pub recv_failed: u64,
    pub calls_ok: u64,
    pub calls_failed: u64,
    pub faults: u64,
}

/// One schedule; returns what it did and the violations seen.
pub fn run_one(seed: u64, faults: bool, steps: u64) -> (Counts, Vec<String>) {
    let v: Violations = Arc::new(Mutex::new(Vec::new()));
    let res = crate::error::catch_panic("the simulation", || {
        let mut w = World::new(seed, faults, steps, v.clone());
        w.run();
        let mut c = *w.counts.lock();
        c.events = w.events;
        c
    });
    let events = match res {
        Ok(c) => c,
        Err(e) => {
            v.lock().push(format!("panic: {e}"));
            Counts::default()
        }
    };
    let out = std::mem::take(&mut *v.lock());
    (events, out)
}

type Violations = Arc<Mutex<Vec<String>>>;

fn flag(v: &Violations, m: String) {
    let mut g = v.lock();
    if g.len() < 20 {
        g.push(m);
    }
}

/// The bytes task `from` sends for `key` in `step`.
fn pattern(from: usize, key: &str, step: u64, len: usize) -> Vec<u8> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ (from as u64) ^ (step << 8);
    for b in key.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    (0..len).map(|i| ((h >> (i % 8 * 8)) as u8).wrapping_add(i as u8)).collect()
}
