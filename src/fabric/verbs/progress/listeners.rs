//! A listener's state, shared by its face (`listener::VerbsListener`,
//! which grants) and the progress thread (which accepts its connections
//! and tears them down): here, below both, so that the runtime does not
//! import the face built on it.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::fabric::verbs::cm::CmId;
use crate::fabric::verbs::hca::Device;
use crate::fabric::verbs::mr::arena::ArenaReg;
use crate::fabric::verbs::mr::{ACCESS_REMOTE, ACCESS_WINDOWS};
use crate::fabric::verbs::mw::Mw;
use crate::fabric::{Arena, ConnId, FabricEvents};

pub(crate) struct ListenerShared {
    pub token: u64,
    pub addr: String,
    pub events: Arc<dyn FabricEvents>,
    pub arena: Arc<Arena>,
    pub cm: Mutex<Option<CmId>>,
    pub conns: Mutex<HashSet<ConnId>>,
    /// Use type-2 memory windows where the device has them.
    pub windows_wanted: bool,
    /// The windows over the arena: start offset → (end, window). Never
    /// overlapping: a grant revokes what it overlaps first.
    pub windows: Mutex<BTreeMap<u64, (u64, Arc<Mw>)>>,
    /// The arena's registration chunk (see `mr::arena`).
    pub chunk: u64,
}

impl ListenerShared {
    /// The arena's registration on `dev` (made on first use; each device
    /// has its own keys). With type-2 windows nothing is pinned here (see
    /// `mr::arena`); without, the whole arena is registered now: never
    /// on the progress thread.
    pub fn arena_reg(&self, dev: &Device) -> Result<Arc<ArenaReg>> {
        if let Some(a) = dev.arenas.lock().get(&self.token) {
            return Ok(a.clone());
        }
        let len = self.arena.len();
        if len as u64 > dev.ctx.info.max_mr_size {
            return Err(Error::ResourceExhausted(format!(
                "receive arena of {len} bytes exceeds {}'s largest memory region ({} bytes); \
                 use a smaller arena",
                dev.name(),
                dev.ctx.info.max_mr_size
            )));
        }
        // The arena's own pages through a mapping that is never remapped
        // (shm senders' windows are mapped over ranges of the main one;
        // see fabric/arena.rs), so a verbs peer never reaches their pages.
        let base = self.arena.registration_base()?;
        // With type-2 windows the regions themselves grant no remote
        // access (see `mw`); without, the one region all verbs senders
        // share.
        let windows = self.windows_wanted && dev.ctx.info.mw_type2;
        if !windows {
            log::warn!(
                "verbs: {}: {}; verbs senders share the arena's memory region, so one that ignores the protocol \
                 can overwrite another verbs sender's slots (shm senders stay isolated); the arena is registered whole",
                dev.name(),
                if self.windows_wanted { "no type-2 memory windows on this device" } else { "memory windows are off" }
            );
        }
        // The mapping lives as long as `self.arena`, which this listener
        // holds; the registration is dropped (in close_listener, and with
        // the last connection and window holding it) before the listener.
        let access = if windows { ACCESS_WINDOWS } else { ACCESS_REMOTE };
        // Registered (without windows: pinned whole) outside the device's
        // table lock, which `close_listener` takes on the progress thread.
        let a = ArenaReg::new(&dev.pd, base, len as u64, windows, self.chunk, access)?;
        // A listener closed meanwhile must not get a registration back
        // into the table (`close_listener` takes `cm`, then clears it).
        let open = self.cm.lock();
        if open.is_none() {
            return Err(Error::Aborted(format!("listener {} is closed", self.addr)));
        }
        let a = dev.arenas.lock().entry(self.token).or_insert(a).clone();
        drop(open);
        Ok(a)
    }
}
