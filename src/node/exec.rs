//! Carrying out the protocol's actions: the protocol state behind its
//! lock (`locked`), control messages (`send_msg`), actions (`exec`), a
//! failed link (`fail_link`) and a received tensor's lease. The locks and
//! their order: the module docs of node/mod.rs.

use super::*;

/// Where a control message's I/O happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Io {
    /// On the calling thread (a non-blocking send; shm queues what the
    /// socket does not take).
    Here,
    /// Posted: no I/O on the calling thread, e.g. a received tensor's
    /// release on a TensorFlow thread (`Listener::post_msg`).
    Posted,
}

impl Inner {
    /// Ends `step` here (`Node::step_done`, idle steps).
    pub(super) fn step_done(&self, step: u64) {
        self.fail_queued(|s| s == step, &|| Error::Aborted(format!("step {step} finished before this tensor was sent")));
        let acts = self.locked(|r| r.step_done(step));
        self.exec(acts);
    }

    /// Ends the steps idle for `IDLE_STEP_LINGER_MS` (`rdev-keepalive`).
    /// `scratch` is kept from call to call: nothing is allocated.
    pub(super) fn end_idle_steps(&self, now: std::time::Instant, scratch: &mut Vec<u64>) {
        scratch.clear();
        let linger = std::time::Duration::from_millis(crate::constants::IDLE_STEP_LINGER_MS);
        self.idle.lock().expired(now, linger, scratch);
        for &step in scratch.iter() {
            log::debug!("{}: step {step} idle for {linger:?}: it ends", self.task);
            self.step_done(step);
        }
    }

    pub(super) fn notify_progress(&self) {
        *self.progress.0.lock() += 1;
        self.progress.1.notify_all();
    }

    /// Wait until `notify_progress` runs or `until` passes.
    pub(super) fn wait_progress(&self, seen: u64, until: std::time::Instant) -> u64 {
        let mut g = self.progress.0.lock();
        if *g == seen {
            self.progress.1.wait_until(&mut g, until);
        }
        *g
    }

    /// Run `f` on the protocol state, mirroring its counters into Stats;
    /// then fail the links whose grant `f` refused (which takes `links`:
    /// never call it with `links` held, see `locked_under_links`).
    pub(super) fn locked<T>(&self, f: impl FnOnce(&mut Rendezvous) -> T) -> T {
        let (out, refused) = self.locked_under_links(f);
        self.fail_refused(refused);
        out
    }

    /// Fail the links `locked_under_links` returned (not under `links`).
    pub(super) fn fail_refused(&self, refused: Vec<(ConnId, Error)>) {
        for (link, why) in refused {
            self.fail_link(link, why);
        }
    }

    /// `locked` for a caller that holds `links` (lock order: `links`, then
    /// the protocol state): the links whose grant `f` refused are returned
    /// for it to fail with `fail_refused` once it let go of `links`
    /// (failing one takes `links`: that would be a self-deadlock).
    pub(super) fn locked_under_links<T>(&self, f: impl FnOnce(&mut Rendezvous) -> T) -> (T, Vec<(ConnId, Error)>) {
        let mut r = self.rdv.lock();
        // Others wait on this lock: a grant made in `f` must not pin
        // memory here (verbs registers on its setup thread instead).
        let no_blocking = fabric::no_blocking();
        let out = f(&mut r);
        drop(no_blocking);
        // Grants happened inside `f` (the `NodeGranter`); the links whose
        // grant failed are failed below, outside the lock.
        let refused = r.take_refused();
        let t = std::mem::take(&mut r.tally);
        let in_use = r.arena_in_use();
        drop(r);
        if t != rendezvous::Tally::default() {
            self.totals.lock().add(&t);
        }
        let c = &Stats::global().c;
        c.add_tally(&t);
        c.arena_bytes_in_use.store(in_use, std::sync::atomic::Ordering::Relaxed);
        (out, refused.into_iter().collect())
    }

