//! An opened device (host channel adapter) and what every connection on
//! it shares: the shared receive queue and its registered buffers, the
//! completion queues, the arena registrations and the write-source
//! registration cache. Above `device` (its base objects) and `mr` (the
//! registrations); below the connections.

use std::sync::Arc;

use rdma_sys::*;

use super::device::{memlock_check, CompChannel, Context, Cq, Pd};
use super::mr::arena::ArenaReg;
use super::mr::cache::RegCache;
use super::mr::Mr;
use crate::error::{Error, Result};

/// A shared receive queue: `depth` buffers of `slot` bytes carved from one
/// registered slab, all posted at creation and each reposted as soon as
/// its completion has been handled, so the pool never drains while the
/// progress thread runs. Every connection on the device receives into it;
/// a completion's `qp_num` says which connection a buffer served.
/// Field order = drop order: the SRQ, then its registration, then memory.
pub struct Srq {
    raw: *mut ibv_srq,
    mr: Mr,
    mem: super::mr::PageBuf,
    pub slot: usize,
    pub depth: u32,
}

// SAFETY: ibv_srq is a thread-safe handle; buffers are owned by index (a
// buffer is touched only between its completion and its repost, both on
// the progress thread).
unsafe impl Send for Srq {}
// SAFETY: as above.
unsafe impl Sync for Srq {}

impl Srq {
    pub fn new(pd: &Arc<Pd>, depth: u32, slot: usize) -> Result<Arc<Srq>> {
        let max = pd.ctx.info.max_srq_wr.max(0) as u32;
        let depth = if max > 0 { depth.min(max) } else { depth };
        let mem = super::mr::PageBuf::new(slot * depth as usize)?;
        memlock_check(mem.len() as u64, "the shared receive queue's buffers")?;
        // SAFETY: mem lives in the same struct and is dropped after the MR.
        let mr = unsafe { Mr::register(pd, mem.as_ptr(), mem.len(), super::mr::ACCESS_LOCAL_WRITE)? };
        // SAFETY: zeroed POD init-attr, then filled.
        let mut attr: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr.max_wr = depth;
        attr.attr.max_sge = 1;
        // SAFETY: pd is live; attr is a valid in/out struct.
        let raw = unsafe { ibv_create_srq(pd.raw, &mut attr) };
        if raw.is_null() {
            return Err(Error::last_os(&format!(
                "ibv_create_srq({depth} buffers) on {} (device max_srq_wr {max}; lower RDMA_DEVICE_VERBS_SRQ_DEPTH)",
                pd.ctx.info.name
            )));
        }
        let srq = Arc::new(Srq { raw, mr, mem, slot, depth });
        for i in 0..depth {
            srq.post(i)?;
        }
        Ok(srq)
    }

    /// The buffer at `i` (`i < depth`).
    pub fn buf(&self, i: u32) -> *const u8 {
        // SAFETY: i < depth keeps the offset inside the allocation.
        unsafe { self.mem.as_ptr().add(self.slot * i as usize) }
    }

