//! The sender's registration cache: zero-copy writes from arbitrary
//! (application) memory without a registration per write.
//!
//! A large write's segments are written straight from the application's
//! memory, which must be registered. Registering per write costs a kernel
//! pin + translation + unpin per write (see docs/verbs.md's numbers); the
//! cache keeps a write source's region after the write and hands it to the
//! next write from the same pages, as TensorFlow's allocator hands a
//! step's tensor the memory the last step freed.
//!
//! **What makes reuse safe.** A region pins the pages that were mapped at
//! registration; they stay valid for the NIC whatever the application
//! does, but after the range is unmapped and mapped again, or its pages
//! discarded, the same addresses show *other* pages and the cached region
//! would send stale bytes. So an entry is cached only while the kernel
//! reports every such change of its range: each cached range is watched
//! through userfaultfd (`watch`), and every lookup first applies the
//! changes reported since the last one (dropping the entries they touch)
//! under the cache's lock. A call that unmaps or discards a watched range
//! returns only after the watch thread read its event, and a lookup never
//! trusts the cache while that thread holds events it has not published
//! (`Watch::busy`), so a lookup that follows such a call cannot find the
//! old entry. An entry registered while its range changed (between the
//! watch and the registration) is not cached (`insert`'s check). Ranges
//! that cannot be watched (shared memory, file mappings, no userfaultfd
//! in this process) are registered per write, uncached, as before.
//! Deliberately *not* used: time-bounded caching (no bound is safe), a
//! content check (as costly as the copy it avoids), /proc/self/maps per
//! write (slow, and it cannot see a discard), hooking munmap/free (not
//! possible from a library loaded into TensorFlow without LD_PRELOAD).
//!
//! **Bounds.** At most [`super::super::VerbsOptions::mr_cache_bytes`]
//! pinned bytes and [`MAX_ENTRIES`] entries; to stay within them the least
//! recently used entries that no write holds are evicted (deregistered
//! once the last write holding them completes), and when
//! writes in flight hold everything a new registration serves its own
//! write only (uncached). Before
//! pinning anything new, RLIMIT_MEMLOCK is checked against what the
//! backend pinned (`mr::may_pin`), evicting idle entries to make room;
//! when that is not enough, or the registration fails, [`Miss`] says so
//! and the write goes through the staging buffers instead (logged,
//! counted in `verbs_staged_fallbacks`).
//!
//! Threading: `get` runs on the writer's thread (never the progress
//! thread: the node hands writes to its own threads); the lock is held
//! for lookups, event application and eviction, never across a
//! registration. `rdev-verbs-inval` applies the watch's events as they
//! come, so the pages of memory the application freed are unpinned at
//! once rather than at the next lookup. An entry dropped on the progress
//! thread is deregistered on `rdev-verbs-dereg` (`Mr`'s drop).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::watch::{forked, guard_fork, Since, Watch, Watched};
use super::{page_span, Mr, ACCESS_LOCAL_READ};
use crate::error::Error;
use crate::fabric::verbs::device::Pd;
use crate::stats::Stats;

/// Most entries kept (each watched range may split a mapping in three:
/// this bounds what the cache adds to the process's map count).
pub const MAX_ENTRIES: usize = 1024;

/// A registration a write holds: cached (shared with later writes) or its
/// own (uncached).
pub(crate) struct Reg {
    pub mr: Mr,
    /// Lookup tick of the last use (LRU).
    last: AtomicU64,
}

/// Why a segment got no registration: the write goes through staging.
#[derive(Debug)]
pub(crate) enum Miss {
    /// RLIMIT_MEMLOCK would be exceeded even after evicting idle entries.
    Memlock(u64),
    /// `ibv_reg_mr` failed.
    Failed(Error),
}

impl std::fmt::Display for Miss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Miss::Memlock(n) => write!(
                f,
                "pinning {n} more bytes would exceed RLIMIT_MEMLOCK ({} bytes; {} pinned by this backend); \
                 raise it (`ulimit -l unlimited`, `* - memlock unlimited` in /etc/security/limits.conf)",
                crate::fabric::verbs::device::memlock_limit().unwrap_or(u64::MAX),
                super::pinned_bytes()
            ),
            Miss::Failed(e) => write!(f, "{e}"),
        }
    }
}

/// A cached registration and its hold on the watch: its range is watched
/// while the entry is cached (and until it is dropped, outside the lock).
struct Entry {
    reg: Arc<Reg>,
    _watched: Option<Watched>,
}

struct State {
    /// Cached entries by their page-aligned `(start, end)`.
    map: BTreeMap<(u64, u64), Entry>,
    bytes: u64,
    /// Watch events applied up to here.
    seen: u64,
    tick: u64,
    /// Entries just removed: dropped (maybe deregistered and unwatched)
    /// after the lock is released.
    dead: Vec<Entry>,
}