    pub(super) fn endpoint(&self, link: ConnId) -> Option<Arc<dyn Endpoint>> {
        match self.links.lock().get(&link) {
            Some(LinkRef::Tx(e)) => Some(e.clone()),
            _ => None,
        }
    }

    pub(super) fn send_msg(&self, link: ConnId, msg: &rendezvous::Msg) -> Result<()> {
        self.send_msg_via(link, msg, Io::Here)
    }

    /// Messages queued on `link` that wait for its peer (0 where the
    /// backend does not count them, or the link is gone).
    pub(super) fn link_backlog(&self, link: ConnId) -> usize {
        let target = match self.links.lock().get(&link) {
            Some(LinkRef::Tx(e)) => Ok(e.clone()),
            Some(LinkRef::Rx(k)) => Err(*k),
            None => return 0,
        };
        match target {
            Ok(e) => e.backlog(),
            Err(kind) => self.listeners.lock().get(&kind).cloned().map_or(0, |l| l.backlog(link)),
        }
    }

    /// `send_msg`, with the control message's I/O done as `io` says.
    pub(super) fn send_msg_via(&self, link: ConnId, msg: &rendezvous::Msg, io: Io) -> Result<()> {
        msg.check()?;
        let bytes = msg.encode();
        let target = match self.links.lock().get(&link) {
            Some(LinkRef::Tx(e)) => Ok(e.clone()),
            Some(LinkRef::Rx(k)) => Err(*k),
            None => return Err(Error::PeerLost(format!("connection {link} is closed"))),
        };
        match (target, io) {
            (Ok(e), Io::Here) => e.send_msg(&bytes),
            (Ok(e), Io::Posted) => e.post_msg(&bytes),
            (Err(kind), io) => {
                let l = self.listeners.lock().get(&kind).cloned();
                let l = l.ok_or_else(|| Error::PeerLost("listener closed".into()))?;
                if io == Io::Posted {
                    l.post_msg(link, &bytes)
                } else {
                    l.send_msg(link, &bytes)
                }
            }
        }
    }

    /// Carry out protocol actions (never called with the state locked).
    pub(super) fn exec(&self, acts: Actions) {
        self.exec_via(acts, Io::Here)
    }

