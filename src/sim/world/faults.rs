//! The faults the world injects (the second schedule of each seed): a
//! link lost, task b crashed and restarted, step aborts, cancelled
//! receives and calls, passed deadlines.

use std::time::{Duration, Instant};

use super::{Mem, Op, Work, World};
use crate::error::Error;
use crate::fabric::ConnId;
use crate::sim::flag;

impl World {
    pub(super) fn fault(&mut self) {
        self.faults_left -= 1;
        self.counts.lock().faults += 1;
        match self.rand() % 7 {
            0 => {
                // A link lost at any point.
                let live: Vec<ConnId> = self.alive.lock().iter().filter(|(_, a)| **a).map(|(l, _)| *l).collect();
                if !live.is_empty() {
                    let mut live = live;
                    live.sort_unstable();
                    let l = live[(self.rand() % live.len() as u64) as usize];
                    self.lose_link(l);
                }
            }
            1 => self.restart(1),
            2 | 6 => {
                let step = self.current_step();
                let n = (self.rand() % 2) as usize;
                // Told to the peer or not (TF's abort of a step may reach
                // each task on its own).
                let propagate = self.rand() % 2 == 0;
                let acts = self.nodes[n].rdv.abort_step(step, Error::Aborted(format!("step {step} aborted (fault)")), propagate);
                self.exec(n, acts);
            }
            3 => {
                let step = self.current_step();
                let (n, e) = ((self.rand() % 2) as usize, self.rand() % 3);
                let key = format!("edge{e}:{}", 1 - n);
                let acts = self.nodes[n].rdv.cancel_recv(&key, step, Error::Aborted("receive cancelled (fault)".into()));
                self.exec(n, acts);
            }
            4 => {
                if let Some(&id) = self.calls.last() {
                    let (rpc, w) = (self.nodes[0].rpc.clone(), self.nodes[0].wire.clone());
                    rpc.cancel(&*w, id);
                    self.drain_wire(0);
                }
            }
            5 => {
                let (rpc, w) = (self.nodes[0].rpc.clone(), self.nodes[0].wire.clone());
                rpc.expire(&*w, Instant::now() + Duration::from_secs(2));
                self.drain_wire(0);
            }
            _ => unreachable!("a fault kind below 7"),
        }
    }

    /// The step the workload is at (faults aim at it).
    fn current_step(&self) -> u64 {
        match self.ops.front() {
            Some(Op::Send { step, .. } | Op::Recv { step, .. }) => *step,
            _ => self.steps,
        }
    }

    /// The link is gone: both ends learn it (a transport reports a loss
    /// after the messages it read; what was still queued is lost).
    pub(super) fn lose_link(&mut self, l: ConnId) {
        if !self.alive.lock().insert(l, false).unwrap_or(false) {
            return;
        }
        let Some(link) = self.links.get_mut(&l) else { return };
        link.fwd.clear();
        link.back.clear();
        let (from, to) = (link.from, link.to);
        for n in [from, to] {
            let why = Error::PeerLost(format!("connection {l} lost"));
            let (rpc, w) = (self.nodes[n].rpc.clone(), self.nodes[n].wire.clone());
            rpc.link_lost(&*w, l, &why);
            self.drain_wire(n);
            let acts = self.nodes[n].rdv.on_link_lost(l, why);
            self.exec(n, acts);
        }
        self.nodes[to].rdv.sender_gone(l);
    }

    /// Task `n` crashes and starts again (a new incarnation): its links
    /// go, its callbacks with it; doorbells still queued for it from the
    /// old life are delivered to the new one (they must land nowhere).
    fn restart(&mut self, n: usize) {
        // Sorted: the seed, not the hash map's order, decides.
        let mut mine: Vec<ConnId> = self.links.iter().filter(|(_, l)| l.from == n || l.to == n).map(|(id, _)| *id).collect();
        mine.sort_unstable();
        let mut stale: Vec<(ConnId, u32)> = self.links.iter().filter(|(_, l)| l.to == n).flat_map(|(id, l)| l.imms.iter().map(move |i| (*id, *i))).collect();
        stale.sort_by_key(|(l, _)| *l);
        for l in &mine {
            // The crashed side learns nothing; the survivor does.
            if !self.alive.lock().insert(*l, false).unwrap_or(false) {
                continue;
            }
            let link = self.links.get_mut(l).expect("listed");
            link.fwd.clear();
            link.back.clear();
            let other = if link.from == n { link.to } else { link.from };
            let why = Error::PeerLost(format!("task {n} crashed"));
            let (rpc, w) = (self.nodes[other].rpc.clone(), self.nodes[other].wire.clone());
            rpc.link_lost(&*w, *l, &why);
            self.drain_wire(other);
            let acts = self.nodes[other].rdv.on_link_lost(*l, why);
            self.exec(other, acts);
        }
        self.work.retain(|w| match w {
            Work::Write { node, .. } | Work::Copy { node, .. } => *node != n,
        });
        self.t.forget(n);
        self.later.retain(|(owner, _)| *owner != n);
        let inc = self.nodes[n].incarnation + 1000;
        let fresh = self.new_node(n, inc);
        let old = std::mem::replace(&mut self.nodes[n], fresh);
        drop(old);
        // The crashed task's own unfinished ops go with it.
        self.ops.retain(|o| !matches!(o, Op::Send { from, .. } if *from == n) && !matches!(o, Op::Recv { at, .. } if *at == n));
        for (l, imm) in stale {
            let node = &mut self.nodes[n];
            let acts = node.rdv.on_write_imm(l, imm, &Mem(&node.mem));
            if !acts.is_empty() {
                flag(&self.v, format!("a doorbell from task {n}'s previous life on connection {l} reached its new one: {acts:?}"));
            }
        }
    }

    pub(super) fn protocol_close(&mut self, n: usize, l: ConnId, why: Error) {
        if !self.faults {
            flag(&self.v, format!("task {n} closed connection {l} without a fault: {why}"));
        }
        self.lose_link(l);
    }
}