/// One protection domain's cache.
pub(crate) struct RegCache {
    pd: Arc<Pd>,
    cap: u64,
    watch: Option<&'static Watch>,
    /// Tests only: cache without watching (shows the stale-page hazard).
    trust: bool,
    state: Mutex<State>,
}

/// Every cache with a watch, for `rdev-verbs-inval`.
static CACHES: Mutex<Vec<std::sync::Weak<RegCache>>> = Mutex::new(Vec::new());

/// Start (once) the thread that applies the watch's events to every cache
/// as they come (see the module docs).
fn start_inval(w: &'static Watch) {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let r = std::thread::Builder::new().name("rdev-verbs-inval".into()).spawn(move || loop {
            w.wait();
            let live: Vec<Arc<RegCache>> = {
                let mut c = CACHES.lock();
                c.retain(|x| x.strong_count() > 0);
                c.iter().filter_map(|x| x.upgrade()).collect()
            };
            for cache in live {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cache.apply())).is_err() {
                    log::error!("verbs: applying unmap events panicked on rdev-verbs-inval; the thread goes on");
                }
            }
        });
        if let Err(e) = r {
            log::warn!("verbs: cannot start rdev-verbs-inval ({e}): unmapped registrations are released at the next write");
        }
    });
}

impl RegCache {
    /// A cache of at most `cap` bytes (0: no caching, a registration per
    /// write). `trust_mappings` (tests only) caches without the watch.
    pub fn new(pd: Arc<Pd>, cap: u64, trust_mappings: bool) -> Arc<RegCache> {
        guard_fork();
        let watch = if cap == 0 || trust_mappings {
            None
        } else {
            match Watch::get() {
                Ok(w) => Some(w),
                Err(why) => {
                    static ONCE: std::sync::Once = std::sync::Once::new();
                    ONCE.call_once(|| {
                        log::warn!("verbs: registration cache off: {why}; large writes register their memory per write")
                    });
                    None
                }
            }
        };
        let seen = watch.map(|w| w.head()).unwrap_or(0);
        let c = Arc::new(RegCache {
            pd,
            cap,
            watch,
            trust: trust_mappings && cap > 0,
            state: Mutex::new(State { map: BTreeMap::new(), bytes: 0, seen, tick: 0, dead: Vec::new() }),
        });
        if let Some(w) = watch {
            CACHES.lock().push(Arc::downgrade(&c));
            start_inval(w);
        }
        c
    }

    /// Apply the watch's events now (`rdev-verbs-inval`).
    fn apply(&self) {
        let mut s = self.state.lock();
        self.usable(&mut s);
        let dead = std::mem::take(&mut s.dead);
        drop(s);
        drop(dead);
    }

    /// Whether ranges are cached at all.
    pub fn caching(&self) -> bool {
        (self.watch.is_some() || self.trust) && !forked()
    }

    /// A registration covering `len` bytes at `addr` for a write: a cached
    /// one, or a new one (cached when its range can be watched).
    pub fn get(&self, addr: *const u8, len: usize) -> Result<Arc<Reg>, Miss> {
        let (start, end) = page_span(addr as u64, len);
        let st = Stats::global();
        if self.caching() {
            let mut s = self.state.lock();
            let hit = if self.usable(&mut s) { lookup(&s.map, start, end) } else { None };
            if let Some(r) = &hit {
                s.tick += 1;
                r.last.store(s.tick, Ordering::Relaxed);
            }
            let dead = std::mem::take(&mut s.dead);
            drop(s);
            drop(dead);
            if let Some(r) = hit {
                Stats::add(&st.c.verbs_mr_cache_hits, 1);
                return Ok(r);
            }
        }
        // A miss: watch first, then register, so that any change of the
        // range after the pages were pinned is reported. The miss holds its
        // watch until the entry is cached (which then holds it) or not.
        let watch = self.watch.filter(|_| !forked());
        let from = watch.map(|w| w.head()).unwrap_or(0);
        let watched = watch.and_then(|w| w.watch(start, end).ok());
        let cacheable = watched.is_some() || (self.watch.is_none() && self.trust && !forked());
        let n = end - start;
        if !super::may_pin(n) && !self.make_room(n) {
            return Err(Miss::Memlock(n));
        }
        // SAFETY: the region covers the writer's pages; it is used only by
        // writes whose source lies in it while the mapping is unchanged
        // (cached entries are dropped on any reported change), and its
        // pages stay pinned, so valid, until it is deregistered.
        let mr = unsafe { Mr::register(&self.pd, start as *const u8, n as usize, ACCESS_LOCAL_READ) }.map_err(Miss::Failed)?;
        Stats::add(&st.c.verbs_write_registrations, 1);
        let r = Arc::new(Reg { mr, last: AtomicU64::new(0) });
        if cacheable {
            self.insert(&r, start, end, from, watched);
        }
        Ok(r)
    }