    pub(super) fn exec_via(&self, acts: Actions, io: Io) {
        let on_event_thread = fabric::on_event_thread();
        for a in acts {
            // Stream chunk writes and slot copies go to the rdev-stream pool
            // themselves; a message-borne chunk is copied here, so it moves.
            let copies = matches!(a, Action::SendChunk { .. } | Action::CopyChunk { src: rendezvous::ChunkSrc::Bytes(_), .. });
            // A receive whose completion only wakes a waiting thread
            // (`Complete::runs_anywhere`), or whose callback the
            // application declared fit for an event thread
            // (`Complete::event_thread_ok`: `rdev_recv_inline`, on success),
            // is delivered here: one
            // thread wake-up less between the tensor landing and its user.
            let waiter = matches!(&a, Action::Deliver { done, result } if done.runs_anywhere() || (result.is_ok() && done.event_thread_ok()));
            if on_event_thread
                && !waiter
                && (copies || matches!(a, Action::Write { .. } | Action::Deliver { .. } | Action::SendDone { .. } | Action::StreamAlloc { .. }))
            {
                // Not on a backend's event thread: see handoff.rs.
                self.handoff.run(a);
                continue;
            }
            match a {
                Action::Write { link, offset, key, header, payload, imm, done, bytes: _ } => {
                    let Some(ep) = self.endpoint(link) else {
                        payload.release();
                        done.complete(Err(Error::PeerLost(format!("connection {link} is closed"))));
                        let acts = self.locked(|r| r.write_done(link));
                        self.exec(acts);
                        continue;
                    };
                    let (step, bytes) = (header.step, header.len);
                    let op = write::TensorWrite::new(header.encode(), payload, write::Then::Send(done), self.me.clone(), link);
                    if bytes as usize >= crate::constants::WRITE_ENGINE_MIN {
                        // Posted, as to a NIC: this (TensorFlow's) thread
                        // returns; the copy runs on rdev-write.
                        self.engine.post(ep, offset, key, imm, op, step, bytes);
                    } else {
                        let t = trace::start();
                        ep.write(offset, key, imm, op);
                        trace::end("write", t, step, bytes, None);
                    }
                }
                Action::WriteChunk { link, stream, offset, key, header, payload, imm } => self.write_chunk(link, stream, offset, key, header, payload, imm),
                Action::SendChunk { link, stream, offset, payload } => self.send_chunk(link, stream, offset, payload),
                Action::StreamAlloc { link, stream, total } => self.stream_alloc(link, stream, total),
                Action::CopyChunk { link, stream, src, len, dst, at } => self.copy_chunk(link, stream, src, len, dst, at),
                Action::Send { link, msg } => {
                    log::trace!("{}: send on {link}: {msg:?}", self.task);
                    let t = trace::start();
                    let sent = self.send_msg_via(link, &msg, io);
                    trace::end(msg.name(), t, 0, 0, None);
                    if let Err(e) = sent {
                        // A lost Publish or Credit would stall the edge
                        // forever: the link is unusable, fail it now.
                        let why = Error::PeerLost(format!("{}: control message {} on connection {link} not sent: {}", self.task, msg.name(), e.message()));
                        self.fail_link(link, why);
                    }
                }
                Action::Close { link, why } => self.fail_link(link, why),
                Action::SendDone { done, result } => done.complete(result),
                Action::Deliver { done, result } => {
                    let (t, bytes) = (trace::start(), result.as_ref().map_or(0, |r| match &r.data {
                        Data::Slot { len, .. } => *len,
                        Data::Owned(v) => v.len() as u64,
                    }));
                    done.complete(result);
                    trace::end("deliver", t, 0, bytes, None);
                }
                Action::Release { link, slot, gen } => {
                    let acts = self.locked(|r| r.release(link, slot, gen));
                    self.exec_via(acts, io);
                }
                Action::PlaceFor { link, req, receiver, key, bytes } => self.place_for(link, req, receiver, key, bytes),
                Action::PlaceDone { req, outcome, error } => self.placement_answered(req, outcome, error),
            }
        }
    }

    /// Close `link` and fail everything that depends on it with `why` now
    /// (the transport's own disconnect event may come later, with a less
    /// telling reason, and then finds nothing left to fail).
    pub(super) fn fail_link(&self, link: ConnId, why: Error) {
        log::warn!("{}: closing connection {link}: {why}", self.task);
        let l = self.links.lock().get(&link).map(|l| match l {
            LinkRef::Tx(e) => Ok(e.clone()),
            LinkRef::Rx(k) => Err(*k),
        });
        match l {
            Some(Ok(e)) => e.close(),
            Some(Err(k)) => {
                // Looked up first: `listeners` is not held across the call.
                let l = self.listeners.lock().get(&k).cloned();
                if let Some(l) = l {
                    l.close_conn(link);
                }
            }
            None => {}
        }
        self.rpc_link_lost(link, &why);
        let acts = self.locked(|r| r.on_link_lost(link, why));
        self.exec(acts);
        self.notify_progress();
    }

    pub(super) fn lease(&self, r: Received) -> Lease {
        let (ptr, len, arena) = match &r.data {
            Data::Slot { offset, len, .. } => {
                // The protocol only hands out ranges inside the arena it was
                // sized for; check anyway, since the bytes reach TensorFlow.
                let ok = (*offset as usize).checked_add(*len as usize).is_some_and(|e| e <= self.arena.len());
                if ok {
                    (self.arena.as_ptr().wrapping_add(*offset as usize) as *const u8, *len as usize, Some(self.arena.clone()))
                } else {
                    (std::ptr::null(), 0, None)
                }
            }
            Data::Owned(v) => (v.as_ptr(), v.len(), None),
        };
        Lease::new(self.me.clone(), arena, r.meta, r.data, ptr, len)
    }
}