    /// (Re)post buffer `i`.
    pub fn post(&self, i: u32) -> Result<()> {
        if i >= self.depth {
            return Err(Error::Internal(format!("receive buffer {i} out of range")));
        }
        let mut sge = ibv_sge { addr: self.buf(i) as u64, length: self.slot as u32, lkey: self.mr.lkey };
        let mut wr = ibv_recv_wr {
            wr_id: super::wr::encode(super::wr::WrKind::Recv, 0, i),
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the SRQ is live; wr and sge live across the call; buffer i
        // is registered and not posted (its completion was handled).
        let rc = unsafe { ibv_post_srq_recv(self.raw, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(Error::Io(format!("ibv_post_srq_recv: {}", std::io::Error::from_raw_os_error(rc))));
        }
        Ok(())
    }

    pub(crate) fn raw(&self) -> *mut ibv_srq {
        self.raw
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: raw from ibv_create_srq; every QP using it is destroyed
        // (each holds an Arc to us).
        let rc = unsafe { ibv_destroy_srq(self.raw) };
        if rc != 0 {
            log::warn!("verbs: ibv_destroy_srq failed ({rc})");
        }
    }
}

struct SendCq {
    cq: Arc<Cq>,
    reserved: u32,
}

/// Everything the connections on one device share: PD, one completion
/// channel, the shared receive queue with its receive CQ (sized to the
/// SRQ, so it cannot overflow), and as many send CQs as the connections'
/// reservations need.
pub struct Device {
    pub ctx: Arc<Context>,
    pub pd: Arc<Pd>,
    pub channel: Arc<CompChannel>,
    pub srq: Arc<Srq>,
    pub recv_cq: Arc<Cq>,
    send_cqs: parking_lot::Mutex<Vec<SendCq>>,
    /// Every CQ (receive first), for the progress thread's polling.
    cqs: parking_lot::Mutex<Arc<Vec<Arc<Cq>>>>,
    /// Arena registrations by listener token.
    pub(crate) arenas: parking_lot::Mutex<std::collections::HashMap<u64, Arc<ArenaReg>>>,
    /// Registrations of write sources (see `mr::cache`).
    pub(crate) regs: Arc<RegCache>,
}

impl Device {
    /// Open the device's shared objects (registers the shared receive
    /// buffers: never on the progress thread). `cache` bytes of write
    /// sources may stay registered (`trust`: tests only, see `mr::cache`).
    pub fn open(ctx: Arc<Context>, srq_depth: u32, cache: u64, trust: bool) -> Result<Arc<Device>> {
        let pd = Pd::new(ctx.clone())?;
        let channel = CompChannel::new(ctx.clone())?;
        let srq = Srq::new(&pd, srq_depth, super::SLOT_BYTES)?;
        let max_cqe = ctx.info.max_cqe.max(1) as u32;
        let recv_cq = Cq::new(&ctx, channel.clone(), (srq.depth + 64).min(max_cqe))?;
        Ok(Arc::new(Device {
            ctx,
            channel,
            srq,
            recv_cq: recv_cq.clone(),
            send_cqs: parking_lot::Mutex::new(Vec::new()),
            cqs: parking_lot::Mutex::new(Arc::new(vec![recv_cq])),
            arenas: Default::default(),
            regs: RegCache::new(pd.clone(), cache, trust),
            pd,
        }))
    }

    pub fn name(&self) -> &str {
        &self.ctx.info.name
    }

    /// Every CQ of the device.
    pub fn cqs(&self) -> Arc<Vec<Arc<Cq>>> {
        self.cqs.lock().clone()
    }

    /// A send CQ with `n` entries free for a new connection (a CQ must
    /// never overflow: that would break every QP on it); opens another
    /// CQ when the existing ones are promised.
    pub fn reserve_send_cq(&self, n: u32) -> Result<Arc<Cq>> {
        let mut cqs = self.send_cqs.lock();
        if let Some(g) = cqs.iter_mut().find(|g| g.reserved + n <= g.cq.capacity) {
            g.reserved += n;
            return Ok(g.cq.clone());
        }
        let cap = (self.ctx.info.max_cqe.max(1) as u32).min(super::CQ_ENTRIES);
        if cap < n {
            return Err(Error::ResourceExhausted(format!(
                "{} allows completion queues of {cap} entries, but one connection needs {n}",
                self.name()
            )));
        }
        let conns: u32 = cqs.iter().map(|g| g.reserved / n.max(1)).sum();
        let cq = Cq::new(&self.ctx, self.channel.clone(), cap).map_err(|e| {
            Error::ResourceExhausted(format!(
                "cannot open send completion queue #{} on {} ({cap} entries, {} per connection,                  ~{conns} connections so far): {}",
                cqs.len() + 1,
                self.name(),
                n,
                e.message()
            ))
        })?;
        cqs.push(SendCq { cq: cq.clone(), reserved: n });
        let mut all = (**self.cqs.lock()).clone();
        all.push(cq.clone());
        *self.cqs.lock() = Arc::new(all);
        Ok(cq)
    }

    pub fn release_send_cq(&self, cq: &Arc<Cq>, n: u32) {
        let mut cqs = self.send_cqs.lock();
        if let Some(g) = cqs.iter_mut().find(|g| Arc::ptr_eq(&g.cq, cq)) {
            g.reserved = g.reserved.saturating_sub(n);
        }
    }
}