    /// Apply the watch's news; `false` while it cannot be trusted.
    fn usable(&self, s: &mut State) -> bool {
        let Some(w) = self.watch else { return self.trust };
        if w.busy() {
            return false;
        }
        let mut gone = Vec::new();
        let r = w.since(s.seen, |a, b| gone.push((a, b)));
        let dropped = match r {
            Since::Upto(h) => {
                s.seen = h;
                let mut n = 0;
                for (a, b) in gone {
                    n += drop_overlapping(s, a, b);
                }
                n
            }
            Since::Lost(h) => {
                s.seen = h;
                let n = s.map.len();
                let all = std::mem::take(&mut s.map);
                s.dead.extend(all.into_values());
                s.bytes = 0;
                n
            }
        };
        if dropped > 0 {
            Stats::add(&Stats::global().c.verbs_mr_cache_invalidations, dropped as u64);
        }
        !w.busy()
    }

    /// Cache `r` over `[start, end)`, registered after the watch position
    /// `from`: not if the range changed since (or may have: the reader is
    /// busy), then evict down to the bounds.
    fn insert(&self, r: &Arc<Reg>, start: u64, end: u64, from: u64, watched: Option<Watched>) {
        let mut s = self.state.lock();
        self.insert_locked(&mut s, r, start, end, from, watched);
        let dead = std::mem::take(&mut s.dead);
        drop(s);
        drop(dead);
    }

    fn insert_locked(&self, s: &mut State, r: &Arc<Reg>, start: u64, end: u64, from: u64, watched: Option<Watched>) {
        if !self.usable(s) {
            return;
        }
        if let Some(w) = self.watch {
            let mut changed = false;
            if let Since::Lost(_) = w.since(from, |a, b| changed |= a < end && b > start) {
                changed = true;
            }
            if changed {
                return;
            }
        }
        // Room within the bounds, evicting idle entries; when writes in
        // flight hold everything, this registration serves its write only.
        let n = r.mr.pinned();
        if n > self.cap {
            return;
        }
        while s.bytes + n > self.cap || s.map.len() >= MAX_ENTRIES {
            if !self.evict_one(s) {
                return;
            }
        }
        s.tick += 1;
        r.last.store(s.tick, Ordering::Relaxed);
        if let Some(old) = s.map.insert((start, end), Entry { reg: r.clone(), _watched: watched }) {
            s.bytes -= old.reg.mr.pinned();
            s.dead.push(old);
        }
        s.bytes += n;
    }

    /// Evict idle entries until `n` more bytes may be pinned; `false` if
    /// that is not possible.
    fn make_room(&self, n: u64) -> bool {
        let mut s = self.state.lock();
        while !super::may_pin(n) {
            if !self.evict_one(&mut s) {
                return false;
            }
            // Deregistered now (nothing else holds it), so the count drops.
            s.dead.clear();
        }
        true
    }

    /// Evict the least recently used entry no write holds; `false` if none.
    /// Its deregistration happens when the last reference goes (here), and
    /// its range is unwatched where no other holder (of any cache, or a
    /// miss in flight) covers it (`Watched`'s drop).
    fn evict_one(&self, s: &mut State) -> bool {
        let victim = s
            .map
            .iter()
            .filter(|(_, e)| Arc::strong_count(&e.reg) == 1)
            .min_by_key(|(_, e)| e.reg.last.load(Ordering::Relaxed))
            .map(|(k, _)| *k);
        let Some(k) = victim else { return false };
        if let Some(e) = s.map.remove(&k) {
            s.bytes -= e.reg.mr.pinned();
            s.dead.push(e);
        }
        Stats::add(&Stats::global().c.verbs_mr_cache_evictions, 1);
        true
    }

    /// (entries, pinned bytes) cached now.
    pub fn usage(&self) -> (usize, u64) {
        let s = self.state.lock();
        (s.map.len(), s.bytes)
    }
}

/// The entry covering `[start, end)`, if any: the exact range first, then
/// the nearest entries starting at or before `start`.
fn lookup(map: &BTreeMap<(u64, u64), Entry>, start: u64, end: u64) -> Option<Arc<Reg>> {
    map.range(..=(start, u64::MAX)).rev().take(8).find(|((_, e), _)| *e >= end).map(|(_, e)| e.reg.clone())
}

/// Drop every entry overlapping `[a, b)`; how many.
fn drop_overlapping(s: &mut State, a: u64, b: u64) -> usize {
    let hit: Vec<(u64, u64)> = s.map.range(..(b, 0)).filter(|((x, y), _)| *x < b && *y > a).map(|(k, _)| *k).collect();
    for k in &hit {
        if let Some(e) = s.map.remove(k) {
            s.bytes -= e.reg.mr.pinned();
            s.dead.push(e);
        }
    }
    hit.len()
}
